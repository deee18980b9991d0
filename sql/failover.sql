-- Named queries that keep the guarantees when the primary moves (docs/failover.md).
-- Loaded with sql/queries.sql (jobrunner/store/sqlfiles.py): same conventions, same namespace.

-- name: end_leases_missing_effects
-- Sent in front of the ack of attempts that used task.once, in the ack's transaction.
-- An effect and its ledger row commit together, so a failover with asynchronous
-- replication can lose both while the lease, claimed earlier, survived: the worker still
-- holds it on the new primary, and its ack, sent there, would land and leave the task
-- done without its effect. Such a lease is ended here instead, as if it had expired: the
-- owner no longer matches, so the ack that follows is fenced off (the worker counts the
-- attempt as lost); the expirer returns the task to pending within about a second; the
-- next attempt applies the effect. Normally every ledger row is there: index probes,
-- nothing written. ids, attempts and effect_keys are parallel arrays, one entry per
-- (attempt, effect key); tasks are found by primary key (see "Plans" in queries.sql).
UPDATE agent_work_queue q
SET lease_owner = q.lease_owner || ' (its effects were lost in a failover)',
    locked_until = now(),
    updated_at = now()
WHERE q.id = ANY(%(ids)s::bigint[])
  AND q.lease_owner = %(worker_id)s
  AND q.status || '' = 'leased'  -- by primary key, never the leased index: see Plans
  AND EXISTS (
      SELECT 1
      FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(effect_keys)s::text[])
           AS e(id, attempt, effect_key)
      WHERE e.id = q.id AND e.attempt = q.attempts
        AND NOT EXISTS (
            SELECT 1 FROM agent_task_effect l
            WHERE l.batch_id = q.batch_id AND l.task_key = q.task_key
              AND l.effect_key = e.effect_key))
RETURNING q.id;
