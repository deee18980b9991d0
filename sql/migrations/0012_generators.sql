-- Generators (issue 19; docs/sources.md): a batch whose tasks are produced at run time by
-- user code, which runs as a task of its own (task key '__generate__') claimed by the
-- batch's workers: lease, heartbeat, fencing, retries. Its chunks are enqueued keyed on
-- (batch_id, task_key), so a re-run after a crash adds only what is missing.
--
-- agent_batch.generator   the step: {"handler": "mod:fn"} or {"command": [...]}, plus
--                         "args", "chunkSize" and "maxAttempts"
--
-- Like the reduce task, the generator task is not counted in agent_batch.tasks, and the
-- counts query takes it out of its status: counts are the batch's own tasks.
ALTER TABLE agent_batch ADD COLUMN generator jsonb;

-- Settled (every task terminal) now also waits for the generator: while it is pending or
-- leased the batch is not settled (that test was already there: its row is pending or
-- leased like any task), and a generator that ended dead leaves the batch unsettled for
-- good, whatever onDead says: its tasks are incomplete, so no reduce may run over them.
CREATE OR REPLACE FUNCTION jobrunner_batch_settled(p_batch_id text, p_on_dead text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM agent_work_queue q
                   WHERE q.batch_id = p_batch_id
                     AND q.task_key NOT IN ('__reduce__', '__generate__'))
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'pending')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'leased')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.task_key = '__generate__'
                         AND q.status IN ('dead', 'cancelled'))
       AND (p_on_dead IN ('skip', 'include')
            OR NOT EXISTS (SELECT 1 FROM agent_work_queue q
                           WHERE q.batch_id = p_batch_id AND q.status = 'dead'))
$$;
