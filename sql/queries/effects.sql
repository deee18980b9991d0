-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- The effects ledger (agent_task_effect, docs/guarantees.md): effects applied once.

-- name: effect_fence
-- Prove a lease is still held and share-lock its task row until commit.
--
-- Inside the effect's transaction: proves the lease is still ours and live, and holds
-- a share lock on the row until commit so the expirer cannot take it meanwhile.
SELECT 1 FROM agent_work_queue
WHERE id = %(id)s AND attempts = %(attempt)s AND lease_owner = %(worker_id)s
  AND status = 'leased' AND locked_until > now()
FOR SHARE;

-- name: effect_record
-- Record an effect key once; returns nothing when it was recorded before.
INSERT INTO agent_task_effect (batch_id, task_key, effect_key, task_id, attempt, lease_owner)
VALUES (%(batch_id)s, %(task_key)s, %(effect_key)s, %(id)s, %(attempt)s, %(worker_id)s)
ON CONFLICT DO NOTHING
RETURNING 1;

-- name: effect_lookup
-- The recorded result of an effect key.
SELECT result FROM agent_task_effect
WHERE batch_id = %(batch_id)s AND task_key = %(task_key)s AND effect_key = %(effect_key)s;

-- name: effect_set_result
-- Store the result of a recorded effect.
UPDATE agent_task_effect SET result = %(result)s
WHERE batch_id = %(batch_id)s AND task_key = %(task_key)s AND effect_key = %(effect_key)s;
