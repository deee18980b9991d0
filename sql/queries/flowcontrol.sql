-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- Flow control (agent_limit, agent_limit_lane, agent_batch_usage; docs/flow-control.md).

-- name: limit_next_room
-- Seconds until a full limit has room again (NULL: none is waiting for time).
--
-- After a claim of a batch under flow control that found nothing: how long until a
-- limit that is full now has room again (the earliest of its lanes' next request or
-- token and its block), so that the worker sleeps until then and not a whole poll
-- interval. Any limit counts (a few rows): waking early only costs a poll.
SELECT extract(epoch FROM min(greatest(
           l.blocked_until,
           CASE WHEN ln.requests IS NOT NULL THEN ln.request_tat END,
           CASE WHEN ln.tokens IS NOT NULL THEN ln.token_tat END)) - clock_timestamp())
       AS seconds
FROM agent_limit l JOIN agent_limit_lane ln ON ln.limit_name = l.name
WHERE l.blocked_until > now() OR ln.request_tat > now() OR ln.token_tat > now();

-- ---------------------------------------------------------------------------------
-- Flow control (jobrunner/store/flowcontrol.py, docs/flow-control.md). A claim never waits for a
-- limit's lane (SKIP LOCKED), so the statements here, which may wait for a claim to
-- commit, can never be part of a cycle of waits with one.

-- name: limit_upsert
-- Create a limit or change the given fields of one.
--
-- Create a limit, or change the given fields of one (NULL: keep the current value).
-- Then limit_lanes_drop and limit_lanes_make (same transaction) split it into lanes.
INSERT INTO agent_limit AS l (name, requests, tokens, per_seconds, max_concurrent)
VALUES (%(name)s, %(requests)s, %(tokens)s, coalesce(%(per_seconds)s::float8, 60),
        %(max_concurrent)s)
ON CONFLICT (name) DO UPDATE
SET requests = coalesce(EXCLUDED.requests, l.requests),
    tokens = coalesce(EXCLUDED.tokens, l.tokens),
    per_seconds = coalesce(%(per_seconds)s::float8, l.per_seconds),
    max_concurrent = coalesce(EXCLUDED.max_concurrent, l.max_concurrent),
    updated_at = now()
RETURNING (xmax = 0) AS created, requests, tokens, per_seconds, max_concurrent;

-- name: limit_set_lanes
-- Set how many lanes a limit is split into.
UPDATE agent_limit SET lanes = %(lanes)s WHERE name = %(name)s;

-- name: limit_lanes_drop
-- Drop a limit's lanes; returns what they carried (times, counters).
--
-- The old lanes (waiting for claims that hold one); returns the state to carry over:
-- the latest TATs (so a re-split never hands out time already charged).
WITH gone AS (DELETE FROM agent_limit_lane WHERE limit_name = %(name)s
              RETURNING request_tat, token_tat)
SELECT coalesce(max(request_tat), '-infinity')::text AS request_tat,  -- (text: Python
       coalesce(max(token_tat), '-infinity')::text AS token_tat       -- has no -infinity)
FROM gone;

-- name: limit_lanes_make
-- Make a limit's lanes again, carrying over what the old ones held.
--
-- lanes rows: lane j gets requests/lanes and max_concurrent/lanes (the remainder to the
-- first lanes), tokens/lanes; live leases move to lane (their lane mod lanes).
WITH made AS (
    INSERT INTO agent_limit_lane (limit_name, lane, requests, tokens, max_concurrent,
                                  request_tat, token_tat)
    SELECT l.name, j,
           CASE WHEN l.requests IS NOT NULL
                THEN l.requests / l.lanes + (j < l.requests %% l.lanes)::int END,
           CASE WHEN l.tokens IS NOT NULL THEN l.tokens::float8 / l.lanes END,
           CASE WHEN l.max_concurrent IS NOT NULL
                THEN l.max_concurrent / l.lanes + (j < l.max_concurrent %% l.lanes)::int END,
           %(request_tat)s::timestamptz, %(token_tat)s::timestamptz
    FROM agent_limit l, generate_series(0, l.lanes - 1) AS j
    WHERE l.name = %(name)s
)
UPDATE agent_limit_lease s SET lane = s.lane %% l.lanes
FROM agent_limit l
WHERE s.limit_name = %(name)s AND l.name = %(name)s;

