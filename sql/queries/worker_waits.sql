-- Waiting workers (agent_worker_wait, migration 0030): a worker's row while it sleeps
-- with nothing to claim, and the enqueue's wake-up of as many of them as it has work for.

-- name: worker_wait_enter
-- Write (or refresh) a waiting worker's row: it is about to sleep until rung. `pid`: its
-- process's notifier session, which a ring cancels while it sleeps (migration 0031).
INSERT INTO agent_worker_wait (wait_id, batch_id, pool, pid)
VALUES (%(wait_id)s, %(batch_id)s, %(pool)s, %(pid)s)
ON CONFLICT (wait_id) DO UPDATE
SET batch_id = EXCLUDED.batch_id, pool = EXCLUDED.pool, pid = EXCLUDED.pid,
    seen_at = now();

-- name: worker_wait_leave
-- Delete a worker's row: it has work, or it stops.
DELETE FROM agent_worker_wait WHERE wait_id = %(wait_id)s;

-- name: worker_wait_wake
-- Take up to `count` of a batch's (or, with `pool`, a pool's) waiting workers, most
-- recently seen first, and ring each (agent_worker_wait_ring); the number taken (0:
-- nobody waits, wake everyone instead: worker_wait_everyone).
--
-- A ring cancels the sleeping statement of the worker's notifier session (it LISTENs to
-- nothing while it sleeps, so no other backend is signalled), or, for a notifier still
-- LISTENing, sends a note on the worker's own channel, jobrunner_wake_ID
-- (worker_waits.channel). Either way only the named workers wake; the woken worker waits
-- for this transaction's commit before it claims (migration 0031 has the protocol).
-- jobrunner_wake (payload: the target) tells the batch's watchers (the console) that it
-- got work; no worker listens to it.
--
-- SKIP LOCKED: two concurrent enqueues take different workers. (One CTE per kind of
-- target, each the backward scan of its partial index: FOR UPDATE is not allowed under a
-- UNION.)
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
    RETURNING w.wait_id, w.pid
),
target AS (SELECT CASE WHEN %(pool)s::text IS NULL THEN 'batch ' || %(batch_id)s
                       ELSE 'pool ' || %(pool)s END AS name)
SELECT agent_worker_wait_ring(array_agg(woken.wait_id), array_agg(woken.pid),
                              min(target.name)) AS woken,
       count(pg_notify('jobrunner_wake', target.name)) AS watched
FROM woken, target;

-- name: worker_wait_everyone
-- Wake every worker of these batches (with `with_pools`, of their pools too) and pools:
-- work came back that no enqueue announced (expired leases, released or requeued tasks,
-- a resumed limit), or an enqueue had more tasks than worker_waits.MOST names, or nobody
-- to name. The note to every LISTENing worker (jobrunner_queue: payload the batch;
-- jobrunner_pool: the pool), and every waiting row of them taken and rung (a sleeping
-- notifier is no listener: agent_worker_wait_ring). SKIP LOCKED: a row another
-- transaction holds is being rung by it.
WITH targets AS (
    SELECT 'batch' AS kind, b AS name FROM unnest(%(batch_ids)s::text[]) b
    UNION
    SELECT 'pool', p FROM unnest(%(pools)s::text[]) p
    UNION
    SELECT 'pool', b.pool FROM agent_batch b
    WHERE %(with_pools)s AND b.batch_id = ANY(%(batch_ids)s::text[]) AND b.pool IS NOT NULL
),
noted AS (
    SELECT count(pg_notify(CASE t.kind WHEN 'batch' THEN 'jobrunner_queue'
                                       ELSE 'jobrunner_pool' END, t.name)) AS n
    FROM targets t
),
taken AS (
    SELECT w.wait_id FROM agent_worker_wait w
    WHERE w.batch_id IN (SELECT t.name FROM targets t WHERE t.kind = 'batch')
       OR w.pool IN (SELECT t.name FROM targets t WHERE t.kind = 'pool')
    FOR UPDATE SKIP LOCKED
),
woken AS (
    DELETE FROM agent_worker_wait w WHERE w.wait_id IN (SELECT wait_id FROM taken)
    RETURNING w.wait_id, w.pid,
              CASE WHEN w.pool IS NULL THEN 'batch ' || w.batch_id
                   ELSE 'pool ' || w.pool END AS target
)
SELECT (SELECT n FROM noted) AS noted,
       coalesce((SELECT sum(agent_worker_wait_ring(g.ids, g.pids, g.target))
                 FROM (SELECT target, array_agg(wait_id) AS ids, array_agg(pid) AS pids
                       FROM woken GROUP BY target) g), 0) AS woken;

-- name: worker_wait_sleep
-- A notifier's sleep on its waiting workers' rows (agent_worker_wait_sleep): the ids of
-- those taken, at once or when rung; none after `seconds`. With `lead`, the leadership
-- try first: `leader`.
SELECT s.gone, s.leader
FROM agent_worker_wait_sleep(%(ids)s::bigint[], %(seconds)s::float8, %(lead)s) s;

-- name: worker_wait_can_ring
-- Whether a ring can cancel this session's sleep (else its notifier LISTENs, as before).
SELECT agent_worker_wait_can_ring() AS can_ring;

-- name: worker_wait_sweep
-- Delete the rows of workers not seen for ten minutes (dead without leaving; a live
-- waiting worker refreshes its row on every fallback look, about once a minute).
DELETE FROM agent_worker_wait WHERE seen_at < now() - interval '10 minutes';
