-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- Tasks (agent_work_queue): enqueue, the lease life cycle, retention.
--
-- Plans: queue connections run with plan_cache_mode = force_generic_plan and without
-- sequential or bitmap scans (see jobrunner/queue/client.py), so the hot statements are planned
-- once, not on every call, and the same way whatever the table's statistics say. A
-- generic plan does not know how many ids a parameter array holds or what LIMIT is, so
-- rows are found by primary key through `id = ANY(array)` (always an index scan), not
-- by joining the table to an unnest() or a CTE (which a generic plan may turn into a
-- hash join over a sequential scan of the whole table). Fenced updates test
-- `status || '' = 'leased'` so that the planner cannot pick the partial index of leased
-- rows instead: statistics taken when few rows were leased make that index look
-- cheapest, but its scan reads every live lease of every worker.

-- name: task_stage_create
-- Create the transaction's staging table that enqueue COPYs its rows into.
CREATE TEMP TABLE jobrunner_enqueue_stage (
    task_key text NOT NULL, shard_key text, payload jsonb NOT NULL, max_attempts int NOT NULL,
    limits text[], tokens bigint
) ON COMMIT DROP;

-- name: task_stage_copy
-- COPY the enqueue's validated rows into the staging table (the payload as JSON text).
COPY jobrunner_enqueue_stage (task_key, shard_key, payload, max_attempts, limits, tokens)
FROM STDIN;

