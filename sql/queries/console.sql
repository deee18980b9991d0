-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
--
-- The web console's reads and actions beyond batches and tasks (jobrunner/store/console.py,
-- docs/console.md): a batch's sample (throughput, attempts, results), pools, limits'
-- pauses, the Batch API's batches, scheduled runs. Every read of the task table goes
-- through an index and stops at a LIMIT (tests/test_console.py checks the plans).

-- name: console_batch_sample
-- Up to %(sample)s tasks of a batch in key order: status, attempts, finish time.
--
-- The batch page's throughput chart and attempts histogram: the first %(sample)s keys of
-- the batch (agent_task_key's primary key), each task read by id. The whole batch when it
-- has no more tasks than that; a sample of its first keys otherwise (the page says so).
WITH s AS MATERIALIZED (
    SELECT k.task_id FROM agent_task_key k
    WHERE k.batch_id = %(batch_id)s
    ORDER BY k.task_key
    LIMIT %(sample)s
)
SELECT q.status::text AS status, q.attempts, q.finished_at
FROM s CROSS JOIN LATERAL (
    -- (OFFSET 0 keeps this a probe of the primary key per key: flattened into a join,
    -- the planner may prefer to hash the whole task table)
    SELECT q.status, q.attempts, q.finished_at FROM agent_work_queue q
    WHERE q.id = s.task_id OFFSET 0) q;

-- name: console_batch_results
-- The first %(limit)s results of a batch's done tasks in key order (at most %(scan)s keys read).
WITH s AS MATERIALIZED (
    SELECT k.task_key, k.task_id FROM agent_task_key k
    WHERE k.batch_id = %(batch_id)s
    ORDER BY k.task_key
    LIMIT %(scan)s
)
SELECT s.task_key, left(q.result::text, %(chars)s) AS result_preview
FROM s CROSS JOIN LATERAL (
    SELECT q.status, q.result FROM agent_work_queue q  -- (a probe per key: see above)
    WHERE q.id = s.task_id OFFSET 0) q
WHERE q.status = 'done' AND q.result IS NOT NULL
ORDER BY s.task_key
LIMIT %(limit)s;

-- name: console_batch_reduce
-- A batch's reduce and generator state and the start of its reduce result.
SELECT b.reduce IS NOT NULL AS has_reduce, b.reduce_enqueued_at, b.reduced_at,
       left(b.result::text, %(chars)s) AS result_preview, b.result_bytes,
       b.generator IS NOT NULL AS has_generator, left(b.generator::text, %(chars)s) AS generator
FROM agent_batch b WHERE b.batch_id = %(batch_id)s;

-- name: console_pool_list
-- The pools: every pool with a clock, a weight or a batch (the names only).
SELECT pool FROM agent_pool
UNION SELECT pool FROM agent_pool_tenant
ORDER BY pool
LIMIT %(limit)s;

-- name: console_pool_tenants
-- A pool's tenants: weight, open batches, pending (each batch counted up to %(cap)s), leased, lease holders.
--
-- The tenants with a batch in the pool or a weight there. Pending tasks are counted per
-- batch from the pending index, up to %(cap)s each; leased ones (and the distinct workers
-- holding them) from the leased index by tenant, which holds only live leases.
WITH tenants AS (
    SELECT DISTINCT b.tenant_id FROM agent_batch b WHERE b.pool = %(pool)s
    UNION SELECT t.tenant_id FROM agent_pool_tenant t WHERE t.pool = %(pool)s
)
SELECT x.tenant_id, coalesce(w.weight, 1) AS weight, w.weight IS NOT NULL AS weight_set,
       bt.batches, bt.pending, bt.leased, bt.workers,
       u.tokens, u.cost, u.budget_tokens, u.budget_cost
FROM tenants x
LEFT JOIN agent_pool_tenant w ON w.pool = %(pool)s AND w.tenant_id = x.tenant_id
LEFT JOIN agent_pool_tenant_usage u ON u.pool = %(pool)s AND u.tenant_id = x.tenant_id
CROSS JOIN LATERAL (
    SELECT count(*) AS batches,
           coalesce(sum((SELECT count(*) FROM (SELECT 1 FROM agent_work_queue q
                                               WHERE q.batch_id = b.batch_id
                                                 AND q.status = 'pending'
                                               LIMIT %(cap)s) p)), 0) AS pending,
           coalesce(sum((SELECT count(*) FROM agent_work_queue q
                         WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
                           AND q.status = 'leased')), 0) AS leased,
           (SELECT count(DISTINCT q.lease_owner) FROM agent_work_queue q
            WHERE q.tenant_id = x.tenant_id AND q.pool = %(pool)s
              AND q.status = 'leased') AS workers
    FROM agent_batch b
    WHERE b.pool = %(pool)s AND b.tenant_id = x.tenant_id AND b.cancelled_at IS NULL
) bt
ORDER BY x.tenant_id;

-- name: limit_pause
-- Pause a limit: no claim of a task naming it until it is resumed (blocked until the far future).
--
-- A pause is a block that does not end by itself: the claim statements already skip a
-- limit whose blocked_until is in the future (sql/queries/tasks.sql), so a pause needs
-- no change of the claim path. 100 years, not 'infinity': limit_next_room and
-- limit_list take the difference with now().
UPDATE agent_limit
SET blocked_until = now() + interval '100 years', updated_at = now()
WHERE name = %(name)s
RETURNING name, blocked_until;

-- name: limit_resume
-- Resume a limit: end its pause or block now, and wake the workers that may claim again.
--
-- Workers that found only tasks of a paused limit sleep until woken (their fallback
-- poll is a minute away): the batches under flow control that have a pending task (one
-- probe of the pending index per such batch) come back, and resume_limit wakes their
-- workers and their pools' (worker_waits.everyone).
WITH resumed AS (
    UPDATE agent_limit
    SET blocked_until = NULL, updated_at = now()
    WHERE name = %(name)s
    RETURNING name
),
waiting AS MATERIALIZED (
    SELECT b.batch_id, b.pool FROM agent_batch b
    WHERE b.flow_control AND b.cancelled_at IS NULL
      AND EXISTS (SELECT 1 FROM agent_work_queue q
                  WHERE q.batch_id = b.batch_id AND q.status = 'pending')
      AND EXISTS (SELECT 1 FROM resumed)
)
SELECT r.name, (SELECT array_agg(w.batch_id) FROM waiting w) AS batch_ids
FROM resumed r;

-- name: console_api_batches
-- The Batch API's newest batches (of one tenant, or of every tenant), at most %(limit)s.
SELECT a.batch_id, a.tenant_id, a.status, a.endpoint, a.model, a.total, a.completed,
       a.failed, a.created_at, a.completed_at, a.expires_at,
       EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = a.batch_id) AS has_tasks
