-- Every attempt of a task (docs/console.md, "Task"): its worker, start, end, how it
-- ended and its error, for the console's task page.
--
-- leased_at: when the claim statement leased the task, set by the claims in the row
-- they already update (no index: still a HOT update, eight bytes of WAL). updated_at
-- could not serve: every heartbeat moves it.
--
-- agent_task_attempt: one row per attempt that did NOT end in its ack, written by the
-- statement that ended it (task_fail, task_throttle, task_release, task_expire: a CTE
-- inserting from the row it updated), so a batch that succeeds writes nothing here. The
-- acked attempt, and the one running now, are read from the task row itself (lease_owner,
-- leased_at, finished_at). attempt: the attempt's number as the worker held it (a
-- rate-limited or released attempt gives its number back: the next one has it again, so
-- the key has the end time too). outcome: what ended it; status: what the task became.
-- The archive gets leased_at too, at the same position: retention copies rows with q.*.
ALTER TABLE agent_work_queue ADD COLUMN leased_at timestamptz;
ALTER TABLE agent_work_queue_archive ADD COLUMN leased_at timestamptz;

CREATE TABLE agent_task_attempt (
    task_id bigint NOT NULL,
    attempt integer NOT NULL,
    ended_at timestamptz NOT NULL DEFAULT now(),
    batch_id text NOT NULL,
    tenant_id text NOT NULL,
    worker text,
    started_at timestamptz,
    outcome text NOT NULL
        CHECK (outcome IN ('failed', 'rate_limited', 'released', 'expired')),
    status text NOT NULL,
    error text,
    PRIMARY KEY (task_id, attempt, ended_at)
);

-- A tenant's rows like every table with a tenant (migration 0026; its bound roles'
-- restrictive policies come from sql/grants/tenant_policies.sql).
ALTER TABLE agent_task_attempt ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_task_attempt FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_all ON agent_task_attempt USING (true);
