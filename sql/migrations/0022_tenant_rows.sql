-- Tenant isolation in the rows (docs/security.md): row-level security on every table that
-- holds a tenant's data, and the record of which login roles are bound to which tenants.
--
-- How a connection proves its tenant: by the role it logged in as (session_user), looked
-- up in jobrunner_tenant_role. Not a setting: handler code can SET any setting it likes,
-- but not its session_user (SET SESSION AUTHORIZATION needs a superuser, and SET ROLE
-- changes current_user only). A login role with rows here sees and changes only the rows
-- of those tenants (one tenant: a tenant's worker; several: a pool's worker, spanning
-- exactly the pool's tenants). A role with no row here is not bound to a tenant: the
-- owner, the operator, the API, read-only, and every role of a single-DSN install.
--
-- Until `jobrunner db grant` binds a role (jobrunner/store/roles.py), nothing changes for
-- anyone: every role is unbound, and the policies let every row through.

CREATE TABLE jobrunner_tenant_role (
    role_name name NOT NULL,  -- a LOGIN role (compared with session_user)
    tenant_id text NOT NULL,
    PRIMARY KEY (role_name, tenant_id)
);

-- The components' roles `jobrunner db grant` made (component: owner, operator, worker,
-- api, readonly), so that a later `jobrunner migrate` grants them what a new migration
-- adds without being told their names again.
CREATE TABLE jobrunner_component_role (
    component text PRIMARY KEY
        CHECK (component IN ('owner', 'operator', 'worker', 'api', 'readonly')),
    role_name name NOT NULL
);

-- Each role reads its own bindings only (the policies below read this table as the
-- querying role): a tenant does not learn which other tenants and roles exist. Not
-- FORCEd: its owner writes every binding (`jobrunner tenant create|bind`).
ALTER TABLE jobrunner_tenant_role ENABLE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_own ON jobrunner_tenant_role FOR SELECT
    USING (role_name = session_user);

-- The policies: one per table, for every command; WITH CHECK is the USING expression, so
-- a bound role can neither see nor write a row of another tenant (nor move a row to one).
-- FORCE: the tables' owner is bound too (it is unbound, so it sees every row: FORCE
-- matters for a SECURITY DEFINER function a later migration might add).
--
-- Tables with a tenant_id column.
ALTER TABLE agent_work_queue ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_work_queue FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_work_queue
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE agent_work_queue_archive ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_work_queue_archive FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_work_queue_archive
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE agent_batch ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_batch FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_batch
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE agent_shard_lease ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_shard_lease FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_shard_lease
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE agent_pool_stream ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_pool_stream FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_pool_stream
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE agent_pool_tenant ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_pool_tenant FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_pool_tenant
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE api_key ENABLE ROW LEVEL SECURITY;
ALTER TABLE api_key FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON api_key
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE api_file ENABLE ROW LEVEL SECURITY;
ALTER TABLE api_file FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON api_file
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE api_batch ENABLE ROW LEVEL SECURITY;
ALTER TABLE api_batch FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON api_batch
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

ALTER TABLE console_audit ENABLE ROW LEVEL SECURITY;
ALTER TABLE console_audit FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON console_audit
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));

-- Tables of a batch's data without a tenant column: the batch's tenant decides (the
-- sub-select of agent_batch is itself under agent_batch's policy). An unbound session
-- stops at the first operand and probes nothing.
ALTER TABLE agent_task_key ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_task_key FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_task_key
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = agent_task_key.batch_id));

ALTER TABLE agent_task_effect ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_task_effect FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_task_effect
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = agent_task_effect.batch_id));

ALTER TABLE agent_task_usage ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_task_usage FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_task_usage
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = agent_task_usage.batch_id));

ALTER TABLE agent_batch_usage ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_batch_usage FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_batch_usage
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR EXISTS (SELECT 1 FROM agent_batch b WHERE b.batch_id = agent_batch_usage.batch_id));

ALTER TABLE api_file_chunk ENABLE ROW LEVEL SECURITY;
ALTER TABLE api_file_chunk FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON api_file_chunk
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR EXISTS (SELECT 1 FROM api_file f WHERE f.file_id = api_file_chunk.file_id));

-- Not under row-level security, on purpose: flow control's limits, lanes and slots
-- (agent_limit*: shared by every tenant that names a limit, and they hold no tenant
-- data), the pools' clocks (agent_pool), and the two tables above (only the owner and
-- `jobrunner db grant` write them; no other role is granted them).
