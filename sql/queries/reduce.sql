-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- A batch's reduce step (docs/results.md).

-- ---------------------------------------------------------------------------------
-- Reduce (jobrunner/features/reduce.py, docs/results.md): one task per batch, key '__reduce__',
-- inserted only once every other task of the batch is terminal. Completion is decided
-- from the rows (jobrunner_batch_settled, sql/schema.sql), never from a counter; the
-- insert is idempotent on (batch_id, task_key) and marked on the batch in the same
-- statement, so any number of callers, at any time, enqueue it at most once.

-- name: reduce_set
-- Give a batch its reduce step (no write when unchanged).
--
-- The batch's reduce step (in the enqueue's transaction, or by the operator for a batch
-- enqueued elsewhere). Unchanged: no write.
UPDATE agent_batch SET reduce = %(reduce)s::jsonb
WHERE batch_id = %(batch_id)s AND reduce IS DISTINCT FROM %(reduce)s::jsonb;

-- name: reduce_enqueued
-- Whether a batch's reduce task was enqueued.
--
-- Inside an enqueue, after ensure_batch locked the batch: whether its reduce was
-- enqueued already (then new tasks would never be reduced: the enqueue is refused).
SELECT reduce_enqueued_at IS NOT NULL AS enqueued FROM agent_batch
WHERE batch_id = %(batch_id)s;

-- name: reduce_state
-- A batch's reduce spec, whether it is settled, and its reduce task's state.
--
-- Lock-free: the batch's reduce step, its task (if any) and whether it is due now (the
-- pre-check every caller runs before taking the batch's lock in reduce_lock_batch).
SELECT b.reduce, b.tenant_id, b.cancelled_at IS NOT NULL AS cancelled, b.reduce_enqueued_at,
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
-- Lock a batch's row before enqueueing its reduce task.
--
-- The trigger's first statement: lock the batch row until commit. Enqueue (ensure_batch)
-- and cancel_batch write that row, so they wait for the trigger's commit, or it waits for
-- theirs; reduce_enqueue then reads in a new snapshot (READ COMMITTED), in which every
-- enqueue or cancel that committed before the lock is visible.
SELECT batch_id FROM agent_batch WHERE batch_id = %(batch_id)s FOR NO KEY UPDATE;

-- name: reduce_enqueue
-- Enqueue a settled batch's reduce task, at most once.
--
-- The trigger: insert the reduce task if the batch has a reduce, is not cancelled, was
-- never reduced, and every other task is terminal (with onDead fail: none dead). Returns
-- the new task's id, or nothing. trace_context: the trigger's PRODUCER span (NULL when
-- tracing is off), which the reduce's attempts link to.
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
                                  vtag, trace_context)
    SELECT batch_id, tenant_id, '__reduce__', jsonb_build_object('reduce', reduce),
           coalesce((reduce->>'maxAttempts')::int, 8), pool,
           CASE WHEN pool IS NOT NULL THEN jobrunner_pool_now(pool) END,
           %(trace_context)s::jsonb
    FROM due  -- (a '__reduce__' key that exists: no row, as for every keyed insert)
    RETURNING id
)
SELECT id FROM inserted;

-- name: reduce_inputs
-- The results a batch's reduce step reads, in task key order.
--
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
-- Store a batch's reduced result (through the effects ledger's transaction).
--
-- Inside the reduce task's effect transaction (fenced on its lease, recorded in the
-- ledger): the batch's result, written at most once.
UPDATE agent_batch
SET result = %(result)s::jsonb, result_bytes = %(bytes)s, reduced_at = now()
WHERE batch_id = %(batch_id)s;

-- name: reduce_result
-- A batch's reduced result, when it is at most max_bytes.
--
-- The batch's result as JSON text: whole, or only when it is at most max_bytes (NULL:
-- any size), so that a status refresh never reads a large one.
SELECT reduced_at, result_bytes,
       CASE WHEN %(max_bytes)s::bigint IS NULL OR result_bytes <= %(max_bytes)s::bigint
            THEN result::text END AS result
FROM agent_batch WHERE batch_id = %(batch_id)s;
