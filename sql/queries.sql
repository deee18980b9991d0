-- Named queries: one per state transition. The Python layer (jobrunner/queue.py) is
-- a thin typed wrapper around these. Parameters use psycopg's %(name)s style; every
-- value is sent as a bound parameter, never formatted into the text.
-- Time always comes from the database's now(), never from a worker's clock.
--
-- Plans: queue connections run with plan_cache_mode = force_generic_plan and without
-- sequential or bitmap scans (see jobrunner/queue.py), so the hot statements are planned
-- once, not on every call, and the same way whatever the table's statistics say. A
-- generic plan does not know how many ids a parameter array holds or what LIMIT is, so
-- rows are found by primary key through `id = ANY(array)` (always an index scan), not
-- by joining the table to an unnest() or a CTE (which a generic plan may turn into a
-- hash join over a sequential scan of the whole table). Fenced updates test
-- `status || '' = 'leased'` so that the planner cannot pick the partial index of leased
-- rows instead: statistics taken when few rows were leased make that index look
-- cheapest, but its scan reads every live lease of every worker.

-- name: ensure_batch
-- Records the batch (idempotent). Returns the tenant it was first created with.
INSERT INTO agent_batch (batch_id, tenant_id) VALUES (%(batch_id)s, %(tenant_id)s)
ON CONFLICT (batch_id) DO UPDATE SET batch_id = EXCLUDED.batch_id
RETURNING tenant_id, cancelled_at, pool, priority;

-- name: enqueue_stage_table
CREATE TEMP TABLE jobrunner_enqueue_stage (
    task_key text NOT NULL, shard_key text, payload jsonb NOT NULL, max_attempts int NOT NULL,
    limits text[], tokens bigint
) ON COMMIT DROP;

-- name: enqueue_from_stage
-- Idempotent on (batch_id, task_key): rows that already exist are left untouched (the
-- task table's insert trigger skips a row whose key is in agent_task_key, migration 0017).
WITH inserted AS (
    INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload, max_attempts,
                                  limits, tokens)
    SELECT %(batch_id)s, %(tenant_id)s, s.task_key, s.shard_key, s.payload, s.max_attempts,
           s.limits, s.tokens
    FROM jobrunner_enqueue_stage s
    ORDER BY s.task_key
    RETURNING 1
),
counted AS (
    SELECT count(*) AS new FROM inserted
),
batch_tasks AS (
    -- The batch's task count (status counts derive done from it), in the same
    -- transaction as the rows; concurrent enqueues of one batch already queue up on
    -- this row (ensure_batch locked it).
    UPDATE agent_batch
    SET tasks = tasks + (SELECT new FROM counted),
        flow_control = flow_control
                       OR EXISTS (SELECT 1 FROM jobrunner_enqueue_stage WHERE limits IS NOT NULL)
    WHERE batch_id = %(batch_id)s
)
SELECT new FROM counted;

-- name: notify_batch
SELECT pg_notify('jobrunner_queue', %(batch_id)s);

-- name: ack_and_claim
-- The worker's loop in ONE statement, so one round trip and one commit per loop. Either
-- half may be empty (no ids: a plain claim; limit 0: a plain ack).
--
-- Ack: fenced on (id, lease_owner, attempt): a worker whose lease was lost gets no row
-- back and changes nothing, so it can never overwrite a newer attempt. The task's shard
-- lease ends with its 'leased' status (nothing else to write: see "Shard leases"). An
-- acked row that another transaction holds locked at this moment is not waited for: it
-- comes back as 'busy' and the worker sends
-- its ack again with its next statement. Who holds it: almost always a claimer whose
-- snapshot predates our claim's commit: its SKIP LOCKED scan still saw the row as
-- pending, locked the newest version and only then found it leased, and keeps that
-- lock until it commits. Waiting for that commit (and its WAL flush) cost a quarter of
-- the statement time at 4 workers; otherwise the expirer (then the next try finds the
-- lease lost).
--
-- Claim: pick ready rows with FOR UPDATE SKIP LOCKED (rows other claimers hold are
-- skipped, never waited on), take the shard lease of at most one task per shard, then
-- mark the chosen rows leased. The CTE form matters: an `UPDATE ... WHERE id IN (SELECT
-- ... LIMIT n)` may be re-evaluated by the planner and claim more than n rows. The NOT
-- EXISTS is only a pre-filter that keeps rows of busy shards out of the LIMIT;
-- correctness comes from jobrunner_shard_take (see "Shard leases").
--
-- Shard leases (migration 0016): a shard's lease is the leased row of its task, and a
-- unique index over the leased rows' (tenant_id, shard_key) makes two impossible. A
-- claim takes a shard in jobrunner_shard_take: a transaction-scoped advisory try-lock
-- per shard (another claim taking it right now: the task is simply not chosen, as a
-- lost race always was), then a check, in a snapshot taken after the lock, that no task
-- of the shard is leased; every claim holds that lock until it commits, so the check
-- sees all that committed before. Ack, fail, release and expiry end the lease by moving
-- the task out of 'leased': no row of its own to insert, confirm and delete (that was
-- 14 %% of a task's WAL).
--
-- Shard pre-filter: the NOT EXISTS must stay a subplan run per candidate, whose two
-- equalities make it one probe of the leased index (for a task without a shard key, a
-- NULL key: no probe at all). Left to itself the planner turns it into an anti join,
-- and the generic plan (see Plans) then depends on the column statistics of the moment
-- the worker connected: with those an ANALYZE took while a batch ran, it read the whole
-- leased index (every live lease of every worker, and the entries of every claim since
-- the last vacuum), materialised it and compared each candidate with each lease: work
-- per claim that grows with workers x claim batch, and the shared leased-index and heap
-- pages made the workers queue for buffer locks (issue 33: claim batch 10 fell from
-- 16,000 to 5,000 tasks/s at 8 workers; docs/performance.md). OFFSET 0 keeps the
-- planner from pulling the sublink up into a join or hashing it.
--
-- Scan position: the pending index keeps an entry for every row claimed since the last
-- vacuum (the entry of its old, pending version), and every scan from the start of the
-- batch steps over all of them: at 20,000 claims since the last vacuum a claim cost a
-- third more server CPU, and it grows with the batch. So a worker starts its scan just
-- after the (run_after, id) of its previous claim; it scans from the start again at
-- least every second and after any claim that came back short, so a task passed over
-- (its shard was busy, or another worker held its row) waits at most about a second
-- longer. Every other way a row becomes pending again (retry, expiry, release,
-- requeue) gives it run_after = now(), past every worker's position.
--
-- The halves touch disjoint rows (acked rows are leased, candidates pending). All CTEs
-- read one snapshot, so a shard this ack releases still looks busy to this claim's
-- pre-filter: its next task goes to the next claim (this worker's or another's).
-- Rows come back tagged: 'acked', 'busy' (ack again later) or 'leased' (a new lease);
-- an id that is neither acked nor busy is a lost lease.
--
-- Flow control: this statement never claims a task that names a limit, and checks no
-- budget, so tasks without limits pay nothing for limits (even one index probe more
-- per claim cost 10 %% of the server CPU per task at claim batch 1). A batch under flow
-- control (its tasks name limits, or it has a budget: agent_batch.flow_control, only
-- ever set) is claimed with ack_and_claim_limited instead: the worker reads the flag
-- (batch_flow_control) when it starts and then once a second. Its acks release
-- concurrency slots all the same (a task acked through it may hold one).
WITH lockable AS (
    SELECT l.id FROM agent_work_queue l
    WHERE l.id = ANY(%(ids)s::bigint[])
    FOR NO KEY UPDATE SKIP LOCKED
),
acked AS (
    -- ids, attempts and results (a JSON array) are parallel arrays: each row finds its
    -- own entries by array_position, which keeps the plan to one index scan (a join to
    -- unnest() cost a nested loop and a function scan per execution).
    UPDATE agent_work_queue q
    SET status = 'done',
        result = %(results)s::jsonb -> (array_position(%(ids)s::bigint[], q.id) - 1),
        finished_at = now(),
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM lockable))  -- see "Plans" at the top of this file
      AND q.attempts = (%(attempts)s::int[])[array_position(%(ids)s::bigint[], q.id)]
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING acked
    WHERE acked.limits IS NOT NULL
      AND s.limit_name = ANY(acked.limits) AND s.task_id = acked.id
),
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key
    FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      -- Where this worker's scan starts (the position after its last claim, or the
      -- start: '-infinity', 0): see "Scan position" above.
      AND (q.run_after, q.id) > (%(after_run_after)s::timestamptz, %(after_id)s::bigint)
      AND NOT EXISTS (  -- (a leased task of the shard: see "Shard leases")
          SELECT 1 FROM agent_work_queue l
          WHERE l.tenant_id = q.tenant_id AND l.shard_key = q.shard_key
            AND l.status = 'leased'
          OFFSET 0)  -- one index probe per candidate, never a join: see "Shard pre-filter"
      AND q.limits IS NULL  -- (flow control: see above)
    ORDER BY q.run_after, q.id
    LIMIT %(limit)s
    FOR UPDATE OF q SKIP LOCKED
),
one_per_shard AS (
    SELECT DISTINCT ON (tenant_id, shard_key) id, tenant_id, shard_key
    FROM candidates
    WHERE shard_key <> ''
    ORDER BY tenant_id, shard_key, id
),
shard_leases AS (
    -- the tasks whose shard this claim may lease (migration 0016; a volatile function,
    -- so this CTE is evaluated once, and each call checks in a snapshot of its own)
    SELECT id AS task_id FROM one_per_shard WHERE jobrunner_shard_take(tenant_id, shard_key)
),
chosen AS (
    SELECT id FROM candidates WHERE shard_key = ''
    UNION ALL
    SELECT task_id FROM shard_leases
),
claimed AS (
    UPDATE agent_work_queue q
    SET status = 'leased',
        lease_owner = %(worker_id)s,
        locked_until = now() + make_interval(secs => %(visibility_timeout)s),
        attempts = q.attempts + 1,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after
)
-- No lock is ever waited for: acks and claims both skip locked rows, and shard locks
-- are only tried; the unique index of leased rows could wait only for another claim
-- of the same shard, which holds that shard's lock; so no cycle of waits, no deadlock.
-- (An earlier version waited for busy acks; it had to ack before claiming, or two
-- workers acking rows the other had just re-checked deadlocked for deadlock_timeout at
-- 8 workers.)
SELECT 'acked' AS outcome, id, NULL::text AS batch_id, NULL::text AS task_key,
       NULL::text AS tenant_id, NULL::text AS shard_key, NULL::jsonb AS payload,
       NULL::int AS attempts, NULL::int AS max_attempts, NULL::timestamptz AS locked_until,
       NULL::timestamptz AS run_after
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after
FROM claimed;


