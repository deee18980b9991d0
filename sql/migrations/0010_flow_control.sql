-- Flow control shared by every worker (issue 16; docs/flow-control.md): limits on
-- requests and tokens per period and on concurrent leases, checked and charged in the
-- claim statement itself; a usage ledger per attempt; budgets per batch.
--
-- A limit is one row. Its rate state is a GCRA "theoretical arrival time" per
-- dimension (request_tat, token_tat): the earliest database time at which the next
-- request (or token) conforms. A claim locks the rows of the limits its candidates
-- name, admits a task when every limit has room, and moves the TATs forward in the
-- same statement; claims of tasks that name no limit never touch this table.
-- Concurrency is counted by rows in agent_limit_lease (one per live lease of a task
-- under a limit with max_concurrent); `acquired` counts the rows ever inserted, so a
-- claim that waited for the limit's lock also counts the leases taken by claims that
-- committed after its snapshot (see ack_and_claim in sql/queries.sql).
CREATE TABLE agent_limit (
    name            text PRIMARY KEY,
    requests        bigint CHECK (requests > 0),          -- per per_seconds
    tokens          bigint CHECK (tokens > 0),            -- per per_seconds
    per_seconds     float8 NOT NULL DEFAULT 60 CHECK (per_seconds > 0),
    max_concurrent  int CHECK (max_concurrent > 0),       -- live leases at once
    blocked_until   timestamptz,                          -- set by a rate-limited answer
    request_tat     timestamptz NOT NULL DEFAULT '-infinity',
    token_tat       timestamptz NOT NULL DEFAULT '-infinity',
    acquired        bigint NOT NULL DEFAULT 0,
    blocked_seconds float8 NOT NULL DEFAULT 0,            -- total time blocked, for metrics
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK (requests IS NOT NULL OR tokens IS NOT NULL OR max_concurrent IS NOT NULL)
);

-- One row per live lease of a task under a limit with max_concurrent. Inserted by the
-- claim, deleted in the same statement that moves the task out of `leased` (ack, fail,
-- throttle, release, expire), like agent_shard_lease: only the lease holder (or the
-- expirer, after it) deletes a row, so deleting never waits.
CREATE TABLE agent_limit_lease (
    limit_name text   NOT NULL,
    task_id    bigint NOT NULL,
    PRIMARY KEY (limit_name, task_id)
);
ALTER TABLE agent_limit_lease SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 500
);

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
