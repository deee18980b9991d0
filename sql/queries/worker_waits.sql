-- Waiting workers (agent_worker_wait, migration 0030): a worker's row while it sleeps
-- with nothing to claim, and the enqueue's wake-up of as many of them as it has work for.

-- name: worker_wait_enter
-- Write (or refresh) a waiting worker's row: it is about to sleep until a note.
INSERT INTO agent_worker_wait (wait_id, batch_id, pool)
VALUES (%(wait_id)s, %(batch_id)s, %(pool)s)
ON CONFLICT (wait_id) DO UPDATE
SET batch_id = EXCLUDED.batch_id, pool = EXCLUDED.pool, seen_at = now();

-- name: worker_wait_leave
-- Delete a worker's row: it has work, or it stops.
DELETE FROM agent_worker_wait WHERE wait_id = %(wait_id)s;

-- name: worker_wait_wake
-- Take up to `count` of a batch's (or, with `pool`, a pool's) waiting workers, most
-- recently seen first, and send each a note on its own channel; the number taken (0:
-- nobody waits, wake everyone instead).
--
-- Each worker LISTENs on its own channel, jobrunner_wake_ID (worker_waits.channel), so
-- only the named workers' connections receive anything: PostgreSQL (up to 18) signals
-- every listening backend of the database on a notifying commit, but a backend passes
-- on only the notes of channels its session listens to, so the rest of the fleet's
-- clients are not woken at all. jobrunner_wake (payload: the target) tells the batch's
-- watchers (the console) that it got work; no worker listens to it.
--
-- SKIP LOCKED: two concurrent enqueues take different workers. The rows stay locked
-- until the enqueue commits, which is when the notes are delivered. (One CTE per kind
-- of target, each the backward scan of its partial index: FOR UPDATE is not allowed
-- under a UNION.)
WITH of_batch AS (
    SELECT x.wait_id FROM agent_worker_wait x
    WHERE %(pool)s::text IS NULL AND x.batch_id = %(batch_id)s
    ORDER BY x.seen_at DESC LIMIT %(count)s FOR UPDATE SKIP LOCKED
),
of_pool AS (
    SELECT x.wait_id FROM agent_worker_wait x WHERE x.pool = %(pool)s
    ORDER BY x.seen_at DESC LIMIT %(count)s FOR UPDATE SKIP LOCKED
),
woken AS (
    DELETE FROM agent_worker_wait w
    WHERE w.wait_id IN (SELECT wait_id FROM of_batch UNION ALL SELECT wait_id FROM of_pool)
    RETURNING w.wait_id
),
target AS (SELECT CASE WHEN %(pool)s::text IS NULL THEN 'batch ' || %(batch_id)s
                       ELSE 'pool ' || %(pool)s END AS name)
SELECT count(pg_notify('jobrunner_wake_' || woken.wait_id, target.name)) AS woken,
       count(pg_notify('jobrunner_wake', target.name)) AS watched
FROM woken, target;

-- name: worker_wait_sweep
-- Delete the rows of workers not seen for ten minutes (dead without leaving; a live
-- waiting worker refreshes its row on every fallback look, about once a minute).
DELETE FROM agent_worker_wait WHERE seen_at < now() - interval '10 minutes';