-- name: ack_and_claim_limited
-- ack_and_claim for a batch under flow control (docs/flow-control.md): the same acks,
-- scan position, shard leases and tags, plus the tasks' limits and the batch's budget.
-- Separate so that tasks without limits do not pay for its plan: a generic plan's
-- executor start-up covers every node on every execution, and these nodes doubled it
-- (+50 %% server CPU per task at claim batch 1, measured).
--
-- Limits (docs/flow-control.md): for each limit the candidates name, the claim takes
-- one of its lanes (agent_limit_lane, migration 0010) with FOR NO KEY UPDATE SKIP
-- LOCKED, reading its newest version and holding it until commit (in the functions
-- jobrunner_limit_admit and jobrunner_limit_charge, migration 0013, whose statements
-- take fresh snapshots: locked here, a lane other claims keep changing made every claim
-- re-initialise all of this statement's CTEs for an EvalPlanQual recheck); a lane another claim
-- holds is skipped, never waited for, and when every lane of a limit is held, its tasks
-- are not claimed this time (the 'wait' row asks the worker to come back at once).
-- Claims of tasks without limits never touch those rows. The clock of the admission is
-- read after the lanes are locked, so one lane's admissions happen in lock order on
-- increasing database time. A task is admitted when, for each of its limits, counting
-- the candidates before it under that limit (in id order): the limit is not blocked;
-- the lane's request_tat + (requests before it) * per/requests <= clock and at most the
-- lane's `requests` in the group (GCRA without burst between claims: a group of n in
-- one claim is admitted only if the lane was idle for n-1 intervals; either way every
-- window of `per` seconds holds at most the lane's share, so at most `requests` over
-- all lanes); the same for tokens with the token estimates (at most the lane's tokens
-- before it in the group); and the lane's live leases plus those before it stay under
-- its slots. Live leases: the agent_limit_lease rows of the lane this snapshot sees plus
-- every slot the lane handed out since (`acquired` now minus `acquired` in the
-- snapshot), so a slot taken by a claim that committed after this snapshot is counted.
-- A task may be admitted and then lose its shard race: the lanes are then charged only
-- for the tasks finally chosen. Lane locks and shard locks are only tried, never waited
-- for, so no cycle of waits; ack, fail and expire never touch a lane.
--
-- Budget: a batch whose agent_batch_usage row shows its tokens or cost at or over the
-- budget claims nothing (one index probe; no row, no budget).
--
-- A task passed over because its limit was full waits, like one whose shard was busy,
-- for the worker's next scan from the start. Rows come back tagged as in
-- ack_and_claim, plus one 'wait' row when every lane of a limit was held by other
-- claims (come back at once). When a claim finds nothing, the worker asks
-- limit_next_room how long to sleep (a separate statement: its nodes would otherwise be
-- started up on every claim).
WITH lockable AS (
    SELECT l.id FROM agent_work_queue l
    WHERE l.id = ANY(%(ids)s::bigint[])
    FOR NO KEY UPDATE SKIP LOCKED
),
acked AS (
    -- ids, attempts and results (a JSON array) are parallel arrays: each row finds its
    -- own entries by array_position, which keeps the plan to one index scan (a join to
    -- unnest() cost a nested loop and a function scan per execution).
    UPDATE agent_work_queue q
    SET status = 'done',
        result = %(results)s::jsonb -> (array_position(%(ids)s::bigint[], q.id) - 1),
        finished_at = now(),
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM lockable))  -- see "Plans" at the top of this file
      AND q.attempts = (%(attempts)s::int[])[array_position(%(ids)s::bigint[], q.id)]
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING acked
    WHERE acked.limits IS NOT NULL
      AND s.limit_name = ANY(acked.limits) AND s.task_id = acked.id
),
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key, q.limits, q.tokens
    FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      -- Where this worker's scan starts (the position after its last claim, or the
      -- start: '-infinity', 0): see "Scan position" above.
      AND (q.run_after, q.id) > (%(after_run_after)s::timestamptz, %(after_id)s::bigint)
      AND NOT EXISTS (  -- (a leased task of the shard: see "Shard leases")
          SELECT 1 FROM agent_work_queue l
          WHERE l.tenant_id = q.tenant_id AND l.shard_key = q.shard_key
            AND l.status = 'leased'
          OFFSET 0)  -- one index probe per candidate, never a join: see "Shard pre-filter"
      -- Limits that exist and are not visibly full (blocked, or their next request or
      -- token not due yet); the check that counts is jobrunner_limit_admit's, under the
      -- locks. (The clock, not now(): a claim that committed after this transaction started may have
      -- moved a limit's TAT past now() and still leave room at this instant.)
      -- (One array for the whole statement, not a subquery per row: a row another claim
      -- took after this snapshot is re-checked by EvalPlanQual, which starts up the
      -- scan's subplans again for each such row.)
      AND (q.limits IS NULL OR q.limits <@ ARRAY(
          SELECT l.name FROM agent_limit l
          WHERE (l.blocked_until IS NULL OR l.blocked_until <= clock_timestamp())
            AND EXISTS (
                SELECT 1 FROM agent_limit_lane ln
                WHERE ln.limit_name = l.name
                  AND (ln.requests IS NULL OR ln.request_tat <= clock_timestamp())
                  AND (ln.tokens IS NULL OR ln.token_tat <= clock_timestamp()))))
      AND NOT EXISTS (
          SELECT 1 FROM agent_batch_usage b
          WHERE b.batch_id = %(batch_id)s
            AND (b.tokens >= b.budget_tokens OR b.cost >= b.budget_cost))
    ORDER BY q.run_after, q.id
    LIMIT %(limit)s
    FOR UPDATE OF q SKIP LOCKED
),
admit AS MATERIALIZED (
    -- Lock a lane per limit, read the clock, admit candidates (migration 0013: in a
    -- function so that the lanes, which other claims keep changing, are read with a
    -- fresh snapshot and never rechecked by this statement's EvalPlanQual).
    SELECT * FROM jobrunner_limit_admit(
        ARRAY(SELECT id FROM candidates WHERE limits IS NOT NULL))
),
limit_ok AS (
    SELECT id FROM candidates WHERE limits IS NULL
    UNION ALL
    SELECT task_id FROM admit GROUP BY task_id HAVING bool_and(ok)
),
one_per_shard AS (
    SELECT DISTINCT ON (tenant_id, shard_key) id, tenant_id, shard_key
    FROM candidates
    WHERE shard_key <> '' AND id = ANY(ARRAY(SELECT id FROM limit_ok))
    ORDER BY tenant_id, shard_key, id
),
shard_leases AS (
    -- the tasks whose shard this claim may lease (migration 0016; a volatile function,
    -- so this CTE is evaluated once, and each call checks in a snapshot of its own)
    SELECT id AS task_id FROM one_per_shard WHERE jobrunner_shard_take(tenant_id, shard_key)
),
chosen AS (
    SELECT id FROM candidates WHERE shard_key = '' AND id = ANY(ARRAY(SELECT id FROM limit_ok))
    UNION ALL
    SELECT task_id FROM shard_leases
),
charged AS MATERIALIZED (
    -- Run by the first claimed task under a limit (below): it exists only then.
    SELECT jobrunner_limit_charge(ARRAY(SELECT ROW(a.*)::jobrunner_admission
                                        FROM admit a WHERE a.ok),
                                  ARRAY(SELECT id FROM chosen)) AS t
),
claimed AS (
    UPDATE agent_work_queue q
    SET status = 'leased',
        lease_owner = %(worker_id)s,
        locked_until = now() + make_interval(secs => %(visibility_timeout)s),
        attempts = q.attempts + 1,
        -- a task under limits: the database time its limits admitted it (what they count)
        -- (and evaluating it charges the lanes: `charged`)
        updated_at = CASE WHEN q.limits IS NULL THEN now()
                          ELSE (SELECT t FROM charged) END
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after
)
-- No lock is ever waited for: acks and claims both skip locked task rows and limit
-- lanes, and shard locks are only tried (see ack_and_claim); so no cycle of waits, no
-- deadlock. (An earlier version waited for busy acks; it had to ack before
-- claiming, or two workers acking rows the other had just re-checked deadlocked for
-- deadlock_timeout at 8 workers.)
SELECT 'acked' AS outcome, id, NULL::text AS batch_id, NULL::text AS task_key,
       NULL::text AS tenant_id, NULL::text AS shard_key, NULL::jsonb AS payload,
       NULL::int AS attempts, NULL::int AS max_attempts, NULL::timestamptz AS locked_until,
       NULL::timestamptz AS run_after
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after
FROM claimed
UNION ALL
-- every lane of a limit was held by other claims: the worker should come back at once
(SELECT 'wait', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
 FROM admit WHERE wait
 LIMIT 1);

-- name: limit_next_room
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

-- name: heartbeat
-- Renews every lease this worker still holds. A lease missing from the result is lost
-- (expired and rescued, or re-claimed): the worker must stop that task.
UPDATE agent_work_queue q
SET locked_until = now() + make_interval(secs => %(visibility_timeout)s),
    updated_at = now()
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS t(id, attempt)
WHERE q.id = ANY(%(ids)s::bigint[])
  AND q.id = t.id
  AND q.attempts = t.attempt
  AND q.lease_owner = %(worker_id)s
  AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
RETURNING q.id;

-- name: fail
-- Retryable failure: back to pending after min(cap, base * 2^attempts) seconds with up
-- to 25 %% jitter. Permanent failure, or attempts used up: dead. A retryable failure in a
-- cancelled batch (its BatchRun deleted or replaced while the task ran) ends cancelled,
-- as release and expire do: no worker of that batch is left to claim it again.
WITH failed AS (
    UPDATE agent_work_queue q
    SET status = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts THEN 'dead'
                      WHEN EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                   AND b.cancelled_at IS NOT NULL) THEN 'cancelled'
                      ELSE 'pending' END,
        run_after = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts
                              OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                        AND b.cancelled_at IS NOT NULL)
                         THEN q.run_after
                         ELSE now() + make_interval(secs => least(
                             %(backoff_cap)s::float8,
                             %(backoff_base)s::float8 * power(2, q.attempts)
                                 * (1 + 0.25 * random())))
                    END,
        finished_at = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts
                                OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                          AND b.cancelled_at IS NOT NULL)
                           THEN now() END,
        last_error = %(error)s,
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = %(id)s
      AND q.attempts = %(attempt)s
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.status, q.run_after, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING failed
    WHERE failed.limits IS NOT NULL
      AND s.limit_name = ANY(failed.limits) AND s.task_id = failed.id
)
SELECT id, status, run_after FROM failed;