-- name: limit_list
-- The limits (all, or the given names) with their live use.
--
-- Each limit with its current use: requests and tokens charged but not yet "paid off"
-- by time (how far its lanes' GCRA clocks run ahead of now, in the limit's units of one
-- period), live leases, and how long it stays blocked.
SELECT l.name, l.requests, l.tokens, l.per_seconds, l.max_concurrent, l.lanes,
       l.blocked_until, l.blocked_seconds,
       greatest(extract(epoch FROM l.blocked_until - now()), 0) AS blocked_for_seconds,
       CASE WHEN l.requests IS NOT NULL THEN (
           SELECT sum(least(ln.requests, greatest(0,
                      extract(epoch FROM ln.request_tat - now()) * ln.requests / l.per_seconds)))
           FROM agent_limit_lane ln WHERE ln.limit_name = l.name) END AS requests_used,
       CASE WHEN l.tokens IS NOT NULL THEN (
           SELECT sum(least(ln.tokens, greatest(0,
                      extract(epoch FROM ln.token_tat - now()) * ln.tokens / l.per_seconds)))
           FROM agent_limit_lane ln WHERE ln.limit_name = l.name) END AS tokens_used,
       (SELECT count(*) FROM agent_limit_lease s WHERE s.limit_name = l.name) AS in_flight,
       l.created_at, l.updated_at
FROM agent_limit l
WHERE %(names)s::text[] IS NULL OR l.name = ANY(%(names)s::text[])
ORDER BY l.name;

-- name: limit_lock
-- Share-lock the named limits; returns the names that exist.
--
-- Inside an enqueue or a delete: the limits that exist among the names, locked so
-- that a concurrent delete and an enqueue naming the limit cannot both succeed.
SELECT name FROM agent_limit
WHERE name = ANY(%(names)s::text[])
ORDER BY name
FOR KEY SHARE;

-- name: limit_lock_for_delete
-- Lock a limit's row for its deletion; returns nothing if it does not exist.
SELECT name FROM agent_limit WHERE name = %(name)s FOR UPDATE;

-- name: limit_users
-- How many unfinished tasks name a limit.
--
-- Unfinished tasks that name the limit (run after limit_lock_for_delete, in a new
-- statement: its snapshot sees every enqueue that committed before the lock).
SELECT count(*) AS n FROM agent_work_queue
WHERE status IN ('pending', 'leased') AND limits @> ARRAY[%(name)s::text];

-- name: limit_delete
-- Delete a limit and its lanes.
WITH gone AS (DELETE FROM agent_limit_lease WHERE limit_name = %(name)s),
lanes AS (DELETE FROM agent_limit_lane WHERE limit_name = %(name)s)
DELETE FROM agent_limit WHERE name = %(name)s RETURNING name;

-- name: limit_block
-- Block the named limits until now() + retry_after (never shortening a block).
--
-- A rate-limited answer: no claim of a task naming these limits until now() +
-- retry_after, for every worker (the claim reads blocked_until under the limit's lock).
UPDATE agent_limit l
SET blocked_seconds = l.blocked_seconds + greatest(0, extract(epoch FROM
        now() + make_interval(secs => %(retry_after)s::float8)
        - greatest(now(), coalesce(l.blocked_until, now())))),
    blocked_until = greatest(coalesce(l.blocked_until, now()),
                             now() + make_interval(secs => %(retry_after)s::float8)),
    updated_at = now()
WHERE l.name = ANY(%(names)s::text[])
RETURNING l.name, l.blocked_until;

-- name: task_limits
-- A task's batch and the limits it names.
SELECT limits, tokens, batch_id, task_key FROM agent_work_queue WHERE id = %(id)s;

-- name: usage_record
-- Record an attempt's reported usage once; returns whether it was the first report.
--
-- One report of an attempt's usage, added to its ledger row. `first` tells whether it
-- is the attempt's first report (then it replaces the task's token estimate in the
-- limits; later reports add to it).
INSERT INTO agent_task_usage AS u (task_id, attempt, batch_id, task_key, tokens,
                                   input_tokens, output_tokens, cost, reports)