-- name: task_insert_staged
-- Insert the staged tasks of a batch that has no pool; returns how many were new.
--
-- Idempotent on (batch_id, task_key): rows that already exist are left untouched (the
-- task table's insert trigger skips a row whose key is in agent_task_key, sql/schema.sql).
WITH inserted AS (
    INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload, max_attempts,
                                  limits, tokens, trace_context)
    SELECT %(batch_id)s, %(tenant_id)s, s.task_key, s.shard_key, s.payload, s.max_attempts,
           s.limits, s.tokens, %(trace_context)s::jsonb
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

-- fragment: task_ack
-- The ack half of the three claim statements (task_ack_and_claim, _limited, _pool): the
-- statements' WITH and its CTEs lockable, acked and slots_freed, spliced in where they
-- say `-- include: task_ack` when the files are loaded: one text says what an ack does,
-- and each statement is still one plain text with its own plan. Their final SELECT
-- reads acked and lockable.
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

-- name: task_ack_and_claim
-- Ack finished attempts and claim the batch's next tasks, in one statement.
--
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
-- lock until it commits (a scan from the start; one from a position leaves such rows
-- out: see "Untouched rows"). Waiting for that commit (and its WAL flush) cost a quarter
-- of the statement time at 4 workers; otherwise the expirer (then the next try finds the
-- lease lost).
--
-- Claim: pick ready rows with FOR UPDATE SKIP LOCKED (rows other claimers hold are
-- skipped, never waited on), take the shard lease of at most one task per shard, then
-- mark the chosen rows leased. The CTE form matters: an `UPDATE ... WHERE id IN (SELECT
-- ... LIMIT n)` may be re-evaluated by the planner and claim more than n rows. The NOT
-- EXISTS is only a pre-filter that keeps rows of busy shards out of the LIMIT;
-- correctness comes from jobrunner_shard_take (see "Shard leases").
--
-- Shard leases (sql/schema.sql): a shard's lease is the leased row of its task, and a
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
-- pages made the workers queue for buffer locks (claim batch 10 fell from 16,000 to
-- 5,000 tasks/s at 8 workers; docs/performance.md). OFFSET 0 keeps the planner from
-- pulling the sublink up into a join or hashing it.
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
-- Untouched rows: a claim whose snapshot predates another claim's commit still sees the
-- rows that claim took as pending; with FOR UPDATE SKIP LOCKED it then locks their newest
-- (leased) version, finds it no longer pending and drops it, but keeps the lock until it
-- commits (and writes it: a page change and a WAL record). The worker that took the row
-- meanwhile ran the task; its ack found the row locked and came back 'busy', to be sent
-- again with its next statement, its shard held the while. At 16 workers on two cores that
-- was 40 %% of acks and a third more server CPU per task (docs/performance.md, issue 33).
-- So a scan from a position leaves out a row whose version in its snapshot has an xmax
-- other than its xmin: another transaction updated or locked it after this pending
-- version was written (a row being claimed, or claimed since, or locked by a claim that
-- then passed it over, its shard busy). (xmax = xmin: the transaction that made the row
-- pending again, expiry, a retry or a release, had locked the row before updating it,
-- and PostgreSQL carries its own lock over to the new version.) It is only a filter:
-- what may be claimed is still decided by the row lock, the status and the shard
-- lease. A row left out that is still
-- claimable (its locker passed it over, or rolled back) waits for the worker's next scan
-- from the start, which does not filter, as a row whose shard was busy already did: at
-- most about a second, or at once after a claim that came back short.
--
-- The halves touch disjoint rows (acked rows are leased, candidates pending). All CTEs
-- read one snapshot, so a shard this ack releases still looks busy to this claim's
-- pre-filter: its next task goes to the next claim (this worker's or another's).
-- Rows come back tagged: 'acked', 'busy' (ack again later) or 'leased' (a new lease);
-- an id that is neither acked nor busy is a lost lease. A lease carries the trace
-- context its enqueue stored (migration 0027; NULL, the usual case, when the enqueue was
-- not traced), so that a sampled attempt's span links to the enqueue's without a
-- statement of its own (one more round trip per sampled attempt, issue 32). Every claim
-- statement returns the same columns (the pool's add the tag).
--
-- Flow control: this statement never claims a task that names a limit, and checks no
-- budget, so tasks without limits pay nothing for limits (even one index probe more
-- per claim cost 10 %% of the server CPU per task at claim batch 1). A batch under flow
-- control (its tasks name limits, or it has a budget: agent_batch.flow_control, only
-- ever set) is claimed with ack_and_claim_limited instead: the worker reads the flag
-- (batch_flow_control) when it starts and then once a second. Its acks release
-- concurrency slots all the same (a task acked through it may hold one).
-- include: task_ack
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key
    FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      -- Where this worker's scan starts (the position after its last claim, or the
      -- start: '-infinity', 0): see "Scan position" above.
      AND (q.run_after, q.id) > (%(after_run_after)s::timestamptz, %(after_id)s::bigint)
      -- A scan from a position passes over a row whose pending version another
      -- transaction has touched since (see "Untouched rows"); one from the start does not.
      AND (%(after_id)s::bigint = 0 OR q.xmax = 0 OR q.xmax = q.xmin)
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
    -- the tasks whose shard this claim may lease (sql/schema.sql; a volatile function,
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
        leased_at = now(),  -- the attempt's start (agent_task_attempt, migration 0028)
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after,
              q.trace_context::text AS trace_context
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
       NULL::timestamptz AS run_after, NULL::text AS trace_context
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after, trace_context
FROM claimed;

-- name: task_ack_and_claim_limited
-- task_ack_and_claim for a batch under flow control: also admits by limits and budget.
--
-- ack_and_claim for a batch under flow control (docs/flow-control.md): the same acks,
-- scan position, shard leases and tags, plus the tasks' limits and the batch's budget.
-- Separate so that tasks without limits do not pay for its plan: a generic plan's
-- executor start-up covers every node on every execution, and these nodes doubled it
-- (+50 %% server CPU per task at claim batch 1, measured).
--
-- Limits (docs/flow-control.md): for each limit the candidates name, the claim takes
-- one of its lanes (agent_limit_lane, sql/schema.sql) with FOR NO KEY UPDATE SKIP
-- LOCKED, reading its newest version and holding it until commit (in the functions
-- jobrunner_limit_admit and jobrunner_limit_charge, sql/schema.sql, whose statements
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
-- include: task_ack
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key, q.limits, q.tokens
    FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      -- Where this worker's scan starts (the position after its last claim, or the
      -- start: '-infinity', 0): see "Scan position" above.
      AND (q.run_after, q.id) > (%(after_run_after)s::timestamptz, %(after_id)s::bigint)
      -- A scan from a position passes over a row whose pending version another
      -- transaction has touched since (see "Untouched rows"); one from the start does not.
      AND (%(after_id)s::bigint = 0 OR q.xmax = 0 OR q.xmax = q.xmin)
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
    -- Lock a lane per limit, read the clock, admit candidates (sql/schema.sql: in a
    -- function so that the lanes, which other claims keep changing, are read with a
    -- fresh snapshot and never rechecked by this statement's EvalPlanQual).
    SELECT * FROM jobrunner_limit_admit(  -- (ranked in id order under each limit)
        ARRAY(SELECT id FROM candidates WHERE limits IS NOT NULL ORDER BY id))
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
    -- the tasks whose shard this claim may lease (sql/schema.sql; a volatile function,
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
        leased_at = now(),  -- the attempt's start (agent_task_attempt, migration 0028)
        -- a task under limits: the database time its limits admitted it (what they count)
        -- (and evaluating it charges the lanes: `charged`)
        updated_at = CASE WHEN q.limits IS NULL THEN now()
                          ELSE (SELECT t FROM charged) END
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after,
              q.trace_context::text AS trace_context
)
-- No lock is ever waited for: acks and claims both skip locked task rows and limit
-- lanes, and shard locks are only tried (see ack_and_claim); so no cycle of waits, no
-- deadlock. (An earlier version waited for busy acks; it had to ack before
-- claiming, or two workers acking rows the other had just re-checked deadlocked for
-- deadlock_timeout at 8 workers.)
SELECT 'acked' AS outcome, id, NULL::text AS batch_id, NULL::text AS task_key,
       NULL::text AS tenant_id, NULL::text AS shard_key, NULL::jsonb AS payload,
       NULL::int AS attempts, NULL::int AS max_attempts, NULL::timestamptz AS locked_until,
       NULL::timestamptz AS run_after, NULL::text AS trace_context
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after, trace_context
FROM claimed
UNION ALL
-- every lane of a limit was held by other claims: the worker should come back at once
(SELECT 'wait', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
 FROM admit WHERE wait
 LIMIT 1);

-- name: task_heartbeat
-- Renew the leases this worker still holds; returns their ids.
--
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

-- name: task_fail
-- Record a failed attempt: back to pending with backoff, or dead; returns the status.
--
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
    RETURNING q.id, q.status, q.run_after, q.tenant_id, q.shard_key, q.limits,
              q.batch_id, q.leased_at
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING failed
    WHERE failed.limits IS NOT NULL
      AND s.limit_name = ANY(failed.limits) AND s.task_id = failed.id
),
attempt_ended AS (
    -- (the attempt's history: migration 0028)
    INSERT INTO agent_task_attempt (task_id, attempt, batch_id, tenant_id, worker,
                                    started_at, outcome, status, error)
    SELECT id, %(attempt)s, batch_id, tenant_id, %(worker_id)s, leased_at, 'failed',
           status, %(error)s
    FROM failed
)
SELECT id, status, run_after FROM failed;

-- name: task_throttle
-- Give a rate-limited attempt back and block its limits until retry_after.
--
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
    RETURNING q.id, q.status, q.run_after, q.tenant_id, q.shard_key, q.limits,
              q.batch_id, q.leased_at, q.last_error
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING throttled t
    WHERE t.limits IS NOT NULL AND s.limit_name = ANY(t.limits) AND s.task_id = t.id
),
attempt_ended AS (
    -- (the attempt's history: migration 0028; its number as the worker held it)
    INSERT INTO agent_task_attempt (task_id, attempt, batch_id, tenant_id, worker,
                                    started_at, outcome, status, error)
    SELECT id, %(attempt)s, batch_id, tenant_id, %(worker_id)s, leased_at,
           'rate_limited', status, last_error
    FROM throttled
)
SELECT id, status, run_after FROM throttled;

-- name: task_release
-- Hand leases back without counting the attempt (graceful shutdown).
--
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
    RETURNING q.id, q.tenant_id, q.shard_key, q.limits, q.batch_id, q.leased_at,
              q.status, t.attempt
),
slots_freed AS (
    DELETE FROM agent_limit_lease s USING released_tasks r
    WHERE r.limits IS NOT NULL AND s.limit_name = ANY(r.limits) AND s.task_id = r.id
),
attempt_ended AS (
    -- (the attempt's history: migration 0028; its number as the worker held it)
    INSERT INTO agent_task_attempt (task_id, attempt, batch_id, tenant_id, worker,
                                    started_at, outcome, status)
    SELECT id, attempt, batch_id, tenant_id, %(worker_id)s, leased_at, 'released', status
    FROM released_tasks
)
SELECT id FROM released_tasks;

-- name: task_next_due
-- Seconds until the batch's earliest pending task is due (<= 0: one is due now), NULL
-- when nothing is pending: what a worker whose claim came back empty sleeps on.
--
-- One probe of the pending index's first entry for the batch. A waiting worker asks it
-- before a long sleep: nothing pending, or nothing due before the sleep ends, and only
-- a note can bring work sooner (enqueue, retry, expiry, release, requeue, a raised budget
-- or resumed limit all send one); a task due now that its claim did not get (its shard
-- busy, its limit full, its budget spent) means looking again sooner, as before.
SELECT extract(epoch FROM (
    SELECT q.run_after FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s AND q.status = 'pending'
    ORDER BY q.run_after, q.id
    LIMIT 1) - now())::float8 AS seconds;

-- name: task_next_due_pool
-- As task_next_due, for a pool's pending tasks: the pool's pending index is in claim
-- order (vtag), not time, so the earliest of its first %(scan)s entries. A pool whose
-- first %(scan)s entries are all retries waiting out their backoff may have a task due
-- further on, which the claim would find: then "due now" (the worker claims, as it did
-- before it looked).
SELECT extract(epoch FROM (
    SELECT CASE WHEN count(*) >= %(scan)s THEN least(min(p.run_after), now())
                ELSE min(p.run_after) END FROM (
        SELECT q.run_after FROM agent_work_queue q
        WHERE q.pool = %(pool)s AND q.status = 'pending'
        ORDER BY q.vtag, q.id
        LIMIT %(scan)s) p) - now())::float8 AS seconds;

-- name: task_expired_any
-- Whether any lease has expired: the sweep's cheap first look (task_expire only when so).
--
-- A sweep almost always finds nothing, and most of its cost was planning task_expire
-- (a fleet behind PgBouncer plans every statement afresh): this one is planned in a
-- fraction of that and reads the same leased rows.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE status = 'leased' AND locked_until < now()) AS expired;

-- name: task_expire
-- Return expired leases to pending, or dead when their attempts are used up.
--
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
    RETURNING q.id, q.batch_id, q.status, q.tenant_id, q.shard_key, q.limits,
              q.attempts, q.lease_owner, q.leased_at, q.last_error
),
slots_freed AS (
    -- a killed worker's concurrency slots free here, when its lease expires
    DELETE FROM agent_limit_lease s USING moved
    WHERE moved.limits IS NOT NULL AND s.limit_name = ANY(moved.limits) AND s.task_id = moved.id
),
attempt_ended AS (
    -- (the attempt's history: migration 0028)
    INSERT INTO agent_task_attempt (task_id, attempt, batch_id, tenant_id, worker,
                                    started_at, outcome, status, error)
    SELECT id, attempts, batch_id, tenant_id, lease_owner, leased_at, 'expired', status,
           last_error
    FROM moved
)
SELECT id, batch_id, status FROM moved;

-- name: task_requeue_dead
-- Put a batch's dead tasks (all, or the given keys) back to pending.
UPDATE agent_work_queue
SET status = 'pending', attempts = 0, run_after = now(), finished_at = NULL,
    locked_until = NULL, updated_at = now()
WHERE batch_id = %(batch_id)s AND status = 'dead'
  AND (%(task_keys)s::text[] IS NULL OR task_key = ANY(%(task_keys)s::text[]));

-- name: task_list_dead
-- A batch's dead tasks with their last error.
SELECT id, task_key, tenant_id, shard_key, attempts, max_attempts, last_error, finished_at
FROM agent_work_queue
WHERE batch_id = %(batch_id)s AND status = 'dead'
ORDER BY id
LIMIT %(limit)s;

-- name: task_delete_finished
-- Delete (or archive) a small batch of finished rows older than the cut-off.
--
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
attempts_deleted AS (
    -- a task's attempts go with it (the archive keeps its last error)
    DELETE FROM agent_task_attempt a
    WHERE a.task_id = ANY(ARRAY(SELECT id FROM old))
),
uncounted AS (
    -- (a reduce or generator task was never counted: sql/schema.sql)
    UPDATE agent_batch b SET tasks = b.tasks - d.n
    FROM (SELECT batch_id, count(*) FILTER (WHERE task_key NOT IN ('__reduce__',
                                                                  '__generate__')) AS n
          FROM deleted GROUP BY batch_id) d
    WHERE b.batch_id = d.batch_id
)
SELECT id FROM deleted;

-- name: task_ack_and_claim_pool
-- task_ack_and_claim for a pool's workers: candidates in fair tag order across batches.
--
-- ack_and_claim for a pool's workers: the same acks, shard leases, tags and guarantees
-- (see ack_and_claim above), but the candidates are the pool's pending tasks in tag
-- order, whatever their batch: the claim index (pool, vtag, id) holds pending pool tasks
-- only. The scan position is (vtag, id) after the worker's last claim, reset at least
-- every second as in ack_and_claim. Rows come back as ack_and_claim's plus the tag.
-- Like ack_and_claim it never claims a task that names a limit and checks no budget: a
-- pool with a pending task of a batch under flow control is claimed with
-- task_ack_and_claim_pool_limited (below) instead, so a pool without one pays nothing.
-- include: task_ack
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key
    FROM agent_work_queue q
    WHERE q.pool = %(pool)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      AND (q.vtag, q.id) > (%(after_vtag)s::float8, %(after_id)s::bigint)
      -- A scan from a position passes over a row whose pending version another
      -- transaction has touched since (see "Untouched rows"); one from the start does not.
      AND (%(after_id)s::bigint = 0 OR q.xmax = 0 OR q.xmax = q.xmin)
      AND NOT EXISTS (  -- (a leased task of the shard: see "Shard leases")
          SELECT 1 FROM agent_work_queue l
          WHERE l.tenant_id = q.tenant_id AND l.shard_key = q.shard_key
            AND l.status = 'leased'
          OFFSET 0)  -- one index probe per candidate, never a join: see "Shard pre-filter"
      AND q.limits IS NULL  -- (tasks with limits: task_ack_and_claim_pool_limited)
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
    -- the tasks whose shard this claim may lease (sql/schema.sql; a volatile function,
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
        leased_at = now(),  -- the attempt's start (agent_task_attempt, migration 0028)
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after,
              q.trace_context::text AS trace_context, q.vtag
)
SELECT 'acked' AS outcome, id, NULL::text AS batch_id, NULL::text AS task_key,
       NULL::text AS tenant_id, NULL::text AS shard_key, NULL::jsonb AS payload,
       NULL::int AS attempts, NULL::int AS max_attempts, NULL::timestamptz AS locked_until,
       NULL::timestamptz AS run_after, NULL::text AS trace_context, NULL::float8 AS vtag
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after, trace_context, vtag
FROM claimed;

-- name: task_ack_and_claim_pool_limited
-- task_ack_and_claim_pool for a pool under flow control: also admits by limits and budgets.
--
-- The pool claim (above) with task_ack_and_claim_limited's limits and budget (see it for
-- the lanes, the admission and the charge, all unchanged), for a pool that has a pending
-- task of a batch under flow control (pool_flow_control, read by the worker once a
-- second): a pool without one keeps the plain statement and pays nothing for limits.
--
-- The claim takes the next tasks in (vtag, id) order that their limits and budgets
-- allow, so fair share holds among the tasks that may run, and a stream whose limit is
-- full or blocked (a 429), or whose batch spent its budget, does not hold up the others:
-- - the candidate scan leaves out tasks whose limit is visibly full (blocked, every
--   lane's next request or token not due, or every lane's slots taken) and tasks of a
--   batch whose budget is spent, so they do not fill the claim's LIMIT; only tasks that
--   may well be admitted take a place in it. (The single batch's claim does not look at
--   slots here: its tasks usually all name the same limits, so there is no one else to
--   let through. In a pool a concurrency limit full for one tenant must not leave a
--   claim of batch 1 with that tenant's next task as its only candidate, to be refused.)
-- - jobrunner_limit_admit ranks the candidates under each limit in the order given, here
--   (vtag, id): when a limit has room for k of them, the k earliest in fair order get it.
-- Budgets: one index probe of agent_batch_usage per candidate (its batch's row; none: no
-- budget) and one of agent_pool_tenant_usage (its tenant's row in the pool), a pre-filter as in task_ack_and_claim_limited (tasks in flight when the
-- budget is reached finish, so the overshoot is at most what was in flight).
-- The charge runs in this statement, as in task_ack_and_claim_limited: one round trip.
-- include: task_ack
candidates AS (
    SELECT q.id, q.tenant_id, coalesce(q.shard_key, '') AS shard_key, q.limits, q.vtag
    FROM agent_work_queue q
    WHERE q.pool = %(pool)s
      AND q.status = 'pending'
      AND q.run_after <= now()
      AND (q.vtag, q.id) > (%(after_vtag)s::float8, %(after_id)s::bigint)
      -- A scan from a position passes over a row whose pending version another
      -- transaction has touched since (see "Untouched rows"); one from the start does not.
      AND (%(after_id)s::bigint = 0 OR q.xmax = 0 OR q.xmax = q.xmin)
      AND NOT EXISTS (  -- (a leased task of the shard: see "Shard leases")
          SELECT 1 FROM agent_work_queue l
          WHERE l.tenant_id = q.tenant_id AND l.shard_key = q.shard_key
            AND l.status = 'leased'
          OFFSET 0)  -- one index probe per candidate, never a join: see "Shard pre-filter"
      -- Limits that exist and are not visibly full; the check that counts is
      -- jobrunner_limit_admit's, under the locks (see task_ack_and_claim_limited, and
      -- above for the slots). One array for the whole statement.
      AND (q.limits IS NULL OR q.limits <@ ARRAY(
          SELECT l.name FROM agent_limit l
          WHERE (l.blocked_until IS NULL OR l.blocked_until <= clock_timestamp())
            AND EXISTS (
                SELECT 1 FROM agent_limit_lane ln
                WHERE ln.limit_name = l.name
                  AND (ln.requests IS NULL OR ln.request_tat <= clock_timestamp())
                  AND (ln.tokens IS NULL OR ln.token_tat <= clock_timestamp())
                  AND (ln.max_concurrent IS NULL OR ln.max_concurrent > (
                      SELECT count(*) FROM agent_limit_lease s
                      WHERE s.limit_name = ln.limit_name AND s.lane = ln.lane)))))
      AND NOT EXISTS (  -- (the task's batch has spent its budget)
          SELECT 1 FROM agent_batch_usage b
          WHERE b.batch_id = q.batch_id
            AND (b.tokens >= b.budget_tokens OR b.cost >= b.budget_cost)
          OFFSET 0)  -- one probe per candidate, as the shard pre-filter
      AND NOT EXISTS (  -- (the task's tenant has spent its budget in the pool)
          SELECT 1 FROM agent_pool_tenant_usage t
          WHERE t.pool = %(pool)s AND t.tenant_id = q.tenant_id
            AND (t.tokens >= t.budget_tokens OR t.cost >= t.budget_cost)
          OFFSET 0)
    ORDER BY q.vtag, q.id
    LIMIT %(limit)s
    FOR UPDATE OF q SKIP LOCKED
),
admit AS MATERIALIZED (
    -- (sql/schema.sql; ranked in fair order under each limit, see above)
    SELECT * FROM jobrunner_limit_admit(
        ARRAY(SELECT id FROM candidates WHERE limits IS NOT NULL ORDER BY vtag, id))
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
    ORDER BY tenant_id, shard_key, vtag, id
),
shard_leases AS (
    -- the tasks whose shard this claim may lease (sql/schema.sql; a volatile function,
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
        leased_at = now(),  -- the attempt's start (agent_task_attempt, migration 0028)
        -- a task under limits: the database time its limits admitted it (what they count)
        -- (and evaluating it charges the lanes: `charged`)
        updated_at = CASE WHEN q.limits IS NULL THEN now()
                          ELSE (SELECT t FROM charged) END
    WHERE q.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING q.id, q.batch_id, q.task_key, q.tenant_id, q.shard_key, q.payload,
              q.attempts, q.max_attempts, q.locked_until, q.run_after,
              q.trace_context::text AS trace_context, q.vtag
)
SELECT 'acked' AS outcome, id, NULL::text AS batch_id, NULL::text AS task_key,
       NULL::text AS tenant_id, NULL::text AS shard_key, NULL::jsonb AS payload,
       NULL::int AS attempts, NULL::int AS max_attempts, NULL::timestamptz AS locked_until,
       NULL::timestamptz AS run_after, NULL::text AS trace_context, NULL::float8 AS vtag
FROM acked
UNION ALL
SELECT 'busy', b.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM agent_work_queue b
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.id <> ALL(ARRAY(SELECT id FROM lockable))
  AND cardinality(%(ids)s::bigint[]) > (SELECT count(*) FROM lockable)  -- else not run
UNION ALL
SELECT 'leased', id, batch_id, task_key, tenant_id, shard_key, payload, attempts,
       max_attempts, locked_until, run_after, trace_context, vtag
FROM claimed
UNION ALL
-- every lane of a limit was held by other claims: the worker should come back at once
(SELECT 'wait', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
 FROM admit WHERE wait
 LIMIT 1);

-- name: task_end_missing_effects
-- Before an ack: end the leases of successes whose recorded effects are missing.
--
-- Sent in front of the ack of attempts that used task.once, in the ack's transaction.
-- An effect and its ledger row commit together, so a failover with asynchronous
-- replication can lose both while the lease, claimed earlier, survived: the worker still
-- holds it on the new primary, and its ack, sent there, would land and leave the task
-- done without its effect. Such a lease is ended here instead, as if it had expired: the
-- owner no longer matches, so the ack that follows is fenced off (the worker counts the
-- attempt as lost); the expirer returns the task to pending within about a second; the
-- next attempt applies the effect. Normally every ledger row is there: index probes,
-- nothing written. ids, attempts and effect_keys are parallel arrays, one entry per
-- (attempt, effect key); tasks are found by primary key (see "Plans" at the top of this file).
UPDATE agent_work_queue q
SET lease_owner = q.lease_owner || ' (its effects were lost in a failover)',
    locked_until = now(),
    updated_at = now()
WHERE q.id = ANY(%(ids)s::bigint[])
  AND q.lease_owner = %(worker_id)s
  AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
  AND EXISTS (
      SELECT 1
      FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(effect_keys)s::text[])
           AS e(id, attempt, effect_key)
      WHERE e.id = q.id AND e.attempt = q.attempts
        AND NOT EXISTS (
            SELECT 1 FROM agent_task_effect l
            WHERE l.batch_id = q.batch_id AND l.task_key = q.task_key
              AND l.effect_key = e.effect_key))
RETURNING q.id;

-- name: task_stats
-- A batch's attempts, task count and median latency of its done tasks (its own tasks:
-- the reserved keys, given as reserved_keys, are left out).
SELECT coalesce(sum(attempts), 0) AS attempts, count(*) AS tasks,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at))
           FILTER (WHERE status = 'done') AS p50_latency