-- name: throttle
-- A rate-limited answer (RateLimited, or a command's exit 76): back to pending at
-- now() + retry_after WITHOUT using an attempt (the attempt counter goes back, as on
-- release), counted in `throttles`; at max_throttles the task ends dead with an error
-- that says so, so an endpoint that always answers 429 cannot keep a task forever.
-- Fenced like fail, and like fail it ends cancelled in a cancelled batch. (The limit
-- itself is blocked for every worker by block_limits, in its own transaction: this
-- statement never waits on a limit row.)
WITH throttled AS (
    UPDATE agent_work_queue q
    SET status = CASE WHEN coalesce(q.throttles, 0) + 1 >= %(max_throttles)s THEN 'dead'
                      WHEN EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                   AND b.cancelled_at IS NOT NULL) THEN 'cancelled'
                      ELSE 'pending' END,
        attempts = CASE WHEN coalesce(q.throttles, 0) + 1 >= %(max_throttles)s
                        THEN q.attempts ELSE q.attempts - 1 END,
        throttles = coalesce(q.throttles, 0) + 1,
        run_after = CASE WHEN coalesce(q.throttles, 0) + 1 >= %(max_throttles)s THEN q.run_after
                         ELSE now() + make_interval(secs => %(retry_after)s::float8) END,
        finished_at = CASE WHEN coalesce(q.throttles, 0) + 1 >= %(max_throttles)s
                                OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                          AND b.cancelled_at IS NOT NULL)
                           THEN now() END,
        last_error = CASE WHEN coalesce(q.throttles, 0) + 1 >= %(max_throttles)s
                          THEN 'rate limited ' || (coalesce(q.throttles, 0) + 1)
                               || ' times (the bound is ' || %(max_throttles)s::int
                               || '); giving up. Last answer: ' || %(error)s
                          ELSE %(error)s END,
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = %(id)s
      AND q.attempts = %(attempt)s
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.status, q.run_after, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING throttled t
    WHERE t.limits IS NOT NULL AND s.limit_name = ANY(t.limits) AND s.task_id = t.id
)
SELECT id, status, run_after FROM throttled;

