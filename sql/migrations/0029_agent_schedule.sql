-- BatchRunSchedules as the console sees them (issue 28: "schedules (next run, history)",
-- "trigger a schedule"; docs/console.md "Schedules").
--
-- `jobrunner serve` has no Kubernetes access, on purpose (docs/security.md): an API that
-- could patch BatchRunSchedules could rewrite their pod templates. So the controller,
-- which reads the schedules anyway, writes here what the console shows of them, and the
-- console asks for a run by inserting a row the controller takes: the database is the
-- only channel between the two, and a row cannot say more than "run schedule X now".

-- One row per BatchRunSchedule whose template names this database, as the controller
-- last saw it (jobrunner/operator/schedule.py): written when something shown changed,
-- deleted with the schedule. tenant_id is the template's spec.tenant.
CREATE TABLE agent_schedule (
    namespace          text NOT NULL,
    name               text NOT NULL,
    tenant_id          text NOT NULL,
    schedule           text NOT NULL,
    time_zone          text,
    suspend            boolean NOT NULL,
    concurrency_policy text NOT NULL,
    ready              text NOT NULL,         -- the Ready condition's reason
    message            text NOT NULL,         -- and its message (no secret: names and times)
    next_run_at        timestamptz,           -- status.nextScheduleTime (NULL: suspended)
    last_schedule_at   timestamptz,           -- status.lastScheduleTime
    last_successful_at timestamptz,           -- status.lastSuccessfulTime
    active_runs        text[] NOT NULL DEFAULT '{}',
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, name)
);

-- A console admin's "Trigger now": the controller takes each row once (taken_at, under a
-- row lock: two replicas or a restart never take it twice) and writes what became of it:
-- 'started' and the BatchRun it made (<schedule>-manual-console-<id>, made as the
-- jobrunner.dev/trigger annotation makes its run), or 'refused' and why (no such
-- schedule; the requester's tenant is not the template's). tenant_id is the requesting
-- key's tenant ('*': an operator's key, which may trigger any schedule).
CREATE TABLE agent_schedule_trigger (
    id           bigserial PRIMARY KEY,
    namespace    text NOT NULL,
    name         text NOT NULL,
    tenant_id    text NOT NULL,
    requested_by text NOT NULL,               -- the key's id (or proxy:<user>)
    requested_at timestamptz NOT NULL DEFAULT now(),
    taken_at     timestamptz,
    outcome      text CONSTRAINT agent_schedule_trigger_outcome_check
                      CHECK (outcome IN ('started', 'refused')),
    run_name     text,
    message      text,
    CONSTRAINT agent_schedule_trigger_taken_check CHECK ((taken_at IS NULL) = (outcome IS NULL))
);
-- The controller's poll (schedule_trigger_take): the untaken rows only, a small index
-- however long the history grows.
CREATE INDEX agent_schedule_trigger_untaken ON agent_schedule_trigger (id) WHERE taken_at IS NULL;
-- The console's recent triggers, newest first.
CREATE INDEX agent_schedule_trigger_by_schedule ON agent_schedule_trigger (namespace, name, id DESC);

-- Tenants in the rows, as every tenant table (migrations 0022 and 0026): a role bound to
-- tenants gets its restrictive policy on both from `jobrunner migrate` / `db grant`.
ALTER TABLE agent_schedule ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_schedule FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_all ON agent_schedule USING (true);
ALTER TABLE agent_schedule_trigger ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_schedule_trigger FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_all ON agent_schedule_trigger USING (true);
