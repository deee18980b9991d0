-- Row-level security that costs nothing to whom it does not bind (issue 29, item 5;
-- docs/security.md "Tenants in the rows").
--
-- Migration 0022's policies applied TO PUBLIC: every statement of every role, bound to a
-- tenant or not, ran an InitPlan over the bindings per protected table reference, and a
-- bound one a hashed SubPlan and a filter on top (bench/results/rls.md: 15-28 % of the
-- claim's rate at claim batch 1). Here each protected table gets instead:
--
-- - jobrunner_all, PERMISSIVE, TO PUBLIC, USING (true): what lets any row through at all
--   (row-level security denies everything without a permissive policy). The planner
--   drops a constant true qual, so a role bound to no tenant (the owner, the operator,
--   the API, read-only, unbound workers, a single-DSN install) plans and runs exactly
--   as without row-level security;
-- - per login role bound to tenants, a RESTRICTIVE policy TO that role whose expression
--   holds its tenants as constants (sql/grants/tenant_policies.sql, written by `jobrunner
--   tenant create|bind` and re-applied by `jobrunner migrate` / `db grant`, which find the
--   protected tables as the ones carrying jobrunner_all: a later migration's table that
--   adds jobrunner_all is covered the next time they run).
--
-- ENABLE and FORCE stay as migration 0022 set them. The bound roles' policies of 0022
-- (by session_user) are dropped here; the migration's caller re-applies the bindings'
-- policies in the same transaction (jobrunner/store/tenant_policies.py).

DROP POLICY jobrunner_tenant ON agent_work_queue;
CREATE POLICY jobrunner_all ON agent_work_queue USING (true);

DROP POLICY jobrunner_tenant ON agent_work_queue_archive;
CREATE POLICY jobrunner_all ON agent_work_queue_archive USING (true);

DROP POLICY jobrunner_tenant ON agent_batch;
CREATE POLICY jobrunner_all ON agent_batch USING (true);

DROP POLICY jobrunner_tenant ON agent_shard_lease;
CREATE POLICY jobrunner_all ON agent_shard_lease USING (true);

DROP POLICY jobrunner_tenant ON agent_pool_stream;
CREATE POLICY jobrunner_all ON agent_pool_stream USING (true);

DROP POLICY jobrunner_tenant ON agent_pool_tenant;
CREATE POLICY jobrunner_all ON agent_pool_tenant USING (true);

DROP POLICY jobrunner_tenant ON api_key;
CREATE POLICY jobrunner_all ON api_key USING (true);

DROP POLICY jobrunner_tenant ON api_file;
CREATE POLICY jobrunner_all ON api_file USING (true);

DROP POLICY jobrunner_tenant ON api_batch;
CREATE POLICY jobrunner_all ON api_batch USING (true);

DROP POLICY jobrunner_tenant ON console_audit;
CREATE POLICY jobrunner_all ON console_audit USING (true);

DROP POLICY jobrunner_tenant ON agent_pool_tenant_usage;
CREATE POLICY jobrunner_all ON agent_pool_tenant_usage USING (true);

DROP POLICY jobrunner_tenant ON agent_task_key;
CREATE POLICY jobrunner_all ON agent_task_key USING (true);

DROP POLICY jobrunner_tenant ON agent_task_effect;
CREATE POLICY jobrunner_all ON agent_task_effect USING (true);

DROP POLICY jobrunner_tenant ON agent_task_usage;
CREATE POLICY jobrunner_all ON agent_task_usage USING (true);

DROP POLICY jobrunner_tenant ON agent_batch_usage;
CREATE POLICY jobrunner_all ON agent_batch_usage USING (true);

DROP POLICY jobrunner_tenant ON api_file_chunk;
CREATE POLICY jobrunner_all ON api_file_chunk USING (true);

-- The bindings are read by `jobrunner migrate`, `db grant` and `tenant ...` (as the
-- owner) only: no policy reads them any more, so no component is granted them
-- (sql/grants/privileges.sql), and their own policy is left as it was.
