-- The web console (jobrunner/server/console/, docs/console.md): a role on every API key,
-- and the audit table of what the console's admins did.

-- role: what a key may do in the console. 'read' sees the pages; 'admin' may also act
-- (requeue dead tasks, cancel a batch). The default is 'read', for every key made before
-- this migration too: the console is read-only unless a key was made admin on purpose.
-- The Batch API ignores the role. A key of tenant '*' is an operator's key: the console
-- shows it every tenant, and the Batch API refuses it (jobrunner/server/context.py).
ALTER TABLE api_key ADD COLUMN role text NOT NULL DEFAULT 'read'
    CONSTRAINT api_key_role_check CHECK (role IN ('read', 'admin'));

-- One row per console action, written in the transaction that does it, so an action and
-- its record commit together (or neither does). Who (the key and its tenant), what
-- (action, batch, detail: the filter or task key it applied to), when, and how many
-- rows it changed. Never updated or deleted by jobrunner.
CREATE TABLE console_audit (
    id        bigserial PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    key_id    text NOT NULL,
    tenant_id text NOT NULL,
    action    text NOT NULL,
    batch_id  text,
    detail    jsonb,
    rows      bigint NOT NULL
);
-- A batch's page shows its own actions, newest first.
CREATE INDEX console_audit_by_batch ON console_audit (batch_id, id DESC);
