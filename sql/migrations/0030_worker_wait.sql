-- Waiting workers, so that an enqueue wakes as many of them as it has tasks for, not
-- the whole fleet (issue 30: "a fleet that waits costs the database nothing";
-- jobrunner/worker/notifier.py, docs/scaling.md "Waking a waiting fleet").
--
-- A worker with nothing to claim and nothing due writes its row here before its long
-- sleep (and refreshes seen_at on each fallback look); an enqueue takes, in its own
-- transaction, as many rows of its batch or pool as it has new tasks plus one, most
-- recently seen first, deletes them and names them in one note on jobrunner_wake. Only
-- those workers claim; the others sleep on. Without a row to take (nobody waiting, or
-- more tasks than a note names) the enqueue wakes everyone, as before.
--
-- A row is only a hint: a dead worker's row costs one wake-up (the spare covers it) and
-- sinks below the live ones, which refresh theirs; the maintenance leader deletes rows
-- not seen for ten minutes. UNLOGGED: nothing here must survive a crash or a failover
-- (the workers' notifiers reconnect and wake every worker, which then write rows anew),
-- and a fleet's registrations write no WAL.
CREATE UNLOGGED TABLE agent_worker_wait (
    wait_id  bigint PRIMARY KEY,      -- chosen by the worker (random), named in the note
    batch_id text,                    -- the batch it works on, or
    pool     text,                    -- the pool it serves
    seen_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((batch_id IS NULL) <> (pool IS NULL))
);
CREATE INDEX agent_worker_wait_batch ON agent_worker_wait (batch_id, seen_at)
    WHERE batch_id IS NOT NULL;
CREATE INDEX agent_worker_wait_pool ON agent_worker_wait (pool, seen_at)
    WHERE pool IS NOT NULL;

-- A protected table (migration 0026): a role bound to tenants sees only its batches'
-- rows (by batch_id), so a tenant's enqueue wakes its own workers and reads no other
-- tenant's batch names; pool rows have no batch and are not visible to it (its pool
-- enqueue then wakes the pool's workers by the broadcast note).
ALTER TABLE agent_worker_wait ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_worker_wait FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_all ON agent_worker_wait USING (true);
