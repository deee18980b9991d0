-- Flow control shared by every worker (issue 16; docs/flow-control.md): limits on
-- requests and tokens per period and on concurrent leases, checked and charged in the
-- claim statement itself; a usage ledger per attempt; budgets per batch.
--
-- A limit is one row of configuration (agent_limit) and 1 to 8 lanes
-- (agent_limit_lane), each holding an integer share of its requests and slots and an
-- equal share of its tokens, with its own state: a GCRA "theoretical arrival time" per
-- rate (request_tat, token_tat: the earliest database time at which the lane's next
-- request or token conforms) and `acquired`, the slots it ever handed out. A claim
-- takes one free lane of each limit its candidates name (FOR NO KEY UPDATE SKIP
-- LOCKED: claims never wait for each other on a limit), admits a task only if that lane
-- has room, and charges it in the same statement. Each lane is exact, so their sum is:
-- never more requests or live leases than the limit. Claims of tasks that name no
-- limit never touch these tables. Lanes exist so that a busy limit is not one row that
-- every claim queues on (docs/flow-control.md, "Why lanes").
CREATE TABLE agent_limit (
    name            text PRIMARY KEY,
    requests        bigint CHECK (requests > 0),          -- per per_seconds
    tokens          bigint CHECK (tokens > 0),            -- per per_seconds
    per_seconds     float8 NOT NULL DEFAULT 60 CHECK (per_seconds > 0),
    max_concurrent  int CHECK (max_concurrent > 0),       -- live leases at once
    lanes           int NOT NULL DEFAULT 1 CHECK (lanes BETWEEN 1 AND 64),
    blocked_until   timestamptz,                          -- set by a rate-limited answer
    blocked_seconds float8 NOT NULL DEFAULT 0,            -- total time blocked, for metrics
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK (requests IS NOT NULL OR tokens IS NOT NULL OR max_concurrent IS NOT NULL)
);

CREATE TABLE agent_limit_lane (
    limit_name     text        NOT NULL,
    lane           int         NOT NULL,
    requests       bigint,                 -- this lane's share (NULL: no request rate)
    tokens         float8,                 -- this lane's share (NULL: no token rate)
    max_concurrent int,                    -- this lane's share (NULL: no slot limit)
    request_tat    timestamptz NOT NULL DEFAULT '-infinity',
    token_tat      timestamptz NOT NULL DEFAULT '-infinity',
    acquired       bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (limit_name, lane)
);

-- One row per live lease of a task under a limit with max_concurrent, with the lane
-- whose slot it holds. Inserted by the claim, deleted in the same statement that moves
-- the task out of `leased` (ack, fail, throttle, release, expire), like
-- agent_shard_lease: only the lease holder (or the expirer, after it) deletes a row, so
-- deleting never waits.
CREATE TABLE agent_limit_lease (
    limit_name text   NOT NULL,
    task_id    bigint NOT NULL,
    lane       int    NOT NULL,
    PRIMARY KEY (limit_name, task_id)
);
ALTER TABLE agent_limit_lease SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 500
);
ALTER TABLE agent_limit_lane SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 500
);

-- A batch is under flow control once any of its tasks names a limit or it has a budget
-- (set by enqueue and budget_set, never cleared). Workers claim other batches with the
-- plain ack_and_claim, whose plan does not carry the limits' nodes.
ALTER TABLE agent_batch ADD COLUMN flow_control boolean NOT NULL DEFAULT false;

-- What a task draws from: the limits it names (NULL: none, the claim's fast path) and
-- its token estimate; `throttles` counts rate-limited answers (NULL: none), which do
-- not use attempts but end the task dead after a bound. Nullable columns cost nothing
-- on rows that leave them NULL.
ALTER TABLE agent_work_queue
    ADD COLUMN limits    text[],
    ADD COLUMN tokens    bigint,
    ADD COLUMN throttles int;
-- (retention --archive copies rows with SELECT q.*: same columns, same order)
ALTER TABLE agent_work_queue_archive
    ADD COLUMN limits    text[],
    ADD COLUMN tokens    bigint,
    ADD COLUMN throttles int;

-- The usage ledger: what each attempt reported (report_usage calls add up). Failed,
-- throttled and retried attempts have their own rows, so a batch's cost is the truth.
CREATE TABLE agent_task_usage (
    task_id       bigint      NOT NULL,
    attempt       int         NOT NULL,
    batch_id      text        NOT NULL,
    task_key      text        NOT NULL,
    tokens        bigint      NOT NULL DEFAULT 0,
    input_tokens  bigint      NOT NULL DEFAULT 0,
    output_tokens bigint      NOT NULL DEFAULT 0,
    cost          numeric     NOT NULL DEFAULT 0,
    reports       int         NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, attempt)
);
CREATE INDEX agent_task_usage_batch_idx ON agent_task_usage (batch_id);

-- A batch's running totals (kept with each report, in the same transaction as its
-- ledger row) and its budget. The claim reads this one row to stop a batch whose
-- budget is used up; a batch without budget or usage has no row.
CREATE TABLE agent_batch_usage (
    batch_id      text PRIMARY KEY,
    budget_tokens bigint CHECK (budget_tokens >= 0),
    budget_cost   numeric CHECK (budget_cost >= 0),
    tokens        bigint      NOT NULL DEFAULT 0,
    input_tokens  bigint      NOT NULL DEFAULT 0,
    output_tokens bigint      NOT NULL DEFAULT 0,
    cost          numeric     NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