FROM agent_task_key k JOIN agent_work_queue q ON q.id = k.task_id
WHERE k.batch_id = %(batch_id)s  -- (the batch's rows by key)
  AND k.task_key <> ALL(%(reserved_keys)s::text[]);

-- ---------------------------------------------------------------------------------
-- The web console's task browser and actions (jobrunner/server/console/, docs/console.md).
-- Each page reads at most %(scan)s index entries, whatever the filter: a page that does
-- not fill within them says where it stopped, and the next page goes on from there
-- (keyset pagination, never OFFSET, never a count over the batch). The payload filter is
-- a JSON containment (`payload @> %(contains)s`), always a bound parameter.

-- name: task_page
-- A page of a batch's tasks in key order after %(after)s: status, key prefix, payload, shard, attempts and error filters, at most %(scan)s keys read.
--
-- The batch's keys come from agent_task_key's primary key (batch_id, task_key) in order,
-- starting at the prefix; each key's task is then read by id, until the page is full.
-- `scanned` and `last_key` (on every row, and on the one row of an empty page) say how
-- far the scan went.
WITH scanned AS MATERIALIZED (
    SELECT k.task_key, k.task_id FROM agent_task_key k
    WHERE k.batch_id = %(batch_id)s AND k.task_key > %(after)s AND k.task_key >= %(prefix)s
    ORDER BY k.task_key
    LIMIT %(scan)s
),
edge AS (SELECT count(*) AS scanned, max(task_key) AS last_key FROM scanned)
SELECT e.scanned, e.last_key, m.*
FROM edge e
LEFT JOIN LATERAL (
    SELECT q.id, s.task_key, q.status::text AS status, q.attempts, q.max_attempts,
           q.shard_key, left(q.payload::text, 160) AS payload_preview,
           left(q.last_error, 160) AS error_preview, q.updated_at, q.finished_at
    -- (each key's task by its primary key, never a join the planner may turn into a
    -- scan of the whole table when the filters look selective: OFFSET 0 keeps the probe)
    FROM scanned s
    CROSS JOIN LATERAL (SELECT * FROM agent_work_queue q1 WHERE q1.id = s.task_id
                        OFFSET 0) q
    WHERE (%(status)s::text IS NULL OR q.status = %(status)s)
      AND starts_with(s.task_key, %(prefix)s)
      AND (%(contains)s::jsonb IS NULL OR q.payload @> %(contains)s::jsonb)
      AND (%(shard)s::text IS NULL OR q.shard_key = %(shard)s)
      AND (%(min_attempts)s::int IS NULL OR q.attempts >= %(min_attempts)s)
      AND (%(error)s::text IS NULL OR strpos(lower(q.last_error), lower(%(error)s)) > 0)
    ORDER BY s.task_key
    LIMIT %(limit)s
) m ON true
ORDER BY m.task_key;

-- name: task_page_failed
-- A page of a batch's dead (or cancelled) tasks in id order after %(after_id)s, key prefix, payload, shard, attempts and error filters, at most %(scan)s read.
--
-- From the partial index of dead and cancelled rows (batch_id, status, id): only the
-- failed rows are read, however many tasks the batch has done. (The literal IN names the
-- index's predicate, so the index is usable with any value of %(status)s.)
WITH scanned AS MATERIALIZED (
    SELECT q.id FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s AND q.status IN ('dead', 'cancelled')
      AND q.status = %(status)s AND q.id > %(after_id)s
    ORDER BY q.id
    LIMIT %(scan)s
),
edge AS (SELECT count(*) AS scanned, max(id) AS last_id FROM scanned)
SELECT e.scanned, e.last_id, m.*
FROM edge e
LEFT JOIN LATERAL (
    SELECT q.id, q.task_key, q.status::text AS status, q.attempts, q.max_attempts,
           q.shard_key, left(q.payload::text, 160) AS payload_preview,
           left(q.last_error, 160) AS error_preview, q.updated_at, q.finished_at
    FROM scanned s JOIN agent_work_queue q ON q.id = s.id
    WHERE starts_with(q.task_key, %(prefix)s)
      AND (%(contains)s::jsonb IS NULL OR q.payload @> %(contains)s::jsonb)
      AND (%(shard)s::text IS NULL OR q.shard_key = %(shard)s)
      AND (%(min_attempts)s::int IS NULL OR q.attempts >= %(min_attempts)s)
      AND (%(error)s::text IS NULL OR strpos(lower(q.last_error), lower(%(error)s)) > 0)
    ORDER BY q.id
    LIMIT %(limit)s
) m ON true
ORDER BY m.id;

-- name: task_get_by_key
-- One task of a batch, by key, with its payload and result as JSON text.
SELECT q.id, q.batch_id, q.tenant_id, q.task_key, q.shard_key, q.status::text AS status,
       q.attempts, q.max_attempts, q.payload::text AS payload, q.result::text AS result,
       q.last_error, q.lease_owner, q.locked_until, q.run_after, q.created_at, q.updated_at,
       q.finished_at, q.tokens, q.limits, q.pool, q.leased_at
FROM agent_task_key k JOIN agent_work_queue q ON q.id = k.task_id
WHERE k.batch_id = %(batch_id)s AND k.task_key = %(task_key)s;

-- name: task_attempt_list
-- A task's newest attempts that ended without an ack (migration 0028), newest first: by
-- its primary key, bounded (a task that was rate-limited a thousand times has a
-- thousand rows).
SELECT attempt, worker, started_at, ended_at, outcome, status, error
FROM agent_task_attempt
WHERE task_id = %(task_id)s
ORDER BY ended_at DESC
LIMIT %(limit)s;

-- name: task_count_dead_matching
-- How many of a batch's dead tasks match the filter (one key, a key prefix, a payload containment, a shard, at least some attempts, error text), counted up to %(cap)s.
SELECT count(*) AS n FROM (
    SELECT 1 FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s AND q.status = 'dead'
      AND (%(task_key)s::text IS NULL OR q.task_key = %(task_key)s)
      AND starts_with(q.task_key, %(prefix)s)
      AND (%(contains)s::jsonb IS NULL OR q.payload @> %(contains)s::jsonb)
      AND (%(shard)s::text IS NULL OR q.shard_key = %(shard)s)
      AND (%(min_attempts)s::int IS NULL OR q.attempts >= %(min_attempts)s)
      AND (%(error)s::text IS NULL OR strpos(lower(q.last_error), lower(%(error)s)) > 0)
    LIMIT %(cap)s) x;

-- name: task_requeue_dead_matching
-- Put at most %(cap)s of a batch's dead tasks that match the filter back to pending (as task_requeue_dead); returns their ids.
WITH chosen AS (
    SELECT q.id FROM agent_work_queue q
    WHERE q.batch_id = %(batch_id)s AND q.status = 'dead'
      AND (%(task_key)s::text IS NULL OR q.task_key = %(task_key)s)
      AND starts_with(q.task_key, %(prefix)s)
      AND (%(contains)s::jsonb IS NULL OR q.payload @> %(contains)s::jsonb)
      AND (%(shard)s::text IS NULL OR q.shard_key = %(shard)s)
      AND (%(min_attempts)s::int IS NULL OR q.attempts >= %(min_attempts)s)
      AND (%(error)s::text IS NULL OR strpos(lower(q.last_error), lower(%(error)s)) > 0)
    ORDER BY q.id
    LIMIT %(cap)s
    FOR UPDATE
)
UPDATE agent_work_queue q
SET status = 'pending', attempts = 0, run_after = now(), finished_at = NULL,
    locked_until = NULL, updated_at = now()
FROM chosen c
WHERE q.id = c.id AND q.status = 'dead'
RETURNING q.id;

-- name: task_list_dead_recent
-- The newest dead tasks across the batches (of one tenant, or all): at most %(limit)s per batch read, newest first.
SELECT d.id, b.batch_id, b.tenant_id, d.task_key, d.attempts, left(d.last_error, 300) AS error,
       d.finished_at
FROM agent_batch b
CROSS JOIN LATERAL (
    SELECT q.id, q.task_key, q.attempts, q.last_error, q.finished_at FROM agent_work_queue q
    WHERE q.batch_id = b.batch_id AND q.status = 'dead'
    ORDER BY q.id DESC
    LIMIT %(limit)s) d
WHERE %(tenant_id)s::text IS NULL OR b.tenant_id = %(tenant_id)s
ORDER BY d.id DESC
LIMIT %(limit)s;

-- name: task_retry_notify
-- Tell idle workers when the retries just scheduled come due (one note per target and time).
--
-- Sent after failures went back to pending with a backoff: the payload is the target
-- ("batch ID" or "pool NAME") and the seconds until the retry is due, relative to
-- the statement, so a listener's clock never has to agree with the server's. Idle workers
-- of that target sleep until then instead of polling for it.
--
-- The rows (target, seconds) go back to the failing worker too: it schedules its own look
-- from them, so a note its listener missed (it was still connecting) loses nothing.
--
-- The retry is its own worker's to claim; the others only look for it a little after it
-- is due, in case that worker is busy or gone. Two waiting workers of the target (the
-- most recently seen rows of agent_worker_wait) are rung (agent_worker_wait_ring: a
-- sleeping notifier's statement is cancelled and it looks; one still LISTENing gets the
-- note "due TARGET SECONDS" on its own channel; worker_wait_wake says why), so a fleet
-- of 1,000 waiting pods does not send 1,000 looks per retry; with none waiting, every
-- listener of the target is told (jobrunner_due, payload "TARGET SECONDS"), as before.
-- Their rows stay: they look, they are not wanted for a claim.
SELECT n.target, n.seconds::float8 AS seconds,
       CASE WHEN w.ids IS NULL
            THEN pg_notify('jobrunner_due', n.target || ' ' || n.seconds) END AS everyone,
       agent_worker_wait_ring(w.ids, w.pids, 'due ' || n.target || ' ' || n.seconds)
           AS named
FROM (SELECT DISTINCT q.batch_id, q.pool,
             CASE WHEN q.pool IS NULL THEN 'batch ' || q.batch_id ELSE 'pool ' || q.pool END
                 AS target,
             round(extract(epoch FROM q.run_after - clock_timestamp())::numeric, 2)::text
                 AS seconds
      FROM agent_work_queue q
      WHERE q.id = ANY(%(ids)s::bigint[]) AND q.status = 'pending'
        AND q.run_after > clock_timestamp()) n
LEFT JOIN LATERAL (
    SELECT array_agg(x.wait_id) AS ids, array_agg(x.pid) AS pids
    FROM ((SELECT v.wait_id, v.pid FROM agent_worker_wait v
           WHERE n.pool IS NULL AND v.batch_id = n.batch_id
           ORDER BY v.seen_at DESC LIMIT 2)
          UNION ALL
          (SELECT v.wait_id, v.pid FROM agent_worker_wait v
           WHERE n.pool IS NOT NULL AND v.pool = n.pool
           ORDER BY v.seen_at DESC LIMIT 2)) x) w ON true;