FROM api_batch a
WHERE %(tenant_id)s::text IS NULL OR a.tenant_id = %(tenant_id)s
ORDER BY a.created_at DESC, a.batch_id DESC
LIMIT %(limit)s;

-- name: console_api_tenants
-- The Batch API's tenants: batches by status (over api_batch, a row per API batch).
SELECT a.tenant_id, a.status, count(*) AS batches, sum(a.total) AS requests,
       max(a.created_at) AS newest
FROM api_batch a
WHERE %(tenant_id)s::text IS NULL OR a.tenant_id = %(tenant_id)s
GROUP BY a.tenant_id, a.status
ORDER BY a.tenant_id, a.status;

-- name: console_schedule_runs
-- The newest batches of BatchRuns made by a BatchRunSchedule, as their ids tell.
--
-- A scheduled BatchRun is named <schedule>-<minutes since the epoch> (or
-- <schedule>-manual-<value> when triggered), and its batch id is
-- <namespace>/<run>/<uid prefix> (jobrunner/operator/jobs.py). The schedules themselves
-- live in Kubernetes: the database only knows the runs they made. agent_batch has a row
-- per batch, not per task.
SELECT r.batch_id, r.tenant_id, r.created_at, r.cancelled_at, r.tasks,
       r.m[1] AS namespace, r.m[2] AS schedule, r.m[3] AS stamp
FROM (SELECT b.batch_id, b.tenant_id, b.created_at, b.cancelled_at, b.tasks,
             regexp_match(b.batch_id,
                          '^([^/]+)/(.+)-([0-9]{7,}|manual-[a-z0-9-]+)/[0-9a-f]{8}$') AS m
      FROM agent_batch b
      WHERE %(tenant_id)s::text IS NULL OR b.tenant_id = %(tenant_id)s) r
WHERE r.m IS NOT NULL
ORDER BY r.created_at DESC
LIMIT %(limit)s;
