-- Fewer index entries per task, and status counts that do not grow with the batch.
--
-- A queue row is updated twice in its life (claim, ack), and neither update can be HOT
-- (status is in the indexes' predicates), so each adds an entry to every index whose
-- predicate the new version matches. The status index (batch_id, status) took an
-- entry on both updates and kept one for every row ever finished; the leased index
-- took one more on each claim. Now:
--   pending          counted in the claim index (agent_work_queue_batch_pending_idx)
--   leased           agent_work_queue_leased_idx, now (batch_id, locked_until)
--   dead, cancelled  a partial index that only those rows enter (few, kept in id order
--                    for `jobrunner dead`)
--   done             the batch's task count (agent_batch.tasks, kept by enqueue and
--                    retention in the same transactions) minus all of the above
-- Per task that is 5 index entries instead of 7 (claim: primary key, task key, leased;
-- ack: primary key, task key), so less CPU and WAL per task; and a status refresh reads
-- only the unfinished rows instead of an index entry for every row of the batch.
--
-- The expirer looks for expired leases of every batch: with batch_id first that is a
-- scan of the leased index (one entry per live lease; a skip scan on PostgreSQL 18),
-- never of the table.
DROP INDEX agent_work_queue_batch_status_idx;
CREATE INDEX agent_work_queue_batch_failed_idx ON agent_work_queue (batch_id, status, id)
    WHERE status IN ('dead', 'cancelled');

DROP INDEX agent_work_queue_leased_idx;
CREATE INDEX agent_work_queue_leased_idx ON agent_work_queue (batch_id, locked_until)
    WHERE status = 'leased';

ALTER TABLE agent_batch ADD COLUMN tasks bigint NOT NULL DEFAULT 0;
UPDATE agent_batch b
SET tasks = (SELECT count(*) FROM agent_work_queue q WHERE q.batch_id = b.batch_id);
