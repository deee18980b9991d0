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
RETURNING tenant_id, cancelled_at;

-- name: enqueue_stage_table
CREATE TEMP TABLE jobrunner_enqueue_stage (
    task_key text NOT NULL, shard_key text, payload jsonb NOT NULL, max_attempts int NOT NULL
) ON COMMIT DROP;

-- name: enqueue_from_stage
-- Idempotent on (batch_id, task_key): rows that already exist are left untouched.
WITH inserted AS (
    INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload, max_attempts)
    SELECT %(batch_id)s, %(tenant_id)s, s.task_key, s.shard_key, s.payload, s.max_attempts
    FROM jobrunner_enqueue_stage s
    ORDER BY s.task_key
    ON CONFLICT (batch_id, task_key) DO NOTHING
    RETURNING 1
),
counted AS (
    SELECT count(*) AS new FROM inserted
),
batch_tasks AS (
    -- The batch's task count (status counts derive done from it), in the same
    -- transaction as the rows; concurrent enqueues of one batch already queue up on
    -- this row (ensure_batch locked it).
    UPDATE agent_batch SET tasks = tasks + (SELECT new FROM counted)
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
-- lease is released in the same statement. An acked row that another transaction holds
-- locked at this moment is not waited for: it comes back as 'busy' and the worker sends
-- its ack again with its next statement. Who holds it: almost always a claimer whose
-- snapshot predates our claim's commit: its SKIP LOCKED scan still saw the row as
-- pending, locked the newest version and only then found it leased, and keeps that
-- lock until it commits. Waiting for that commit (and its WAL flush) cost a quarter of
-- the statement time at 4 workers; otherwise the expirer (then the next try finds the
-- lease lost).
--
-- Claim: pick ready rows with FOR UPDATE SKIP LOCKED (rows other claimers hold are
-- skipped, never waited on), take the shard lease of at most one task per shard (the
-- primary key of agent_shard_lease serialises concurrent claimers of the same shard:
-- the loser's INSERT sees the conflict and the task is simply not chosen), then mark
-- the chosen rows leased. The CTE form matters: an `UPDATE ... WHERE id IN (SELECT ...
-- LIMIT n)` may be re-evaluated by the planner and claim more than n rows. The NOT
-- EXISTS is only a pre-filter that keeps rows of busy shards out of the LIMIT;
-- correctness comes from the INSERT.
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
    RETURNING q.id, q.tenant_id, q.shard_key
),
released AS (
    DELETE FROM agent_shard_lease s USING acked
    WHERE (s.tenant_id, s.shard_key, s.task_id) = (acked.tenant_id, acked.shard_key, acked.id)
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
      AND NOT EXISTS (
          SELECT 1 FROM agent_shard_lease s
          WHERE s.tenant_id = q.tenant_id AND s.shard_key = q.shard_key)
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
    -- Inserted in key order so that two claimers never wait on each other in a cycle.
    INSERT INTO agent_shard_lease (tenant_id, shard_key, task_id, lease_owner)
    SELECT tenant_id, shard_key, id, %(worker_id)s FROM one_per_shard
    ORDER BY tenant_id, shard_key
    ON CONFLICT DO NOTHING
    RETURNING task_id
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
-- No row lock is ever waited for: acks and claims both skip locked rows, and the
-- shard-lease inserts wait only on other inserts of the same key, taken in key order;
-- so no cycle of waits, no deadlock. (An earlier version waited for busy acks; it had
-- to ack before claiming, or two workers acking rows the other had just re-checked
-- deadlocked for deadlock_timeout at 8 workers.)
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
-- to 25 %% jitter. Permanent failure, or attempts used up: dead.
WITH failed AS (
    UPDATE agent_work_queue q
    SET status = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts
                      THEN 'dead' ELSE 'pending' END,
        run_after = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts
                         THEN q.run_after
                         ELSE now() + make_interval(secs => least(
                             %(backoff_cap)s::float8,
                             %(backoff_base)s::float8 * power(2, q.attempts)
                                 * (1 + 0.25 * random())))
                    END,
        finished_at = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts
                           THEN now() END,
        last_error = %(error)s,
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = %(id)s
      AND q.attempts = %(attempt)s
      AND q.lease_owner = %(worker_id)s
      AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
    RETURNING q.id, q.status, q.run_after, q.tenant_id, q.shard_key
),
released AS (
    DELETE FROM agent_shard_lease s USING failed
    WHERE (s.tenant_id, s.shard_key, s.task_id) = (failed.tenant_id, failed.shard_key, failed.id)
)
SELECT id, status, run_after FROM failed;

-- name: release
-- Graceful shutdown: give the task back without burning an attempt.
WITH released_tasks AS (
    UPDATE agent_work_queue q
    SET status = 'pending',
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
    RETURNING q.id, q.tenant_id, q.shard_key
),
released AS (
    DELETE FROM agent_shard_lease s USING released_tasks r
    WHERE (s.tenant_id, s.shard_key, s.task_id) = (r.tenant_id, r.shard_key, r.id)
)
SELECT id FROM released_tasks;

-- name: expire
-- Rescue leases whose holder stopped heartbeating: back to pending, or dead when the
-- attempts are used up. Rows locked by a concurrent transaction (a worker applying an
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
    SET status = CASE WHEN q.attempts >= q.max_attempts THEN 'dead' ELSE 'pending' END,
        run_after = now(),
        finished_at = CASE WHEN q.attempts >= q.max_attempts THEN now() END,
        last_error = 'lease expired: ' || coalesce(q.lease_owner, '?')
                     || ' did not heartbeat or finish attempt ' || q.attempts
                     || ' before ' || q.locked_until,
        locked_until = NULL,
        updated_at = now()
    WHERE q.id = ANY(ARRAY(SELECT id FROM expired))
    RETURNING q.id, q.batch_id, q.status, q.tenant_id, q.shard_key
),
released AS (
    DELETE FROM agent_shard_lease s USING moved
    WHERE (s.tenant_id, s.shard_key, s.task_id) = (moved.tenant_id, moved.shard_key, moved.id)
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
-- grows with the unfinished rows, not with the batch. (MATERIALIZED: otherwise each
-- count is run once more for the done column.)
WITH c AS MATERIALIZED (SELECT
    coalesce((SELECT tasks FROM agent_batch WHERE batch_id = %(batch_id)s), 0) AS tasks,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending')   AS pending,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'leased')    AS leased,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'dead')      AS dead,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'cancelled') AS cancelled)
SELECT pending, leased, tasks - pending - leased - dead - cancelled AS done, dead, cancelled
FROM c;

-- name: batch_health
-- stuck: leased past the deadline and not rescued (should always be 0 while any
-- worker runs: worth an alert). ready: pending and due now.
SELECT
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'leased' AND locked_until < now()) AS stuck,
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
    RETURNING q.id, q.batch_id
),
uncounted AS (
    UPDATE agent_batch b SET tasks = b.tasks - d.n
    FROM (SELECT batch_id, count(*) AS n FROM deleted GROUP BY batch_id) d
    WHERE b.batch_id = d.batch_id
)
SELECT id FROM deleted;

-- name: batch_open
-- True while the batch has work that is not finished: pending (due now or later) or leased.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE batch_id = %(batch_id)s AND status = 'pending')
    OR EXISTS (SELECT 1 FROM agent_work_queue
               WHERE batch_id = %(batch_id)s AND status = 'leased') AS open;

-- ---------------------------------------------------------------------------------
-- Getting results out (jobrunner/results.py). The exports run in a transaction of
-- their own through a server-side cursor, so a million rows stream in constant memory.

-- name: export_results
-- The results of a batch's finished tasks, in task key order: the unique (batch_id,
-- task_key) index gives that order without a sort, and a cursor's plan prefers it.
-- The result comes as JSON text and finished_at as ISO 8601 text (the export sets the
-- transaction's TimeZone to UTC): the exporter writes them through without decoding.
SELECT q.task_key, q.status::text, q.result::text, q.attempts,
       to_json(q.finished_at) #>> '{}' AS finished_at
FROM agent_work_queue q
WHERE q.batch_id = %(batch_id)s AND q.status = 'done'
ORDER BY q.task_key;

-- name: export_errors
-- The tasks that ended without a result: dead (their last error) and cancelled.
SELECT q.task_key, q.status::text, q.last_error, q.attempts,
       to_json(q.finished_at) #>> '{}' AS finished_at
FROM agent_work_queue q
WHERE q.batch_id = %(batch_id)s AND q.status IN ('dead', 'cancelled')
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