-- name: release
-- Graceful shutdown: give the task back without burning an attempt. In a cancelled batch
-- (its BatchRun deleted or replaced while the worker ran) it ends cancelled instead: no
-- worker of that batch is left to claim it, so pending would strand it.
WITH released_tasks AS (
    UPDATE agent_work_queue q
    SET status = CASE WHEN EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                   AND b.cancelled_at IS NOT NULL)
                      THEN 'cancelled' ELSE 'pending' END,
        finished_at = CASE WHEN EXISTS (SELECT 1 FROM agent_batch b
                                        WHERE b.batch_id = q.batch_id
                                        AND b.cancelled_at IS NOT NULL)
                           THEN now() END,
        attempts = q.attempts - 1,
        run_after = now(),
        locked_until = NULL,
        lease_owner = NULL,
        updated_at = now()
    FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS t(id, attempt)
    WHERE q.id = ANY(%(ids)s::bigint[])
      AND q.id = t.id
      AND q.attempts = t.attempt
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING released_tasks r
    WHERE r.limits IS NOT NULL AND s.limit_name = ANY(r.limits) AND s.task_id = r.id
)
SELECT id FROM released_tasks;

-- name: expire
-- Rescue leases whose holder stopped heartbeating: back to pending, or dead when the
-- attempts are used up, or cancelled in a cancelled batch (no worker of it is left to
-- claim it). Rows locked by a concurrent transaction (a worker applying an
-- effect under its lease, another expirer) are skipped and retried on the next tick.
WITH expired AS (
    SELECT id FROM agent_work_queue
    WHERE status = 'leased' AND locked_until < now()
    ORDER BY locked_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
moved AS (
    UPDATE agent_work_queue q
    SET status = CASE WHEN EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = q.batch_id
                                   AND b.cancelled_at IS NOT NULL) THEN 'cancelled'
                      WHEN q.attempts >= q.max_attempts THEN 'dead' ELSE 'pending' END,
        run_after = now(),
        finished_at = CASE WHEN q.attempts >= q.max_attempts
                                OR EXISTS (SELECT 1 FROM agent_batch b
                                           WHERE b.batch_id = q.batch_id
                                           AND b.cancelled_at IS NOT NULL)
                           THEN now() END,
        last_error = 'lease expired: ' || coalesce(q.lease_owner, '?')
                     || ' did not heartbeat or finish attempt ' || q.attempts
                     || ' before ' || q.locked_until,
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM expired))
    RETURNING q.id, q.batch_id, q.status, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    -- a killed worker's concurrency slots free here, when its lease expires
    DELETE FROM agent_limit_lease s USING moved
    WHERE moved.limits IS NOT NULL AND s.limit_name = ANY(moved.limits) AND s.task_id = moved.id
)
SELECT id, batch_id, status FROM moved;

-- name: cancel_batch
WITH batch AS (
    UPDATE agent_batch SET cancelled_at = coalesce(cancelled_at, now())
    WHERE batch_id = %(batch_id)s
)
UPDATE agent_work_queue
SET status = 'cancelled', finished_at = now(), updated_at = now()
WHERE batch_id = %(batch_id)s AND status = 'pending';

-- name: requeue_dead
UPDATE agent_work_queue
SET status = 'pending', attempts = 0, run_after = now(), finished_at = NULL,
    locked_until = NULL, updated_at = now()
WHERE batch_id = %(batch_id)s AND status = 'dead'
  AND (%(task_keys)s::text[] IS NULL OR task_key = ANY(%(task_keys)s::text[]));

-- name: list_dead
SELECT id, task_key, tenant_id, shard_key, attempts, max_attempts, last_error, finished_at
FROM agent_work_queue
WHERE batch_id = %(batch_id)s AND status = 'dead'
ORDER BY id
LIMIT %(limit)s;

-- name: get_batch
SELECT batch_id, tenant_id, created_at, cancelled_at FROM agent_batch WHERE batch_id = %(batch_id)s;

-- name: counts
-- Each unfinished status from the small index that holds only that status, done as the
-- rest of the batch's task count, all in one snapshot (see migration 0009): the cost
-- grows with the unfinished rows, not with the batch. The reduce and generator tasks are
-- found by key (agent_task_key, migration 0017). (MATERIALIZED: otherwise each
-- count is run once more for the done column.) The reduce task (migration 0011) and the
-- generator task (0012) are not tasks of the batch: they are not in `tasks`, and are
-- taken out of its status here.
WITH c AS MATERIALIZED (SELECT
    coalesce((SELECT tasks FROM agent_batch WHERE batch_id = %(batch_id)s), 0) AS tasks,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending')   AS pending,
    (SELECT count(*) FROM agent_work_queue  -- (the tenant: see migration 0018)
      WHERE tenant_id = (SELECT b.tenant_id FROM agent_batch b WHERE b.batch_id = %(batch_id)s)
        AND batch_id = %(batch_id)s AND status = 'leased')    AS leased,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'dead')      AS dead,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'cancelled') AS cancelled,
    (SELECT q.status::text FROM agent_task_key k JOIN agent_work_queue q ON q.id = k.task_id
      WHERE k.batch_id = %(batch_id)s AND k.task_key = '__reduce__') AS reduce,
    (SELECT q.status::text FROM agent_task_key k JOIN agent_work_queue q ON q.id = k.task_id
      WHERE k.batch_id = %(batch_id)s AND k.task_key = '__generate__') AS gen),
