-- Per-shard mutual exclusion. A row here means "task task_id holds the live lease of
-- (tenant_id, shard_key)". The primary key is what makes exclusion hold under
-- concurrent claims: two transactions inserting the same key are serialised by the
-- unique index (the second waits for the first to commit, then sees the conflict and
-- skips), which a NOT EXISTS check on agent_work_queue alone cannot do because each
-- claim reads its own snapshot. Rows live only while the task is leased: ack, fail,
-- release and expire delete them in the same statement that moves the task.
-- Transaction-scoped and table-based, it also works behind PgBouncer in transaction
-- pooling mode, unlike session advisory locks.
CREATE TABLE agent_shard_lease (
    tenant_id   text        NOT NULL,
    shard_key   text        NOT NULL,
    task_id     bigint      NOT NULL,
    lease_owner text        NOT NULL,
    leased_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, shard_key)
);
CREATE INDEX agent_shard_lease_task_idx ON agent_shard_lease (task_id);
