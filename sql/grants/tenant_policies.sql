-- Named statements (jobrunner/store/sqlfiles.py loads this file with sql/queries/): the
-- row policies of a login role bound to tenants (docs/security.md "Tenants in the
-- rows"), written by `jobrunner tenant create|bind` and re-applied for every binding by
-- `jobrunner migrate` / `jobrunner db grant` after migrating (jobrunner/store/privileges.py).
--
-- Every protected table carries jobrunner_all (migration 0026: PERMISSIVE, TO PUBLIC,
-- USING (true)), which costs a role bound to no tenant nothing. A bound role gets, per
-- protected table, a RESTRICTIVE policy TO it alone, its tenants written in as
-- constants: the planner compares a column with a constant array, nothing read per
-- statement. A name in braces is put in by the store with psycopg.sql (Identifier for
-- names, Literal for the tenants), never as text.

-- name: tenant_policy_tables
-- The protected tables (those carrying jobrunner_all, in jobrunner's schema) and how each
-- reaches its tenant: its own tenant_id, else its batch's (batch_id), else its file's.
SELECT c.relname::text AS table_name,
       CASE WHEN bool_or(a.attname = 'tenant_id') THEN 'tenant'
            WHEN bool_or(a.attname = 'batch_id') THEN 'batch'
            WHEN bool_or(a.attname = 'file_id') THEN 'file' END AS via
FROM pg_policy p
JOIN pg_class c ON c.oid = p.polrelid
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE p.polname = 'jobrunner_all'
GROUP BY c.relname
ORDER BY 1;

-- name: tenant_policy_role
-- A role's oid (its policies are named after it: role names may be as long as a policy's
-- name can be) and whether it could step out of its policies: policies TO a role apply
-- while it is the current user, so it must not SET ROLE to another role (16+: a
-- membership WITH SET FALSE; before 16 every membership allows SET ROLE), nor bypass
-- row-level security.
SELECT r.oid::bigint AS oid, r.rolsuper OR r.rolbypassrls AS bypasses,
       (SELECT string_agg(g.rolname::text, ', ' ORDER BY g.rolname)
        FROM pg_roles g
        WHERE g.oid <> r.oid
          AND CASE WHEN current_setting('server_version_num')::int >= 160000
                   THEN pg_has_role(r.oid, g.oid, 'SET')
                   ELSE pg_has_role(r.oid, g.oid, 'MEMBER') END) AS can_become
FROM pg_roles r WHERE r.rolname = %(role)s;

-- name: tenant_policy_of_role
-- The restrictive policies of one role (its bound tenants') on jobrunner's tables.
SELECT p.polname::text AS policy_name, c.relname::text AS table_name
FROM pg_policy p
JOIN pg_class c ON c.oid = p.polrelid
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
WHERE NOT p.polpermissive AND p.polname LIKE 'jobrunner\_tenant\_%%'
  AND p.polroles = ARRAY[(SELECT r.oid FROM pg_roles r WHERE r.rolname = %(role)s)]
ORDER BY 2;

-- name: tenant_policy_drop
-- Drop one of a bound role's policies.
DROP POLICY {policy} ON {table};

-- name: tenant_policy_by_tenant
-- A table with a tenant column: the role's tenants, as constants. USING serves as WITH
-- CHECK: the role neither sees nor writes another tenant's row.
CREATE POLICY {policy} ON {table} AS RESTRICTIVE TO {role}
    USING (tenant_id = ANY ({tenants}::text[]));

-- name: tenant_policy_by_batch
-- A table of a batch's rows without a tenant column: its batch's tenant. An uncorrelated
-- IN: the planner runs it once per statement (a hashed SubPlan over the tenants'
-- batches, itself under agent_batch's policies), not once per row.
CREATE POLICY {policy} ON {table} AS RESTRICTIVE TO {role}
    USING (batch_id IN (SELECT b.batch_id FROM agent_batch b
                        WHERE b.tenant_id = ANY ({tenants}::text[])));

-- name: tenant_policy_by_file
-- A table of a file's rows without a tenant column (api_file_chunk): its file's tenant,
-- as above.
CREATE POLICY {policy} ON {table} AS RESTRICTIVE TO {role}
    USING (file_id IN (SELECT f.file_id FROM api_file f
                       WHERE f.tenant_id = ANY ({tenants}::text[])));