VALUES (%(id)s, %(attempt)s, %(batch_id)s, %(task_key)s, %(tokens)s, %(input_tokens)s,
        %(output_tokens)s, %(cost)s, 1)
ON CONFLICT (task_id, attempt) DO UPDATE
SET tokens = u.tokens + EXCLUDED.tokens,
    input_tokens = u.input_tokens + EXCLUDED.input_tokens,
    output_tokens = u.output_tokens + EXCLUDED.output_tokens,
    cost = u.cost + EXCLUDED.cost,
    reports = u.reports + 1,
    updated_at = now()
RETURNING u.reports = 1 AS first;

-- name: usage_settle_limits
-- Settle a task's token estimate against its reported tokens on its limits' lanes.
--
-- Correct the token limits by actual minus estimate: every lane's GCRA clock moves
-- forward (more used than estimated) or back (less) by that many tokens' worth of the
-- limit's time, which is the correction in tokens over all its lanes together. Lanes
-- are locked in key order (waiting for claims that hold one, which never wait for us).
UPDATE agent_limit_lane ln
SET token_tat = ln.token_tat + make_interval(secs => %(correction)s::float8 * l.per_seconds
                                                       / l.tokens)
FROM agent_limit l
WHERE l.name = ANY(%(names)s::text[]) AND l.tokens IS NOT NULL
  AND ln.limit_name = l.name;

-- name: usage_batch_add
-- Add reported usage to the batch's totals (and its tenant's in the pool, for a pool batch).
--
-- A pool batch's report also adds to its tenant's totals in the pool
-- (agent_pool_tenant_usage), which a tenant budget checks: one more row per report, in
-- the same statement, so the two totals never disagree.
WITH tenant AS (
    INSERT INTO agent_pool_tenant_usage AS t (pool, tenant_id, tokens, input_tokens,
                                              output_tokens, cost)
    SELECT pool, tenant_id, %(tokens)s, %(input_tokens)s, %(output_tokens)s, %(cost)s
    FROM agent_batch WHERE batch_id = %(batch_id)s AND pool IS NOT NULL
    ON CONFLICT (pool, tenant_id) DO UPDATE
    SET tokens = t.tokens + EXCLUDED.tokens,
        input_tokens = t.input_tokens + EXCLUDED.input_tokens,
        output_tokens = t.output_tokens + EXCLUDED.output_tokens,
        cost = t.cost + EXCLUDED.cost,
        updated_at = now()
)
INSERT INTO agent_batch_usage AS b (batch_id, tokens, input_tokens, output_tokens, cost)
VALUES (%(batch_id)s, %(tokens)s, %(input_tokens)s, %(output_tokens)s, %(cost)s)
ON CONFLICT (batch_id) DO UPDATE
SET tokens = b.tokens + EXCLUDED.tokens,
    input_tokens = b.input_tokens + EXCLUDED.input_tokens,
    output_tokens = b.output_tokens + EXCLUDED.output_tokens,
    cost = b.cost + EXCLUDED.cost,
    updated_at = now();

-- name: budget_set
-- Set or raise a batch's budget of tokens and/or cost.
--
-- Set (or raise, or lower) a batch's budget; NULL keeps the current value. Claims see
-- it on their next statement: raising an exhausted budget resumes the batch. The batch
-- is under flow control from then on (its claims check the budget).
WITH flow AS (
    UPDATE agent_batch SET flow_control = true
    WHERE batch_id = %(batch_id)s AND NOT flow_control
)
INSERT INTO agent_batch_usage AS b (batch_id, budget_tokens, budget_cost)
VALUES (%(batch_id)s, %(budget_tokens)s, %(budget_cost)s)
ON CONFLICT (batch_id) DO UPDATE
SET budget_tokens = coalesce(EXCLUDED.budget_tokens, b.budget_tokens),
    budget_cost = coalesce(EXCLUDED.budget_cost, b.budget_cost),
    updated_at = now();

