-- A task's key in a table of its own, written once at enqueue (issue 18, item 5: less WAL
-- per task).
--
-- The unique index on agent_work_queue (batch_id, task_key) made re-enqueueing a key a
-- no-op. But a task row is updated twice (claim, ack) and neither update can be HOT
-- (status is in partial-index predicates), so each update added an entry to that index
-- too: ≈ 140 B of WAL per task (pg_waldump --stats, docs/pools.md) for a key that never
-- changes. The uniqueness now lives in agent_task_key, one row per task, written in the
-- same statement as the task's insert and never touched by claims or acks:
--
--   enqueue   a BEFORE INSERT trigger on agent_work_queue inserts the task's key with
--             ON CONFLICT DO NOTHING and drops the task's row when the key exists. Any
--             insert into the task table goes through it, whatever statement or process
--             sends it. Concurrent inserts of one key behave as the unique index did: the
--             second waits for the first's transaction on the key's primary key, then
--             inserts nothing if it committed, or inserts if it rolled back.
--   delete    a row trigger deletes the key with its task (retention, archive, any
--             DELETE), so a key whose task was deleted can be enqueued again, as before;
--             TRUNCATE of the task table truncates the keys.
--   update    a task's batch_id and task_key never change: an UPDATE that would change
--             them is refused (a column trigger: claims and acks do not fire it).
--   reads     the rows of one batch in key order, and a batch's '__reduce__' or
--             '__generate__' task, are found through the key's primary key and then
--             the task's (queries.sql: counts, reduce_state, generator_state,
--             reduce_inputs, export_results; jobrunner_batch_settled below).
--
-- The task row keeps its task_key column: claims return it and the effects ledger is
-- keyed on it.
--
-- Rolling upgrade: workers and controllers of the previous version keep claiming, acking
-- and expiring as before (those statements never used the index). Their enqueues,
-- reduce trigger and generator enqueue name `ON CONFLICT (batch_id, task_key)`, which
-- now has no unique index to match: they fail with "there is no unique or exclusion
-- constraint matching the ON CONFLICT specification" and write nothing (a CLI enqueue
-- reports it, the controller retries its handler, a generator or reduce attempt fails and
-- is retried) until they run this version.
CREATE TABLE agent_task_key (
    batch_id text   NOT NULL,
    task_key text   NOT NULL,
    task_id  bigint NOT NULL
);

CREATE FUNCTION jobrunner_task_key_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- (NEW.id is already drawn from the sequence: defaults come before BEFORE triggers)
    INSERT INTO agent_task_key (batch_id, task_key, task_id)
    VALUES (NEW.batch_id, NEW.task_key, NEW.id)
    ON CONFLICT (batch_id, task_key) DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;  -- the key exists: this task is not inserted, as ON CONFLICT DO NOTHING
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION jobrunner_task_key_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- (one index probe per deleted task; task_id so that only this task's key goes)
    DELETE FROM agent_task_key
    WHERE batch_id = OLD.batch_id AND task_key = OLD.task_key AND task_id = OLD.id;
    RETURN NULL;
END
$$;

CREATE FUNCTION jobrunner_task_key_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE agent_task_key;
    RETURN NULL;
END
$$;

CREATE FUNCTION jobrunner_task_key_fixed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a task''s batch_id and task_key cannot change (task %)', OLD.id
        USING ERRCODE = 'feature_not_supported';
END
$$;

-- (the triggers first: CREATE TRIGGER locks the task table against writes until this
-- migration commits, so no task is inserted between the backfill and the new enqueue path)
CREATE TRIGGER agent_work_queue_key_insert BEFORE INSERT ON agent_work_queue
    FOR EACH ROW EXECUTE FUNCTION jobrunner_task_key_insert();
CREATE TRIGGER agent_work_queue_key_delete AFTER DELETE ON agent_work_queue
    FOR EACH ROW EXECUTE FUNCTION jobrunner_task_key_delete();
CREATE TRIGGER agent_work_queue_key_truncate AFTER TRUNCATE ON agent_work_queue
    FOR EACH STATEMENT EXECUTE FUNCTION jobrunner_task_key_truncate();
CREATE TRIGGER agent_work_queue_key_fixed BEFORE UPDATE OF batch_id, task_key
    ON agent_work_queue FOR EACH ROW
    WHEN (OLD.batch_id IS DISTINCT FROM NEW.batch_id OR OLD.task_key IS DISTINCT FROM NEW.task_key)
    EXECUTE FUNCTION jobrunner_task_key_fixed();

-- The existing tasks' keys (unique: the index below still holds), then the key's index
-- built once over them.
INSERT INTO agent_task_key (batch_id, task_key, task_id)
SELECT batch_id, task_key, id FROM agent_work_queue;
ALTER TABLE agent_task_key ADD PRIMARY KEY (batch_id, task_key);

DROP INDEX agent_work_queue_batch_key_uidx;

-- Settled, as in 0012, with the tests that read the batch's rows by key through the key
-- table (the task table has no index over all of a batch's rows any more).
CREATE OR REPLACE FUNCTION jobrunner_batch_settled(p_batch_id text, p_on_dead text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM agent_task_key k
                   WHERE k.batch_id = p_batch_id
                     AND k.task_key NOT IN ('__reduce__', '__generate__'))
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'pending')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'leased')
       AND NOT EXISTS (SELECT 1 FROM agent_task_key k
                       JOIN agent_work_queue q ON q.id = k.task_id
                       WHERE k.batch_id = p_batch_id AND k.task_key = '__generate__'
                         AND q.status IN ('dead', 'cancelled'))
       AND (p_on_dead IN ('skip', 'include')
            OR NOT EXISTS (SELECT 1 FROM agent_work_queue q
                           WHERE q.batch_id = p_batch_id AND q.status = 'dead'))
$$;
