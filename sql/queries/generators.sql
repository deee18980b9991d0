-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
-- Parameters use psycopg's %(name)s style; every value is sent as a bound parameter,
-- never formatted into the text. Time always comes from the database's now(), never
-- from a worker's clock.
--
-- A batch's generator step.

-- Generators (jobrunner/features/generators.py, docs/sources.md): one task per batch, key
-- '__generate__', inserted with the batch; it runs the user's code, which enqueues the
-- batch's tasks in chunks (the ordinary keyed enqueue, each chunk one transaction fenced
-- on the generator's lease). Not counted in agent_batch.tasks (see counts).

-- name: generator_enqueue
-- Enqueue a batch's generator task, at most once.
--
-- The batch's generator step and its task (after ensure_batch locked the batch row):
-- idempotent on (batch_id, task_key), so a controller that restarts mid-enqueue, or a
-- second `jobrunner run`, inserts it once; a generator that already ran is not run again,
-- and the step first given to the batch stays its step.
WITH step AS (
    UPDATE agent_batch SET generator = coalesce(generator, %(generator)s::jsonb)
    WHERE batch_id = %(batch_id)s
    RETURNING batch_id, tenant_id
)
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, max_attempts)
SELECT batch_id, tenant_id, '__generate__', '{}'::jsonb, %(max_attempts)s
FROM step  -- (a '__generate__' key that exists: no row, sql/schema.sql)
RETURNING id;

-- name: generator_state
-- A batch's generator spec and its task's state.
--
-- Lock-free: the batch's generator step and its task (if any).
SELECT b.generator, g.status::text AS task_status, g.attempts, g.max_attempts,
       g.last_error, g.result, g.finished_at
FROM agent_batch b
LEFT JOIN agent_task_key gk ON gk.batch_id = b.batch_id AND gk.task_key = '__generate__'
LEFT JOIN agent_work_queue g ON g.id = gk.task_id
WHERE b.batch_id = %(batch_id)s;