-- name: budget_clear
-- Clear a batch's token and/or cost budget.
UPDATE agent_batch_usage
SET budget_tokens = CASE WHEN %(tokens)s THEN NULL ELSE budget_tokens END,
    budget_cost = CASE WHEN %(cost)s THEN NULL ELSE budget_cost END,
    updated_at = now()
WHERE batch_id = %(batch_id)s;

-- name: tenant_budget_set
-- Set or raise a tenant's budget in a pool (every batch of the tenant in the pool).
--
-- Set (or raise, or lower) the budget; NULL keeps the current value. The pool's workers
-- claim under flow control while a tenant with a budget has pending tasks
-- (pool_flow_control, read once a second), and then leave out the tenant's tasks while
-- its totals are at or over the budget; raising it resumes them.
INSERT INTO agent_pool_tenant_usage AS t (pool, tenant_id, budget_tokens, budget_cost)
VALUES (%(pool)s, %(tenant_id)s, %(budget_tokens)s, %(budget_cost)s)
ON CONFLICT (pool, tenant_id) DO UPDATE
SET budget_tokens = coalesce(EXCLUDED.budget_tokens, t.budget_tokens),
    budget_cost = coalesce(EXCLUDED.budget_cost, t.budget_cost),
    updated_at = now();

-- name: tenant_budget_clear
-- Clear a tenant's token and/or cost budget in a pool.
UPDATE agent_pool_tenant_usage
SET budget_tokens = CASE WHEN %(tokens)s THEN NULL ELSE budget_tokens END,
    budget_cost = CASE WHEN %(cost)s THEN NULL ELSE budget_cost END,
    updated_at = now()
WHERE pool = %(pool)s AND tenant_id = %(tenant_id)s;

-- name: tenant_usage_get
-- A tenant's total usage and budget in a pool.
--
-- The tenant's totals over its batches in the pool and its budget (one row or none), and
-- whether the budget stops its claims.
SELECT tokens, input_tokens, output_tokens, cost, budget_tokens, budget_cost,
       coalesce(tokens >= budget_tokens OR cost >= budget_cost, false) AS exhausted
FROM agent_pool_tenant_usage WHERE pool = %(pool)s AND tenant_id = %(tenant_id)s;

-- name: usage_get
-- A batch's total usage and budget.
--
-- A batch's totals and budget (one row or none), and whether the budget stops claims.
SELECT tokens, input_tokens, output_tokens, cost, budget_tokens, budget_cost,
       coalesce(tokens >= budget_tokens OR cost >= budget_cost, false) AS exhausted
FROM agent_batch_usage WHERE batch_id = %(batch_id)s;

-- name: usage_by_status
-- A batch's usage by task status.
--
-- The ledger of a batch by the current status of each task (retention may have deleted
-- the task: 'deleted'); attempts counts ledger rows, failed and retried ones included.
SELECT coalesce(q.status::text, 'deleted') AS status, count(DISTINCT u.task_id) AS tasks,
       count(*) AS attempts, sum(u.tokens) AS tokens, sum(u.input_tokens) AS input_tokens,
       sum(u.output_tokens) AS output_tokens, sum(u.cost) AS cost
FROM agent_task_usage u LEFT JOIN agent_work_queue q ON q.id = u.task_id
WHERE u.batch_id = %(batch_id)s
GROUP BY 1
ORDER BY 1;

-- name: usage_by_attempt
-- A task's reported usage, attempt by attempt (the console's task page).
SELECT attempt, tokens, input_tokens, output_tokens, cost, reports, created_at, updated_at
FROM agent_task_usage WHERE task_id = %(task_id)s ORDER BY attempt;
