-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
--
-- The console's audit (console_audit, sql/schema.sql; jobrunner/store/audit.py): one row
-- per action, written in the action's own transaction.

-- name: audit_insert
-- Record one console action: who (key, tenant), what (action, batch, detail), how many rows.
INSERT INTO console_audit (key_id, tenant_id, action, batch_id, detail, rows)
VALUES (%(key_id)s, %(tenant_id)s, %(action)s, %(batch_id)s, %(detail)s::jsonb, %(rows)s)
RETURNING id, at;

-- name: audit_list
-- The newest console actions (on one batch, or all; on one tenant's batches, or any tenant's).
-- An action on no batch (a schedule's trigger) is its key's tenant's; an operator's
-- (tenant '*': limits, pools) is no tenant's.
SELECT a.id, a.at, a.key_id, k.name AS key_name, a.tenant_id, a.action, a.batch_id,
       a.detail::text AS detail, a.rows
FROM console_audit a
LEFT JOIN api_key k ON k.key_id = a.key_id
LEFT JOIN agent_batch b ON b.batch_id = a.batch_id
WHERE (%(batch_id)s::text IS NULL OR a.batch_id = %(batch_id)s)
  AND (%(tenant_id)s::text IS NULL OR COALESCE(b.tenant_id, a.tenant_id) = %(tenant_id)s)
ORDER BY a.id DESC
LIMIT %(limit)s;
