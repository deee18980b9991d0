-- One index over the leased rows instead of two (issue 18, item 5: less WAL per task).
--
-- A claim moves its task to 'leased', a non-HOT update (status is in the partial indexes'
-- predicates), and the new version entered every index whose predicate it matched: the
-- primary key, agent_work_queue_leased_idx (batch_id, locked_until) and, for a task with a
-- shard key, agent_work_queue_shard_leased_uidx (tenant_id, shard_key). pg_waldump over the
-- one-client loop (docs/pools.md) put the leased index's entry at 72 B of a task's WAL,
-- the shard index's at 64 B. Both indexes hold the same rows (the leased ones), so one
-- does: a UNIQUE index on (tenant_id, shard_key) over every leased row. Rows without a
-- shard key enter it too: NULLs are distinct in a unique index, so they never conflict
-- and are never checked. Shard exclusion is unchanged (same key, same uniqueness over
-- the rows that have a shard key); a sharded task's claim writes one leased entry
-- instead of two; a task without a shard key writes one, as before.
--
-- Who read the leased index: everything that asks for a batch's leased rows (status
-- counts, batch_health, batch_open, the pool's drain check, depth and show, settled
-- below) now names the batch's tenant as well (agent_batch.tenant_id: every task of a
-- batch has its tenant, enqueue refuses another), so it reads the tenant's part of this
-- index and checks the batch on the row: the tenant's live leases (at most one per busy
-- worker slot) plus the entries of claims since the last vacuum. The expirer reads the
-- whole index (every live lease, not only the expired ones: the old index had no better
-- order for "expired in any batch" before PostgreSQL 18's skip scan either).
--
-- Rolling upgrade: workers and controllers of the previous version keep working: their
-- claims, acks and shard checks name (tenant_id, shard_key) as before and find this
-- index; their batch-keyed reads of leased rows (counts, batch_open, ...) do not name the
-- tenant and read the whole index (every live lease) until they run this version. The
-- index is built while the migration holds the table (CREATE INDEX blocks writes for the
-- build: the leased rows are few, the scan is the table's).
CREATE UNIQUE INDEX agent_work_queue_leased_uidx
    ON agent_work_queue (tenant_id, shard_key)
    WHERE status = 'leased';

DROP INDEX agent_work_queue_shard_leased_uidx;
DROP INDEX agent_work_queue_leased_idx;

-- Settled, as in 0017, with the batch's leased rows found through its tenant (above).
CREATE OR REPLACE FUNCTION jobrunner_batch_settled(p_batch_id text, p_on_dead text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM agent_task_key k
                   WHERE k.batch_id = p_batch_id
                     AND k.task_key NOT IN ('__reduce__', '__generate__'))
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'pending')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.tenant_id = (SELECT b.tenant_id FROM agent_batch b
                                            WHERE b.batch_id = p_batch_id)
                         AND q.batch_id = p_batch_id AND q.status = 'leased')
       AND NOT EXISTS (SELECT 1 FROM agent_task_key k
                       JOIN agent_work_queue q ON q.id = k.task_id
                       WHERE k.batch_id = p_batch_id AND k.task_key = '__generate__'
                         AND q.status IN ('dead', 'cancelled'))
       AND (p_on_dead IN ('skip', 'include')
            OR NOT EXISTS (SELECT 1 FROM agent_work_queue q
                           WHERE q.batch_id = p_batch_id AND q.status = 'dead'))
$$;
