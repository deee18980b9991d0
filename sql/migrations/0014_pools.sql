-- Worker pools (issue 18; docs/pools.md): workers that claim across every open batch of a
-- pool, fair across tenants by weight, batches of one tenant sharing its part, a batch
-- priority that multiplies its weight.
--
-- The schedule is a virtual-time tag on each task, laid at enqueue (start-time fair
-- queuing): a stream (pool, tenant, priority) of weight w = tenant weight * 10^priority
-- lays its tasks 1/w apart from the pool's virtual time now (the smallest tag of a due
-- pending task of the pool). The claim takes the pool's pending tasks in tag order, so
-- it writes nothing but the tasks it claims (no counter row that every claim updates),
-- and concurrent claimers take consecutive tags with SKIP LOCKED.
--
-- agent_batch.pool, priority  set at the batch's first enqueue, never changed
-- agent_work_queue.pool       the batch's pool on each task (the claim's index leads with it)
-- agent_work_queue.vtag       the task's tag (NULL outside pools)
-- agent_pool                  one row per pool: a lock that orders the pool's enqueues,
--                             and the largest tag laid (the virtual time when nothing is
--                             pending)
-- agent_pool_tenant           a tenant's weight in a pool (no row: 1)
-- agent_pool_stream           per (pool, tenant, priority): the last tag laid
ALTER TABLE agent_batch
    ADD COLUMN pool     text,
    ADD COLUMN priority int NOT NULL DEFAULT 0 CHECK (priority BETWEEN -3 AND 3);
CREATE INDEX agent_batch_pool_idx ON agent_batch (pool, tenant_id, priority)
    WHERE pool IS NOT NULL;

ALTER TABLE agent_work_queue
    ADD COLUMN pool text,
    ADD COLUMN vtag float8;
-- (retention --archive copies rows with SELECT q.*: same columns, same order)
ALTER TABLE agent_work_queue_archive
    ADD COLUMN pool text,
    ADD COLUMN vtag float8;

-- The pool claim's index: pending tasks of a pool in tag order. Tasks outside pools
-- (pool NULL) never enter it.
CREATE INDEX agent_work_queue_pool_pending_idx ON agent_work_queue (pool, vtag, id)
    WHERE status = 'pending' AND pool IS NOT NULL;

CREATE TABLE agent_pool (
    pool       text PRIMARY KEY,
    vclock     float8      NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE agent_pool_tenant (
    pool       text        NOT NULL,
    tenant_id  text        NOT NULL,
    -- (bounded so that a stream's tag spacing, 1/(weight * 10^priority), stays within
    -- 10^-6..10^6: float8 tags keep that spacing exact far past any pool's lifetime)
    weight     float8      NOT NULL DEFAULT 1 CHECK (weight >= 0.001 AND weight <= 1000),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, tenant_id)
);

CREATE TABLE agent_pool_stream (
    pool      text   NOT NULL,
    tenant_id text   NOT NULL,
    priority  int    NOT NULL,
    last_tag  float8 NOT NULL,
    PRIMARY KEY (pool, tenant_id, priority)
);

-- The pool's virtual time now: the smallest tag of a pending task that is due (a task
-- waiting out a retry backoff must not hold it back), else the largest tag ever laid
-- (every task was served).
CREATE FUNCTION jobrunner_pool_now(p_pool text) RETURNS float8
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT q.vtag FROM agent_work_queue q
         WHERE q.pool = p_pool AND q.status = 'pending' AND q.run_after <= now()
         ORDER BY q.vtag, q.id LIMIT 1),
        (SELECT p.vclock FROM agent_pool p WHERE p.pool = p_pool),
        0)
$$;

-- A stream's tag spacing: 1 / (tenant weight * 10^priority).
CREATE FUNCTION jobrunner_pool_stride(p_pool text, p_tenant text, p_priority int)
RETURNS float8 LANGUAGE sql STABLE AS $$
    SELECT 1.0 / (coalesce((SELECT t.weight FROM agent_pool_tenant t
                            WHERE t.pool = p_pool AND t.tenant_id = p_tenant), 1)
                  * power(10.0, p_priority))::float8
$$;

-- Re-lay a stream's pending tasks from p_start, p_stride apart: its open batches
-- round-robin (the k-th pending task of each batch, in tag then id order, before any
-- k+1-th; batches in creation order), so the batches of one tenant share its part and a
-- batch that ends hands its share to the others with no further write. Run when a batch
-- joins a stream that has pending tasks of other batches, and when the tenant's weight
-- changes. Rows a claim holds are waited for and then skipped if no longer pending
-- (claims never wait for a row, so no cycle of waits). Returns the last tag laid.
CREATE FUNCTION jobrunner_pool_relay(p_pool text, p_tenant text, p_priority int,
                                     p_start float8, p_stride float8)