own AS (SELECT tasks,
    pending - (reduce IS NOT DISTINCT FROM 'pending')::int
            - (gen IS NOT DISTINCT FROM 'pending')::int AS pending,
    leased - (reduce IS NOT DISTINCT FROM 'leased')::int
           - (gen IS NOT DISTINCT FROM 'leased')::int AS leased,
    dead - (reduce IS NOT DISTINCT FROM 'dead')::int
         - (gen IS NOT DISTINCT FROM 'dead')::int AS dead,
    cancelled - (reduce IS NOT DISTINCT FROM 'cancelled')::int
              - (gen IS NOT DISTINCT FROM 'cancelled')::int AS cancelled
    FROM c)
SELECT pending, leased, tasks - pending - leased - dead - cancelled AS done, dead, cancelled
FROM own;

-- name: batch_health
-- stuck: leased past the deadline and not rescued (should always be 0 while any
-- worker runs: worth an alert). ready: pending and due now.
SELECT
    (SELECT count(*) FROM agent_work_queue  -- (the tenant: see migration 0018)
      WHERE tenant_id = (SELECT b.tenant_id FROM agent_batch b WHERE b.batch_id = %(batch_id)s)
        AND batch_id = %(batch_id)s AND status = 'leased' AND locked_until < now()) AS stuck,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending' AND run_after <= now()) AS ready,
    (SELECT extract(epoch FROM now() - min(created_at)) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending') AS oldest_pending_seconds,
    (SELECT extract(epoch FROM min(run_after) - now()) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending') AS next_run_in_seconds;

-- name: effect_fence
-- Inside the effect's transaction: proves the lease is still ours and live, and holds
-- a share lock on the row until commit so the expirer cannot take it meanwhile.
SELECT 1 FROM agent_work_queue
WHERE id = %(id)s AND attempts = %(attempt)s AND lease_owner = %(worker_id)s
  AND status = 'leased' AND locked_until > now()
FOR SHARE;

-- name: effect_record
INSERT INTO agent_task_effect (batch_id, task_key, effect_key, task_id, attempt, lease_owner)
VALUES (%(batch_id)s, %(task_key)s, %(effect_key)s, %(id)s, %(attempt)s, %(worker_id)s)
ON CONFLICT DO NOTHING
RETURNING 1;

-- name: effect_lookup
SELECT result FROM agent_task_effect
WHERE batch_id = %(batch_id)s AND task_key = %(task_key)s AND effect_key = %(effect_key)s;

-- name: effect_set_result
UPDATE agent_task_effect SET result = %(result)s
WHERE batch_id = %(batch_id)s AND task_key = %(task_key)s AND effect_key = %(effect_key)s;

-- name: retention_delete
-- Deletes finished rows in small batches so the hot table stays small; a batch is
-- skipped if its rows are locked. Dead rows are kept unless asked for. The batches'
-- task counts go down with the rows, so status counts keep adding up.
WITH old AS (
    SELECT id FROM agent_work_queue
    WHERE status = ANY(%(statuses)s::text[])
      AND finished_at < now() - make_interval(secs => %(older_than_seconds)s)
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
archived AS (
    INSERT INTO agent_work_queue_archive
    SELECT q.* FROM agent_work_queue q
    WHERE q.id = ANY(ARRAY(SELECT id FROM old))  -- see "Plans" at the top of this file
      AND %(archive)s
),
deleted AS (
    DELETE FROM agent_work_queue q
    WHERE q.id = ANY(ARRAY(SELECT id FROM old))
    RETURNING q.id, q.batch_id, q.task_key
),
uncounted AS (
    -- (a reduce or generator task was never counted: migrations 0011, 0012)
    UPDATE agent_batch b SET tasks = b.tasks - d.n
    FROM (SELECT batch_id, count(*) FILTER (WHERE task_key NOT IN ('__reduce__',
                                                                  '__generate__')) AS n
          FROM deleted GROUP BY batch_id) d
    WHERE b.batch_id = d.batch_id
)
SELECT id FROM deleted;

-- name: batch_flow_control
-- Whether a batch is under flow control (its claims must use ack_and_claim_limited).
SELECT coalesce((SELECT flow_control FROM agent_batch WHERE batch_id = %(batch_id)s),
                false) AS flow;

-- name: batch_open
-- True while the batch has work that is not finished: pending (due now or later) or leased.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE batch_id = %(batch_id)s AND status = 'pending')
    OR EXISTS (SELECT 1 FROM agent_work_queue  -- (the tenant: see migration 0018)
               WHERE tenant_id = (SELECT b.tenant_id FROM agent_batch b WHERE b.batch_id = %(batch_id)s)
                 AND batch_id = %(batch_id)s AND status = 'leased') AS open;

-- ---------------------------------------------------------------------------------
-- Getting results out (jobrunner/results.py). The exports run in a transaction of
-- their own through a server-side cursor, so a million rows stream in constant memory.

-- name: export_results
-- The results of a batch's finished tasks, in task key order: the batch's keys in
-- agent_task_key's primary key give that order without a sort (a cursor's plan prefers
-- it), each task then read by its id.
-- The result comes as JSON text and finished_at as ISO 8601 text (the export sets the
-- transaction's TimeZone to UTC): the exporter writes them through without decoding.
-- The reduce task is not a result: its return value is the batch's (batch_result); nor
-- is the generator task.
SELECT k.task_key, q.status::text, q.result::text, q.attempts,
       to_json(q.finished_at) #>> '{}' AS finished_at
FROM agent_task_key k
JOIN agent_work_queue q ON q.id = k.task_id
WHERE k.batch_id = %(batch_id)s AND q.status = 'done'
  AND k.task_key NOT IN ('__reduce__', '__generate__')
ORDER BY k.task_key;

-- name: export_errors
-- The tasks that ended without a result: dead (their last error) and cancelled. (A
-- dead reduce or generator task is the batch's failure, shown by status and top_errors,
-- not a line.)
SELECT q.task_key, q.status::text, q.last_error, q.attempts,
       to_json(q.finished_at) #>> '{}' AS finished_at
FROM agent_work_queue q
WHERE q.batch_id = %(batch_id)s AND q.status IN ('dead', 'cancelled')
  AND q.task_key NOT IN ('__reduce__', '__generate__')
ORDER BY q.task_key;

-- name: top_errors
-- The most frequent distinct errors of a batch's dead tasks, from the partial index of
-- dead and cancelled rows; only the newest %(sample)s dead tasks are read, so the cost
-- stays bounded on a batch where everything died. Messages are grouped by a pattern
-- in which what differs from task to task is blanked out: lease expiries (worker id,
-- attempt, deadline) become one message; UUIDs, timestamps, hex ids and numbers
-- become placeholders, except HTTP status codes, which tell errors apart. Each group
-- shows the real message of its first task, truncated, and that task's key.
WITH failed AS MATERIALIZED (
    SELECT q.id,
           regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(
           regexp_replace(left(coalesce(q.last_error, ''), 1000),
               '^lease expired: .*$', 'lease expired'),
               '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
               '<uuid>', 'g'),
               '[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.]+(Z|[+-][0-9:]+)?', '<time>', 'g'),
               '\m(?=[a-f]*[0-9])[0-9a-f]{6,}\M', '<id>', 'g'),
               '(?<!HTTP )(?<![0-9])[0-9]+', '#', 'g'),
               '\s+', ' ', 'g') AS pattern
    FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s AND q.status = 'dead'
    ORDER BY q.id DESC
    LIMIT %(sample)s
),
groups AS (
    SELECT pattern, count(*) AS n, min(id) AS first_id
    FROM failed
    GROUP BY pattern
    ORDER BY n DESC, first_id
    LIMIT %(limit)s
)
SELECT g.n AS count, q.task_key AS example_key,
       left(coalesce(q.last_error, ''), %(max_chars)s) AS message
