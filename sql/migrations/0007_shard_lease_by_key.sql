-- Shard leases are released by their primary key (tenant_id, shard_key) plus the task
-- id, which every releasing statement has at hand: the index on task_id alone cost one
-- more index insert on every claim of a sharded task and no query needs it any more.
DROP INDEX agent_shard_lease_task_idx;
