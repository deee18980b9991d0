-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- Batches (agent_batch): creation, cancellation, status.

-- name: batch_ensure
-- Record a batch (idempotent) and lock its row; returns its tenant, cancellation, pool and priority.
--
-- Records the batch (idempotent). Returns the tenant it was first created with.
INSERT INTO agent_batch (batch_id, tenant_id) VALUES (%(batch_id)s, %(tenant_id)s)
ON CONFLICT (batch_id) DO UPDATE SET batch_id = EXCLUDED.batch_id
RETURNING tenant_id, cancelled_at, pool, priority;

-- name: batch_cancel
-- Cancel a batch: its pending tasks become cancelled, its leases finish or end cancelled.
WITH batch AS (
    UPDATE agent_batch SET cancelled_at = coalesce(cancelled_at, now())
    WHERE batch_id = %(batch_id)s
)
UPDATE agent_work_queue
SET status = 'cancelled', finished_at = now(), updated_at = now()
WHERE batch_id = %(batch_id)s AND status = 'pending';

-- name: batch_get
-- A batch's row, or none.
SELECT batch_id, tenant_id, created_at, cancelled_at, pool FROM agent_batch WHERE batch_id = %(batch_id)s;

-- name: batch_counts
-- A batch's task counts by status, from the unfinished rows and its task count.
--
-- Each unfinished status from the small index that holds only that status, done as the
-- rest of the batch's task count, all in one snapshot (sql/schema.sql): the cost
-- grows with the unfinished rows, not with the batch. The reduce and generator tasks are
-- found by key (agent_task_key, sql/schema.sql). (MATERIALIZED: otherwise each
-- count is run once more for the done column.) The reduce task (sql/schema.sql) and the
-- generator task (0012) are not tasks of the batch: they are not in `tasks`, and are
-- taken out of its status here.
WITH c AS MATERIALIZED (SELECT
    coalesce((SELECT tasks FROM agent_batch WHERE batch_id = %(batch_id)s), 0) AS tasks,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending')   AS pending,
    (SELECT count(*) FROM agent_work_queue  -- (the tenant leads the index)
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
-- A batch's stuck and ready counts and its pending tasks' ages.
--
-- stuck: leased past the deadline and not rescued (should always be 0 while any
-- worker runs: worth an alert). ready: pending and due now.
SELECT
    (SELECT count(*) FROM agent_work_queue  -- (the tenant leads the index)
      WHERE tenant_id = (SELECT b.tenant_id FROM agent_batch b WHERE b.batch_id = %(batch_id)s)
        AND batch_id = %(batch_id)s AND status = 'leased' AND locked_until < now()) AS stuck,
    (SELECT count(*) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending' AND run_after <= now()) AS ready,
    (SELECT extract(epoch FROM now() - min(created_at)) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending') AS oldest_pending_seconds,
    (SELECT extract(epoch FROM min(run_after) - now()) FROM agent_work_queue
      WHERE batch_id = %(batch_id)s AND status = 'pending') AS next_run_in_seconds;

-- name: batch_flow_control
-- Whether a batch is under flow control (claimed with task_ack_and_claim_limited).
--
-- Whether a batch is under flow control (its claims must use ack_and_claim_limited).
SELECT coalesce((SELECT flow_control FROM agent_batch WHERE batch_id = %(batch_id)s),
                false) AS flow;

-- name: batch_open
-- Whether a batch has pending or leased tasks.
--
-- True while the batch has work that is not finished: pending (due now or later) or leased.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE batch_id = %(batch_id)s AND status = 'pending')
    OR EXISTS (SELECT 1 FROM agent_work_queue  -- (the tenant leads the index)
               WHERE tenant_id = (SELECT b.tenant_id FROM agent_batch b WHERE b.batch_id = %(batch_id)s)
                 AND batch_id = %(batch_id)s AND status = 'leased') AS open;

-- ---------------------------------------------------------------------------------
-- The web console's reads of batches (jobrunner/server/console/, docs/console.md). Every
-- count is bounded: the unfinished and failed statuses are counted from their small
-- partial indexes, each up to %(cap)s rows, and done is the rest of the batch's task
-- counter (agent_batch.tasks). A count that reaches the cap is shown as "at least", and
-- done then as "at most": never a count(*) over the batch, whatever its size.

-- fragment: batch_bounded_counts
-- One open or finished batch `b`'s counts, each an index scan of at most %(cap)s entries;
-- `special`: the statuses of its reduce and generator tasks (not tasks of the batch: the
-- caller takes them out of the counts, as batch_counts does).
    (SELECT count(*) FROM (SELECT 1 FROM agent_work_queue q
      WHERE q.batch_id = b.batch_id AND q.status = 'pending' LIMIT %(cap)s) x) AS pending,
    (SELECT count(*) FROM agent_work_queue q  -- (the tenant leads the leased index)
      WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
        AND q.status = 'leased') AS leased,
    (SELECT count(*) FROM agent_work_queue q
      WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
        AND q.status = 'leased' AND q.locked_until < now()) AS stuck,
    (SELECT count(*) FROM (SELECT 1 FROM agent_work_queue q
      WHERE q.batch_id = b.batch_id AND q.status = 'dead' LIMIT %(cap)s) x) AS dead,
    (SELECT count(*) FROM (SELECT 1 FROM agent_work_queue q
      WHERE q.batch_id = b.batch_id AND q.status = 'cancelled' LIMIT %(cap)s) x) AS cancelled,
    -- how long the most overdue ready task has waited: one probe of the pending index
    (SELECT extract(epoch FROM now() - q.run_after)::float8 FROM agent_work_queue q
      WHERE q.batch_id = b.batch_id AND q.status = 'pending' AND q.run_after <= now()
      ORDER BY q.run_after LIMIT 1) AS waiting_seconds,
    ARRAY(SELECT q.status::text FROM agent_task_key k JOIN agent_work_queue q ON q.id = k.task_id
          WHERE k.batch_id = b.batch_id AND k.task_key IN ('__reduce__', '__generate__'))
        AS special

-- name: batch_list_open
-- The batches with pending or leased tasks (one tenant's, or all), a page of them with bounded counts and usage.
--
-- The open batches are found without reading their tasks: a loose index scan of the
-- pending index (one probe per batch that has pending tasks: the next batch id after the
-- last one found) and the leased index, which holds only live leases. Then only the
-- page's batches are counted.
WITH RECURSIVE pending_batch AS (
    (SELECT q.batch_id FROM agent_work_queue q WHERE q.status = 'pending'
     ORDER BY q.batch_id LIMIT 1)
    UNION ALL
    SELECT (SELECT q.batch_id FROM agent_work_queue q
            WHERE q.status = 'pending' AND q.batch_id > p.batch_id
            ORDER BY q.batch_id LIMIT 1)
    FROM pending_batch p WHERE p.batch_id IS NOT NULL
),
open_batch AS (
    SELECT batch_id FROM pending_batch WHERE batch_id IS NOT NULL
    UNION
    SELECT q.batch_id FROM agent_work_queue q WHERE q.status = 'leased'
),
page AS MATERIALIZED (
    SELECT b.batch_id, b.tenant_id, b.pool, b.created_at, b.cancelled_at, b.tasks
    FROM open_batch o JOIN agent_batch b ON b.batch_id = o.batch_id
    WHERE %(tenant_id)s::text IS NULL OR b.tenant_id = %(tenant_id)s
    ORDER BY b.tenant_id, b.pool NULLS FIRST, b.created_at, b.batch_id
    LIMIT %(limit)s
)
SELECT b.batch_id, b.tenant_id, b.pool, b.created_at, b.cancelled_at, b.tasks,
       u.tokens, u.cost, u.budget_tokens, u.budget_cost, c.*
FROM page b
LEFT JOIN agent_batch_usage u ON u.batch_id = b.batch_id
CROSS JOIN LATERAL (SELECT
-- include: batch_bounded_counts
) c
ORDER BY b.tenant_id, b.pool NULLS FIRST, b.created_at, b.batch_id;

-- name: batch_summary
-- One batch (of the tenant, or of any with tenant NULL) with bounded counts and usage, open or not.
SELECT b.batch_id, b.tenant_id, b.pool, b.created_at, b.cancelled_at, b.tasks, b.handler,
       b.reduced_at, u.tokens, u.cost, u.budget_tokens, u.budget_cost, c.*
FROM agent_batch b
LEFT JOIN agent_batch_usage u ON u.batch_id = b.batch_id
CROSS JOIN LATERAL (SELECT
-- include: batch_bounded_counts
) c
WHERE b.batch_id = %(batch_id)s
  AND (%(tenant_id)s::text IS NULL OR b.tenant_id = %(tenant_id)s);

-- name: batch_reduce_due
-- The batches whose reduce step may still have to be enqueued, in every pool or none.
--
-- The maintenance leader runs the reduce trigger for each (few rows: batches with a
-- reduce step whose reduce was not enqueued yet and which were not cancelled).
SELECT batch_id FROM agent_batch
WHERE reduce IS NOT NULL AND reduce_enqueued_at IS NULL AND cancelled_at IS NULL
ORDER BY batch_id;