FROM groups g
JOIN agent_work_queue q ON q.id = g.first_id
ORDER BY g.n DESC, g.first_id;

-- ---------------------------------------------------------------------------------
-- Flow control (jobrunner/limits.py, docs/flow-control.md). A claim never waits for a
-- limit's lane (SKIP LOCKED), so the statements here, which may wait for a claim to
-- commit, can never be part of a cycle of waits with one.

-- name: limit_upsert
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
UPDATE agent_limit SET lanes = %(lanes)s WHERE name = %(name)s;

-- name: limit_lanes_drop
-- The old lanes (waiting for claims that hold one); returns the state to carry over:
-- the latest TATs (so a re-split never hands out time already charged).
WITH gone AS (DELETE FROM agent_limit_lane WHERE limit_name = %(name)s
              RETURNING request_tat, token_tat)
SELECT coalesce(max(request_tat), '-infinity')::text AS request_tat,  -- (text: Python
       coalesce(max(token_tat), '-infinity')::text AS token_tat       -- has no -infinity)
FROM gone;

-- name: limit_lanes_make
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
-- Inside an enqueue or a delete: the limits that exist among the names, locked so
-- that a concurrent delete and an enqueue naming the limit cannot both succeed.
SELECT name FROM agent_limit
WHERE name = ANY(%(names)s::text[])
ORDER BY name
FOR KEY SHARE;

-- name: limit_lock_for_delete
SELECT name FROM agent_limit WHERE name = %(name)s FOR UPDATE;

-- name: limit_users
-- Unfinished tasks that name the limit (run after limit_lock_for_delete, in a new
-- statement: its snapshot sees every enqueue that committed before the lock).
SELECT count(*) AS n FROM agent_work_queue
WHERE status IN ('pending', 'leased') AND limits @> ARRAY[%(name)s::text];

-- name: limit_delete
WITH gone AS (DELETE FROM agent_limit_lease WHERE limit_name = %(name)s),
lanes AS (DELETE FROM agent_limit_lane WHERE limit_name = %(name)s)
DELETE FROM agent_limit WHERE name = %(name)s RETURNING name;

-- name: limit_block
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
SELECT limits, tokens, batch_id, task_key FROM agent_work_queue WHERE id = %(id)s;

-- name: usage_record
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
INSERT INTO agent_batch_usage AS b (batch_id, tokens, input_tokens, output_tokens, cost)
VALUES (%(batch_id)s, %(tokens)s, %(input_tokens)s, %(output_tokens)s, %(cost)s)
ON CONFLICT (batch_id) DO UPDATE
SET tokens = b.tokens + EXCLUDED.tokens,
    input_tokens = b.input_tokens + EXCLUDED.input_tokens,
    output_tokens = b.output_tokens + EXCLUDED.output_tokens,
    cost = b.cost + EXCLUDED.cost,
    updated_at = now();

-- name: budget_set
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
UPDATE agent_batch_usage
SET budget_tokens = CASE WHEN %(tokens)s THEN NULL ELSE budget_tokens END,
    budget_cost = CASE WHEN %(cost)s THEN NULL ELSE budget_cost END,
    updated_at = now()
WHERE batch_id = %(batch_id)s;

-- name: batch_usage
-- A batch's totals and budget (one row or none), and whether the budget stops claims.
SELECT tokens, input_tokens, output_tokens, cost, budget_tokens, budget_cost,
       coalesce(tokens >= budget_tokens OR cost >= budget_cost, false) AS exhausted
FROM agent_batch_usage WHERE batch_id = %(batch_id)s;

-- name: usage_by_status
-- The ledger of a batch by the current status of each task (retention may have deleted
-- the task: 'deleted'); attempts counts ledger rows, failed and retried ones included.
SELECT coalesce(q.status::text, 'deleted') AS status, count(DISTINCT u.task_id) AS tasks,
       count(*) AS attempts, sum(u.tokens) AS tokens, sum(u.input_tokens) AS input_tokens,
       sum(u.output_tokens) AS output_tokens, sum(u.cost) AS cost
FROM agent_task_usage u LEFT JOIN agent_work_queue q ON q.id = u.task_id
WHERE u.batch_id = %(batch_id)s
GROUP BY 1
ORDER BY 1;

-- ---------------------------------------------------------------------------------
-- Reduce (jobrunner/reduce.py, docs/results.md): one task per batch, key '__reduce__',
-- inserted only once every other task of the batch is terminal. Completion is decided
-- from the rows (jobrunner_batch_settled, migration 0011), never from a counter; the
-- insert is idempotent on (batch_id, task_key) and marked on the batch in the same
-- statement, so any number of callers, at any time, enqueue it at most once.

-- name: batch_set_reduce
-- The batch's reduce step (in the enqueue's transaction, or by the operator for a batch
-- enqueued elsewhere). Unchanged: no write.
UPDATE agent_batch SET reduce = %(reduce)s::jsonb
WHERE batch_id = %(batch_id)s AND reduce IS DISTINCT FROM %(reduce)s::jsonb;

-- name: batch_reduce_enqueued
-- Inside an enqueue, after ensure_batch locked the batch: whether its reduce was
-- enqueued already (then new tasks would never be reduced: the enqueue is refused).
SELECT reduce_enqueued_at IS NOT NULL AS enqueued FROM agent_batch
WHERE batch_id = %(batch_id)s;

-- name: reduce_state
-- Lock-free: the batch's reduce step, its task (if any) and whether it is due now (the
-- pre-check every caller runs before taking the batch's lock in reduce_lock_batch).
SELECT b.reduce, b.cancelled_at IS NOT NULL AS cancelled, b.reduce_enqueued_at,
       b.reduced_at, b.result_bytes,
       r.status::text AS task_status, r.attempts, r.max_attempts, r.last_error,
       CASE WHEN b.reduce IS NULL OR b.cancelled_at IS NOT NULL
                 OR b.reduce_enqueued_at IS NOT NULL THEN false
            ELSE jobrunner_batch_settled(b.batch_id, b.reduce->>'onDead') END AS due
FROM agent_batch b
LEFT JOIN agent_task_key rk ON rk.batch_id = b.batch_id AND rk.task_key = '__reduce__'
LEFT JOIN agent_work_queue r ON r.id = rk.task_id
WHERE b.batch_id = %(batch_id)s;

-- name: reduce_lock_batch
-- The trigger's first statement: lock the batch row until commit. Enqueue (ensure_batch)
-- and cancel_batch write that row, so they wait for the trigger's commit, or it waits for
-- theirs; reduce_enqueue then reads in a new snapshot (READ COMMITTED), in which every
-- enqueue or cancel that committed before the lock is visible.
SELECT batch_id FROM agent_batch WHERE batch_id = %(batch_id)s FOR NO KEY UPDATE;

