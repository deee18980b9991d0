-- A tenant's usage and budget in a pool (agent_pool_tenant_usage, migration 0024) is a
-- tenant's row like the others: under the same row-level security as every table with a
-- tenant (migration 0022, docs/security.md), so a tenant-bound worker adds its usage to
-- its own tenant's row only, and sees no other tenant's spend or budget.
ALTER TABLE agent_pool_tenant_usage ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_pool_tenant_usage FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_tenant ON agent_pool_tenant_usage
    USING (NOT EXISTS (SELECT FROM jobrunner_tenant_role r WHERE r.role_name = session_user)
           OR tenant_id IN (SELECT r.tenant_id FROM jobrunner_tenant_role r
                            WHERE r.role_name = session_user));
