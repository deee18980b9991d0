-- Batches: every task belongs to one batch (a BatchRun, or a CLI enqueue), and its
-- task_key is unique inside the batch so that re-submitting a batch is a no-op.
CREATE TABLE agent_batch (
    batch_id     text PRIMARY KEY,
    tenant_id    text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    cancelled_at timestamptz
);

ALTER TABLE agent_work_queue
    ADD COLUMN batch_id    text NOT NULL DEFAULT 'default',
    ADD COLUMN task_key    text,
    ADD COLUMN result      jsonb,
    ADD COLUMN finished_at timestamptz;

UPDATE agent_work_queue SET task_key = id::text WHERE task_key IS NULL;
ALTER TABLE agent_work_queue ALTER COLUMN task_key SET NOT NULL;
ALTER TABLE agent_work_queue ALTER COLUMN batch_id DROP DEFAULT;

ALTER TABLE agent_work_queue DROP CONSTRAINT agent_work_queue_status_check;
ALTER TABLE agent_work_queue ADD CONSTRAINT agent_work_queue_status_check
    CHECK (status IN ('pending', 'leased', 'done', 'dead', 'cancelled'));

-- Idempotent enqueue: the dedupe key is (batch, task key), never the shard key.
CREATE UNIQUE INDEX agent_work_queue_batch_key_uidx ON agent_work_queue (batch_id, task_key);

-- Every claim is scoped to one batch, so the claim index leads with batch_id. It
-- replaces the article's (run_after, id) index, which no query uses any more.
CREATE INDEX agent_work_queue_batch_pending_idx
    ON agent_work_queue (batch_id, run_after, id) WHERE status = 'pending';
DROP INDEX agent_work_queue_pending_idx;

-- Status counts per batch (status, the controller's refresh) read this index only.
CREATE INDEX agent_work_queue_batch_status_idx ON agent_work_queue (batch_id, status);

-- The expirer's scan: leased rows are few, so this index stays tiny.
CREATE INDEX agent_work_queue_leased_idx
    ON agent_work_queue (locked_until) WHERE status = 'leased';