-- name: reduce_enqueue
-- The trigger: insert the reduce task if the batch has a reduce, is not cancelled, was
-- never reduced, and every other task is terminal (with onDead fail: none dead). Returns
-- the new task's id, or nothing.
WITH due AS (
    SELECT b.batch_id, b.tenant_id, b.reduce, b.pool
    FROM agent_batch b
    WHERE b.batch_id = %(batch_id)s
      AND b.reduce IS NOT NULL AND b.cancelled_at IS NULL AND b.reduce_enqueued_at IS NULL
      AND jobrunner_batch_settled(b.batch_id, b.reduce->>'onDead')
),
marked AS (
    UPDATE agent_batch b SET reduce_enqueued_at = now()
    FROM due WHERE b.batch_id = due.batch_id
),
inserted AS (
    -- (in a pool: tagged with the pool's virtual time now, so it is claimed next)
    INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, max_attempts, pool,
                                  vtag)
    SELECT batch_id, tenant_id, '__reduce__', jsonb_build_object('reduce', reduce),
           coalesce((reduce->>'maxAttempts')::int, 8), pool,
           CASE WHEN pool IS NOT NULL THEN jobrunner_pool_now(pool) END
    FROM due  -- (a '__reduce__' key that exists: no row, as for every keyed insert)
    RETURNING id
)
SELECT id FROM inserted;

-- name: reduce_inputs
-- What the reduce handler iterates over, in task key order (agent_task_key's primary
-- key order, read through a server-side cursor): done tasks, and with onDead include the
-- dead ones.
SELECT k.task_key, q.status::text, q.result::text, q.last_error, q.attempts
FROM agent_task_key k
JOIN agent_work_queue q ON q.id = k.task_id
WHERE k.batch_id = %(batch_id)s AND k.task_key NOT IN ('__reduce__', '__generate__')
  AND (q.status = 'done' OR (%(include_dead)s AND q.status = 'dead'))
ORDER BY k.task_key;

-- name: reduce_store_result
-- Inside the reduce task's effect transaction (fenced on its lease, recorded in the
-- ledger): the batch's result, written at most once.
UPDATE agent_batch
SET result = %(result)s::jsonb, result_bytes = %(bytes)s, reduced_at = now()
WHERE batch_id = %(batch_id)s;

-- name: batch_result
-- The batch's result as JSON text: whole, or only when it is at most max_bytes (NULL:
-- any size), so that a status refresh never reads a large one.
SELECT reduced_at, result_bytes,
       CASE WHEN %(max_bytes)s::bigint IS NULL OR result_bytes <= %(max_bytes)s::bigint
            THEN result::text END AS result
FROM agent_batch WHERE batch_id = %(batch_id)s;

-- ---------------------------------------------------------------------------------
-- Worker pools (jobrunner/pools.py, docs/pools.md, migration 0014): a pool's workers
-- claim across every open batch of the pool, in the order of the tasks' virtual-time
-- tags laid at enqueue (fair share by tenant weight, batch priority as a weight
-- multiplier). Pools take no batch under flow control (refused at enqueue and by
-- budget_set's caller), so the pool claim carries no limit nodes.

-- name: ensure_pool_batch
-- ensure_batch for a batch enqueued into a pool: the pool and priority are set at the
-- batch's first enqueue (the caller refuses a later enqueue that names others).
INSERT INTO agent_batch (batch_id, tenant_id, pool, priority)
VALUES (%(batch_id)s, %(tenant_id)s, %(pool)s, %(priority)s)
ON CONFLICT (batch_id) DO UPDATE SET batch_id = EXCLUDED.batch_id
RETURNING tenant_id, cancelled_at, pool, priority;

-- name: pool_enqueue_start
SELECT vstart, vstride, relay
FROM jobrunner_pool_start(%(pool)s, %(tenant_id)s, %(priority)s, %(batch_id)s);

-- name: enqueue_from_stage_pool
-- enqueue_from_stage for a pool: each new task gets its tag, vstride apart from vstart in
-- task key order (rows whose key exists keep theirs), and the stream's last tag moves to
-- the last one laid.
WITH inserted AS (
    INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload, max_attempts,
                                  limits, tokens, pool, vtag)
    SELECT %(batch_id)s, %(tenant_id)s, s.task_key, s.shard_key, s.payload, s.max_attempts,
           s.limits, s.tokens, %(pool)s,
           %(vstart)s::float8 + (row_number() OVER (ORDER BY s.task_key)) * %(vstride)s::float8
    FROM jobrunner_enqueue_stage s
    ORDER BY s.task_key
    RETURNING vtag
),
counted AS (
    SELECT count(*) AS new, max(vtag) AS last FROM inserted
),
batch_tasks AS (
    UPDATE agent_batch
    SET tasks = tasks + (SELECT new FROM counted)
    WHERE batch_id = %(batch_id)s
),
stream AS (
    INSERT INTO agent_pool_stream AS s (pool, tenant_id, priority, last_tag)
    SELECT %(pool)s, %(tenant_id)s, %(priority)s, last FROM counted WHERE last IS NOT NULL
    ON CONFLICT (pool, tenant_id, priority)
    DO UPDATE SET last_tag = greatest(s.last_tag, EXCLUDED.last_tag)
),
clock AS (
    UPDATE agent_pool SET vclock = greatest(vclock, (SELECT last FROM counted))
    WHERE pool = %(pool)s AND (SELECT last FROM counted) IS NOT NULL
)
SELECT new FROM counted;

-- name: pool_relay
SELECT jobrunner_pool_relay(%(pool)s, %(tenant_id)s, %(priority)s, %(vstart)s,
                            %(vstride)s) AS last;

-- name: notify_pool
SELECT pg_notify('jobrunner_pool', %(pool)s);

-- name: pool_set_weight
SELECT jobrunner_pool_set_weight(%(pool)s, %(tenant_id)s, %(weight)s) AS streams;

-- name: batch_pool
SELECT pool FROM agent_batch WHERE batch_id = %(batch_id)s;

