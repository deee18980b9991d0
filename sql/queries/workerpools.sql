-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- Worker pools (agent_pool_*; docs/pools.md) and a batch's handler.

-- ---------------------------------------------------------------------------------
-- Worker pools (jobrunner/store/workerpools.py, docs/pools.md, sql/schema.sql): a pool's workers
-- claim across every open batch of the pool, in the order of the tasks' virtual-time
-- tags laid at enqueue (fair share by tenant weight, batch priority as a weight
-- multiplier). A pool with a pending task of a batch under flow control (limits, a
-- budget) is claimed with task_ack_and_claim_pool_limited (pool_flow_control says when).

-- name: pool_batch_ensure
-- batch_ensure for a batch enqueued into a worker pool (sets pool and priority).
--
-- ensure_batch for a batch enqueued into a pool: the pool and priority are set at the
-- batch's first enqueue (the caller refuses a later enqueue that names others).
INSERT INTO agent_batch (batch_id, tenant_id, pool, priority)
VALUES (%(batch_id)s, %(tenant_id)s, %(pool)s, %(priority)s)
ON CONFLICT (batch_id) DO UPDATE SET batch_id = EXCLUDED.batch_id
RETURNING tenant_id, cancelled_at, pool, priority;

-- name: pool_enqueue_start
-- Lock the pool's tenant row and return where the batch's new tags start.
SELECT vstart, vstride, relay
FROM jobrunner_pool_start(%(pool)s, %(tenant_id)s, %(priority)s, %(batch_id)s);

-- name: pool_insert_staged
-- Insert the staged tasks of a pool batch with their fair-share tags.
--
-- enqueue_from_stage for a pool: each new task gets its tag, vstride apart from vstart in
-- task key order (rows whose key exists keep theirs), and the stream's last tag moves to
-- the last one laid.
WITH inserted AS (
    INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload, max_attempts,
                                  limits, tokens, pool, vtag, trace_context)
    SELECT %(batch_id)s, %(tenant_id)s, s.task_key, s.shard_key, s.payload, s.max_attempts,
           s.limits, s.tokens, %(pool)s,
           %(vstart)s::float8 + (row_number() OVER (ORDER BY s.task_key)) * %(vstride)s::float8,
           %(trace_context)s::jsonb
    FROM jobrunner_enqueue_stage s
    ORDER BY s.task_key
    RETURNING vtag
),
counted AS (
    SELECT count(*) AS new, max(vtag) AS last FROM inserted
),
batch_tasks AS (
    -- (flow_control as in task_insert_staged: the pool's workers then claim with
    -- task_ack_and_claim_pool_limited, see pool_flow_control)
    UPDATE agent_batch
    SET tasks = tasks + (SELECT new FROM counted),
        flow_control = flow_control
                       OR EXISTS (SELECT 1 FROM jobrunner_enqueue_stage WHERE limits IS NOT NULL)
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
-- Advance the tenant's virtual time in the pool past the tags just laid.
SELECT jobrunner_pool_relay(%(pool)s, %(tenant_id)s, %(priority)s, %(vstart)s,
                            %(vstride)s) AS last;

-- name: pool_set_weight
-- Set a tenant's weight in a pool.
SELECT jobrunner_pool_set_weight(%(pool)s, %(tenant_id)s, %(weight)s) AS streams;

-- name: pool_of_batch
-- The pool and priority of a batch.
SELECT pool FROM agent_batch WHERE batch_id = %(batch_id)s;

-- name: pool_flow_control
-- Whether a pool has a pending task of a batch under flow control (limits or a budget).
--
-- Read by a pool worker on its first claim and then once a second: while it is true the
-- worker claims with task_ack_and_claim_pool_limited. Unlike a batch's flag it goes back
-- to false once those batches have nothing pending (a pool lives on, its batches end), so
-- the pool's claims stop paying for limits. A batch is under flow control when its
-- flag says so or its tenant has a budget in the pool (agent_pool_tenant_usage). A
-- batch's row, then one probe of its pending tasks, for those batches only.
SELECT EXISTS (SELECT 1 FROM agent_batch b
               WHERE b.pool = %(pool)s AND b.cancelled_at IS NULL
                 AND (b.flow_control
                      OR EXISTS (SELECT 1 FROM agent_pool_tenant_usage t
                                 WHERE t.pool = b.pool AND t.tenant_id = b.tenant_id
                                   AND (t.budget_tokens IS NOT NULL
                                        OR t.budget_cost IS NOT NULL)))
                 AND EXISTS (SELECT 1 FROM agent_work_queue q
                             WHERE q.batch_id = b.batch_id AND q.status = 'pending'))
       AS flow;

-- name: pool_open
-- Whether a pool has pending tasks or leased tasks in its batches.
--
-- A pool worker's drain check: the pool has a pending task (due now or later), or a
-- leased task in one of its batches.
SELECT EXISTS (SELECT 1 FROM agent_work_queue
               WHERE pool = %(pool)s AND status = 'pending')
    -- (per batch, through its tenant, which leads the index; LATERAL with LIMIT, so that the
    -- index of leased rows is probed by tenant and not scanned whole per batch)
    OR EXISTS (SELECT 1 FROM agent_batch b,
               LATERAL (SELECT 1 FROM agent_work_queue q
                        WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
                          AND q.status = 'leased' LIMIT 1) l
               WHERE b.pool = %(pool)s) AS open;

-- name: pool_work
-- A pool's queue depth for scaling: pending due tasks and leased ones (capped).
--
-- A WorkerPool's queue depth for its scaling timer (jobrunner/operator/workerpool.py): tasks
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
-- The pool's settled batches whose reduce step is not enqueued yet.
--
-- The pool's batches whose reduce step may still have to be enqueued (few rows): the
-- pool worker's maintenance tick and drain check run the reduce trigger for each.
SELECT batch_id FROM agent_batch
WHERE pool = %(pool)s AND reduce IS NOT NULL AND reduce_enqueued_at IS NULL
  AND cancelled_at IS NULL
ORDER BY batch_id;

-- name: pool_show
-- A pool's tenants with their weights and virtual times.
--
-- A pool's tenants: weight, streams' last tags, and their pending and leased tasks.
SELECT b.tenant_id, coalesce(t.weight, 1) AS weight,
       count(DISTINCT b.batch_id) AS batches,
       sum((SELECT count(*) FROM agent_work_queue q
            WHERE q.batch_id = b.batch_id AND q.status = 'pending')) AS pending,
       sum((SELECT count(*) FROM agent_work_queue q  -- (the tenant leads the index)
            WHERE q.tenant_id = b.tenant_id AND q.batch_id = b.batch_id
              AND q.status = 'leased')) AS leased
FROM agent_batch b
LEFT JOIN agent_pool_tenant t ON t.pool = b.pool AND t.tenant_id = b.tenant_id
WHERE b.pool = %(pool)s
GROUP BY b.tenant_id, t.weight
ORDER BY b.tenant_id;

-- name: batch_handler_set
-- Record the handler a batch's tasks run with (set once).
--
-- A pool batch's handler, set by its first enqueue that names one (pool_handlers.py);
-- returns the handler it has, so a different one is refused.
UPDATE agent_batch SET handler = coalesce(handler, %(handler)s)
WHERE batch_id = %(batch_id)s
RETURNING handler;

-- name: batch_handler_get
-- The handler a batch's tasks run with.
--
-- The handler a pool worker runs a batch's tasks with (cached per batch by the worker).
SELECT handler FROM agent_batch WHERE batch_id = %(batch_id)s;
