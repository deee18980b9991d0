-- Reduce (issue 17; docs/results.md): a batch may name a step that runs once after every
-- one of its tasks is terminal, as a task of its own (task key '__reduce__'), whose
-- return value is the batch's result.
--
-- agent_batch.reduce          the step: {"handler": "mod:fn"} or {"command": [...]},
--                             plus "onDead" (fail | skip | include) and "maxAttempts"
-- agent_batch.reduce_enqueued_at
--                             set in the same statement that inserts the reduce task, so
--                             the trigger fires at most once per batch, ever: after
--                             retention deleted the reduce row too
-- agent_batch.result, result_bytes, reduced_at
--                             the reduce's return value, written through the effects
--                             ledger (fenced on the reduce task's lease, at most once)
--
-- The reduce task is not counted in agent_batch.tasks: status counts are the batch's own
-- tasks, and the reduce is reported on its own (the counts query takes it out).
ALTER TABLE agent_batch
    ADD COLUMN reduce             jsonb,
    ADD COLUMN reduce_enqueued_at timestamptz,
    ADD COLUMN result             jsonb,
    ADD COLUMN result_bytes       bigint,
    ADD COLUMN reduced_at         timestamptz;

-- Whether a batch is settled for its reduce: it has tasks of its own, none of them is
-- pending or leased, and (when onDead is fail) none is dead. Decided from the rows,
-- never from a counter, so no crash, retry or lost message can skip or double it. One
-- definition for the lock-free pre-check (reduce_state) and the trigger (reduce_enqueue);
-- each test is an index probe of a partial index (pending, leased, dead) or of the
-- unique (batch_id, task_key) index.
CREATE FUNCTION jobrunner_batch_settled(p_batch_id text, p_on_dead text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM agent_work_queue q
                   WHERE q.batch_id = p_batch_id AND q.task_key <> '__reduce__')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'pending')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'leased')
       AND (p_on_dead IN ('skip', 'include')
            OR NOT EXISTS (SELECT 1 FROM agent_work_queue q
                           WHERE q.batch_id = p_batch_id AND q.status = 'dead'))
$$;