-- name: ack_and_claim_pool
-- ack_and_claim for a pool's workers: the same acks, shard leases, tags and guarantees
-- (see ack_and_claim above), but the candidates are the pool's pending tasks in tag
-- order, whatever their batch: the claim index (pool, vtag, id) holds pending pool tasks
-- only. The scan position is (vtag, id) after the worker's last claim, reset at least
-- every second as in ack_and_claim. Rows come back as ack_and_claim's plus the tag.
WITH lockable AS (
    SELECT l.id FROM agent_work_queue l
    WHERE l.id = ANY(%(ids)s::bigint[])
    FOR NO KEY UPDATE SKIP LOCKED
),
acked AS (
    -- ids, attempts and results (a JSON array) are parallel arrays: each row finds its
    -- own entries by array_position, which keeps the plan to one index scan (a join to
    -- unnest() cost a nested loop and a function scan per execution).
    UPDATE agent_work_queue q
    SET status = 'done',
        result = %(results)s::jsonb -> (array_position(%(ids)s::bigint[], q.id) - 1),
        finished_at = now(),
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM lockable))  -- see "Plans" at the top of this file
      AND q.attempts = (%(attempts)s::int[])[array_position(%(ids)s::bigint[], q.id)]
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.tenant_id, q.shard_key, q.limits
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING acked
    WHERE acked.limits IS NOT NULL
      AND s.limit_name = ANY(acked.limits) AND s.task_id = acked.id
),
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key
    FROM agent_work_queue q
    WHERE q.pool = %(pool)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      AND (q.vtag, q.id) > (%(after_vtag)s::float8, %(after_id)s::bigint)
      AND NOT EXISTS (  -- (a leased task of the shard: see "Shard leases")
          SELECT 1 FROM agent_work_queue l
          WHERE l.tenant_id = q.tenant_id AND l.shard_key = q.shard_key
            AND l.status = 'leased'
          OFFSET 0)  -- one index probe per candidate, never a join: see "Shard pre-filter"
      AND q.limits IS NULL  -- (never in a pool: refused at enqueue)
    ORDER BY q.vtag, q.id
    LIMIT %(limit)s
    FOR UPDATE OF q SKIP LOCKED
),
one_per_shard AS (
    SELECT DISTINCT ON (tenant_id, shard_key) id, tenant_id, shard_key
    FROM candidates
    WHERE shard_key <> ''
    ORDER BY tenant_id, shard_key, id
),
shard_leases AS (
    -- the tasks whose shard this claim may lease (migration 0016; a volatile function,
    -- so this CTE is evaluated once, and each call checks in a snapshot of its own)
    SELECT id AS task_id FROM one_per_shard WHERE jobrunner_shard_take(tenant_id, shard_key)
),
chosen AS (
    SELECT id FROM candidates WHERE shard_key = ''
    UNION ALL
    SELECT task_id FROM shard_leases
),
claimed AS (
    UPDATE agent_work_queue q
    SET status = 'leased',
        lease_owner = %(worker_id)s,
        locked_until = now() + make_interval(secs => %(visibility_timeout)s),
        attempts = q.attempts + 1,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after, q.vtag
)
SELECT 'acked' AS outcome, id, NULL::text AS batch_id, NULL::text AS task_key,
       NULL::text AS tenant_id, NULL::text AS shard_key, NULL::jsonb AS payload,
       NULL::int AS attempts, NULL::int AS max_attempts, NULL::timestamptz AS locked_until,
       NULL::timestamptz AS run_after, NULL::float8 AS vtag
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after, vtag
FROM claimed;

-- name: pool_open
-- A pool worker's drain check: the pool has a pending task (due now or later), or a
-- leased task in one of its batches.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE pool = %(pool)s AND status = 'pending')
    -- (per batch, through its tenant: migration 0018; LATERAL with LIMIT, so that the
    -- index of leased rows is probed by tenant and not scanned whole per batch)
    OR EXISTS (SELECT 1 FROM agent_batch b,
               LATERAL (SELECT 1 FROM agent_work_queue q
                        WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
                          AND q.status = 'leased' LIMIT 1) l
               WHERE b.pool = %(pool)s) AS open;

-- name: pool_work
-- A WorkerPool's queue depth for its scaling timer (controller/workerpools.py): tasks
-- pending and due now (claimable; a task waiting out a retry backoff is not), and tasks
-- leased, in flight. Each count stops at %(cap)s, so a deep backlog costs a bounded scan
-- of the pool's pending index every tick.
SELECT (SELECT count(*) FROM (SELECT 1 FROM agent_work_queue
                              WHERE pool = %(pool)s AND status = 'pending'
                                AND run_after <= now()
                              LIMIT %(cap)s) p) AS pending,
       -- (per batch, through its tenant: see pool_open)
       (SELECT count(*) FROM (SELECT 1 FROM agent_batch b,
                              LATERAL (SELECT 1 FROM agent_work_queue q
                                       WHERE q.tenant_id = b.tenant_id
                                         AND q.batch_id = b.batch_id
                                         AND q.status = 'leased' LIMIT %(cap)s) q
                              WHERE b.pool = %(pool)s
                              LIMIT %(cap)s) l) AS leased;

-- name: pool_reduce_due
-- The pool's batches whose reduce step may still have to be enqueued (few rows): the
-- pool worker's maintenance tick and drain check run the reduce trigger for each.
SELECT batch_id FROM agent_batch
WHERE pool = %(pool)s AND reduce IS NOT NULL AND reduce_enqueued_at IS NULL
  AND cancelled_at IS NULL
ORDER BY batch_id;

-- name: pool_show
-- A pool's tenants: weight, streams' last tags, and their pending and leased tasks.
SELECT b.tenant_id, coalesce(t.weight, 1) AS weight,
       count(DISTINCT b.batch_id) AS batches,
       sum((SELECT count(*) FROM agent_work_queue q
            WHERE q.batch_id = b.batch_id AND q.status = 'pending')) AS pending,
       sum((SELECT count(*) FROM agent_work_queue q  -- (the tenant: migration 0018)
            WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
              AND q.status = 'leased')) AS leased
FROM agent_batch b
LEFT JOIN agent_pool_tenant t ON t.pool = b.pool AND t.tenant_id = b.tenant_id
WHERE b.pool = %(pool)s
GROUP BY b.tenant_id, t.weight
ORDER BY b.tenant_id;

-- Generators (jobrunner/generators.py, docs/sources.md): one task per batch, key
-- '__generate__', inserted with the batch; it runs the user's code, which enqueues the
-- batch's tasks in chunks (the ordinary keyed enqueue, each chunk one transaction fenced
-- on the generator's lease). Not counted in agent_batch.tasks (see counts).

-- name: generator_enqueue
-- The batch's generator step and its task (after ensure_batch locked the batch row):
-- idempotent on (batch_id, task_key), so a controller that restarts mid-enqueue, or a
-- second `jobrunner run`, inserts it once; a generator that already ran is not run again,
-- and the step first given to the batch stays its step.
WITH step AS (
    UPDATE agent_batch SET generator = coalesce(generator, %(generator)s::jsonb)
    WHERE batch_id = %(batch_id)s
    RETURNING batch_id, tenant_id
)
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, max_attempts)
SELECT batch_id, tenant_id, '__generate__', '{}'::jsonb, %(max_attempts)s
FROM step  -- (a '__generate__' key that exists: no row, migration 0017)
RETURNING id;

-- name: generator_state
-- Lock-free: the batch's generator step and its task (if any).
SELECT b.generator, g.status::text AS task_status, g.attempts, g.max_attempts,
       g.last_error, g.result, g.finished_at
FROM agent_batch b
LEFT JOIN agent_task_key gk ON gk.batch_id = b.batch_id AND gk.task_key = '__generate__'
LEFT JOIN agent_work_queue g ON g.id = gk.task_id
WHERE b.batch_id = %(batch_id)s;


-- name: batch_set_handler
-- A pool batch's handler, set by its first enqueue that names one (pool_handlers.py);
-- returns the handler it has, so a different one is refused.
UPDATE agent_batch SET handler = coalesce(handler, %(handler)s)
WHERE batch_id = %(batch_id)s
RETURNING handler;

-- name: batch_handler
-- The handler a pool worker runs a batch's tasks with (cached per batch by the worker).
SELECT handler FROM agent_batch WHERE batch_id = %(batch_id)s;
