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

-- name: batch_notify
-- Wake the workers listening for new work of any batch.
SELECT pg_notify('jobrunner_queue', %(batch_id)s);

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
SELECT batch_id, tenant_id, created_at, cancelled_at FROM agent_batch WHERE batch_id = %(batch_id)s;

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
