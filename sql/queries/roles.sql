-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
--
-- Roles and tenants' bindings (jobrunner/store/roles.py, docs/security.md). A name in
-- braces is a role's or the schema's name, put in by the store as a quoted identifier
-- (psycopg.sql.Identifier): role names cannot be bound parameters in PostgreSQL's
-- utility statements. Every value is still a bound parameter.

-- name: role_exists
-- Whether a role of this name exists in the cluster.
SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %(name)s) AS e;

-- name: role_create_group
-- Create a role that cannot log in (a component's privileges are granted to it).
CREATE ROLE {role} NOLOGIN;

-- name: role_create_login
-- Create a role that logs in with the given SCRAM verifier (never a plain password).
CREATE ROLE {role} LOGIN PASSWORD {verifier};

-- name: role_set_password
-- Give a login role a new SCRAM verifier.
ALTER ROLE {role} WITH LOGIN PASSWORD {verifier};

-- name: role_grant_set
-- Make a role a member of a group that may SET ROLE to it (PostgreSQL 16 and later).
GRANT {group} TO {member} WITH SET TRUE;

-- name: role_grant_no_set
-- Make a role a member of a group, inheriting its privileges without SET ROLE to it (16+).
GRANT {group} TO {member} WITH INHERIT TRUE, SET FALSE;

-- name: role_grant
-- Make a role a member of a group (PostgreSQL before 16: membership allows SET ROLE).
GRANT {group} TO {member};

-- name: role_grant_schema_create
-- Let the owner create objects in jobrunner's schema, and the components use it (the
-- schema's owner grants it: the owner role does not own the schema).
GRANT USAGE, CREATE ON SCHEMA {schema} TO {owner};
GRANT USAGE ON SCHEMA {schema} TO {operator}, {worker}, {api}, {readonly};

-- name: role_set_local
-- Act as this role until the transaction ends (the owner, for migrations and grants).
SET LOCAL ROLE {role};

-- name: role_schema_owner
-- Who owns jobrunner's tables (the owner of its migrations table), and whether this session may act as it.
SELECT r.rolname AS owner, r.rolname = current_user AS is_me,
       CASE WHEN current_setting('server_version_num')::int >= 160000
            THEN pg_has_role(r.oid, 'SET') ELSE pg_has_role(r.oid, 'MEMBER') END AS can_set
FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
WHERE c.oid = to_regclass('jobrunner_schema_migrations');

-- name: role_give_objects
-- Give jobrunner's objects that this session's role owns to the owner role (%(owner)s).
--
-- Only objects of the current schema named as jobrunner names its own (agent_, api_,
-- console_, jobrunner_), so an application sharing the schema keeps its objects; never
-- the database itself (as REASSIGN OWNED would). A table's indexes and owned sequences
-- follow it. The role name reaches the DO block as a transaction-local setting: a DO
-- block takes no parameters.
DO $$
DECLARE
    target text := current_setting('jobrunner.new_owner');
    me oid := (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user);
    here oid := (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema());
    o record;
BEGIN
    FOR o IN
        SELECT format('ALTER %s %s OWNER TO %I',
                      CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                     ELSE 'TABLE' END,
                      c.oid::regclass, target) AS stmt
        FROM pg_class c
        WHERE c.relnamespace = here
          AND c.relkind IN ('r', 'p', 'v', 'S')
          AND c.relowner = me
          AND c.relname ~ '^(agent|api|console|jobrunner)_'
          AND NOT (c.relkind = 'S' AND EXISTS (  -- (moved with its table)
              SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND d.deptype = 'a'
                AND d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass))
        UNION ALL
        SELECT format('ALTER FUNCTION %s OWNER TO %I', p.oid::regprocedure, target)
        FROM pg_proc p
        WHERE p.pronamespace = here
          AND p.proowner = me AND p.proname ~ '^jobrunner_'
        UNION ALL
        SELECT format('ALTER %s %s OWNER TO %I',
                      CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END,
                      t.oid::regtype, target)
        FROM pg_type t
        WHERE t.typnamespace = here
          AND t.typowner = me
          AND t.typname ~ '^(agent|jobrunner)_' AND t.typtype IN ('d', 'c')
          AND (t.typtype = 'd' OR (SELECT c.relkind FROM pg_class c WHERE c.oid = t.typrelid) = 'c')
    LOOP
        EXECUTE o.stmt;
    END LOOP;
END
$$;

-- name: role_new_owner_set
-- Name the owner role for role_give_objects, until the transaction ends.
SELECT set_config('jobrunner.new_owner', %(owner)s, true);

-- name: component_role_record
-- Record which role a component uses (migrate grants it what a new migration adds).
INSERT INTO jobrunner_component_role (component, role_name) VALUES (%(component)s, %(role)s)
ON CONFLICT (component) DO UPDATE SET role_name = EXCLUDED.role_name;

-- name: component_role_list
-- The components' roles recorded by `jobrunner db grant` (none: the roles were never made).
SELECT component, role_name FROM jobrunner_component_role;

-- name: tenant_role_unbind
-- Forget every tenant a login role was bound to.
DELETE FROM jobrunner_tenant_role WHERE role_name = %(role)s;

-- name: tenant_role_bind
-- Bind a login role to these tenants (its sessions see only their rows).
INSERT INTO jobrunner_tenant_role (role_name, tenant_id)
SELECT %(role)s, t FROM unnest(%(tenants)s::text[]) AS t
ON CONFLICT DO NOTHING;

-- name: tenant_role_list
-- Every login role bound to tenants, with its tenants.
SELECT role_name, array_agg(tenant_id ORDER BY tenant_id) AS tenants
FROM jobrunner_tenant_role GROUP BY role_name ORDER BY role_name;

-- name: role_whoami
-- This session's role and the schema jobrunner's tables are in (the first of the search path).
SELECT current_user AS user_name, current_schema() AS schema_name;