RETURNS float8 LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n bigint;
    last float8;
BEGIN
    WITH pending AS (
        SELECT q.id,
               row_number() OVER (PARTITION BY q.batch_id ORDER BY q.vtag, q.id) AS k,
               b.created_at, b.batch_id
        FROM agent_batch b
        JOIN agent_work_queue q ON q.batch_id = b.batch_id AND q.status = 'pending'
        WHERE b.pool = p_pool AND b.tenant_id = p_tenant AND b.priority = p_priority
          AND b.cancelled_at IS NULL
    ),
    ranked AS (
        SELECT id, row_number() OVER (ORDER BY k, created_at, batch_id) AS j FROM pending
    )
    -- (the first at p_start: the stream's next task keeps its turn)
    UPDATE agent_work_queue q SET vtag = p_start + (r.j - 1) * p_stride
    FROM ranked r
    WHERE q.id = r.id AND q.status = 'pending';
    GET DIAGNOSTICS n = ROW_COUNT;
    last := p_start + greatest(n - 1, 0) * p_stride;
    INSERT INTO agent_pool_stream AS s (pool, tenant_id, priority, last_tag)
    VALUES (p_pool, p_tenant, p_priority, last)
    ON CONFLICT (pool, tenant_id, priority) DO UPDATE SET last_tag = EXCLUDED.last_tag;
    UPDATE agent_pool SET vclock = greatest(vclock, last) WHERE pool = p_pool;
    RETURN last;
END
$$;

-- Inside an enqueue into a pool, before the tasks are inserted: lock the pool's row (the
-- pool's enqueues and weight changes are laid one at a time), and say where the new
-- tasks' tags start and how far apart they go; relay: the batch joins a stream whose
-- other batches have pending tasks (then jobrunner_pool_relay runs after the insert).
CREATE FUNCTION jobrunner_pool_start(p_pool text, p_tenant text, p_priority int,
                                     p_batch text,
                                     OUT vstart float8, OUT vstride float8, OUT relay boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v float8;
    last float8;
BEGIN
    INSERT INTO agent_pool (pool) VALUES (p_pool) ON CONFLICT (pool) DO NOTHING;
    PERFORM 1 FROM agent_pool WHERE pool = p_pool FOR UPDATE;
    v := jobrunner_pool_now(p_pool);
    vstride := jobrunner_pool_stride(p_pool, p_tenant, p_priority);
    relay := NOT EXISTS (SELECT 1 FROM agent_work_queue q
                         WHERE q.batch_id = p_batch AND q.status = 'pending')
             AND EXISTS (SELECT 1 FROM agent_batch b
                         WHERE b.pool = p_pool AND b.tenant_id = p_tenant
                           AND b.priority = p_priority AND b.batch_id <> p_batch
                           AND b.cancelled_at IS NULL
                           AND EXISTS (SELECT 1 FROM agent_work_queue q
                                       WHERE q.batch_id = b.batch_id AND q.status = 'pending'));
    IF relay THEN
        vstart := v;
    ELSE
        SELECT s.last_tag INTO last FROM agent_pool_stream s
        WHERE s.pool = p_pool AND s.tenant_id = p_tenant AND s.priority = p_priority;
        -- an idle stream starts at the pool's time now: it banks no credit while idle
        vstart := greatest(v, coalesce(last, v));
    END IF;
END
$$;

-- Set a tenant's weight in a pool and re-lay its pending tasks (each stream from the
-- pool's time now) so the new weight holds from the next claim on.
CREATE FUNCTION jobrunner_pool_set_weight(p_pool text, p_tenant text, p_weight float8)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v float8;
    p int;
    streams bigint := 0;
BEGIN
    INSERT INTO agent_pool (pool) VALUES (p_pool) ON CONFLICT (pool) DO NOTHING;
    PERFORM 1 FROM agent_pool WHERE pool = p_pool FOR UPDATE;
    INSERT INTO agent_pool_tenant AS t (pool, tenant_id, weight)
    VALUES (p_pool, p_tenant, p_weight)
    ON CONFLICT (pool, tenant_id) DO UPDATE SET weight = EXCLUDED.weight, updated_at = now();
    v := jobrunner_pool_now(p_pool);
    FOR p IN SELECT DISTINCT b.priority FROM agent_batch b
             WHERE b.pool = p_pool AND b.tenant_id = p_tenant AND b.cancelled_at IS NULL
             ORDER BY 1
    LOOP
        PERFORM jobrunner_pool_relay(p_pool, p_tenant, p, v,
                                     jobrunner_pool_stride(p_pool, p_tenant, p));
        streams := streams + 1;
    END LOOP;
    RETURN streams;
END
$$;
