-- The OpenAI Files and Batches API (`jobrunner serve`, jobrunner/server/, docs/batch-api.md).
-- Its own tables: a batch of the API is a queue batch of the same id (agent_batch), whose
-- tasks are the input file's lines; these rows hold what the API shows on top.

-- API keys: only a hash of the secret is stored (sha256: the secrets are 32 random bytes,
-- so a slow hash adds nothing); the key is shown once by `jobrunner api-key create`.
CREATE TABLE api_key (
    key_id     text PRIMARY KEY,
    tenant_id  text NOT NULL,
    name       text,
    key_hash   bytea NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

-- Files: uploaded (purpose 'batch') and made from a batch's results (purpose
-- 'batch_output'). The row and its chunks are written in one transaction, so a file is
-- either whole or absent. idempotency_key: a client's Idempotency-Key header, if any.
CREATE TABLE api_file (
    file_id         text PRIMARY KEY,
    tenant_id       text NOT NULL,
    filename        text NOT NULL,
    purpose         text NOT NULL,
    bytes           bigint NOT NULL DEFAULT 0,
    lines           bigint NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz,
    idempotency_key text,
    UNIQUE (tenant_id, idempotency_key)
);
CREATE INDEX api_file_by_tenant ON api_file (tenant_id, created_at DESC, file_id DESC);
CREATE INDEX api_file_by_expiry ON api_file (expires_at) WHERE expires_at IS NOT NULL;

-- A file's content in chunks of about 1 MiB, in order. EXTERNAL: stored out of line
-- without compression, so an upload costs no compression CPU on the database.
CREATE TABLE api_file_chunk (
    file_id text NOT NULL REFERENCES api_file ON DELETE CASCADE,
    seq     int NOT NULL,
    data    bytea NOT NULL,
    PRIMARY KEY (file_id, seq)
);
ALTER TABLE api_file_chunk ALTER COLUMN data SET STORAGE EXTERNAL;

-- Batches. status: OpenAI's (in_progress, finalizing, completed, expired, cancelling,
-- cancelled; validating and failed are never stored: validation happens inside the create
-- request, and a bad file creates nothing). request counts are kept here once the batch
-- has ended; until then they are read from the queue.
CREATE TABLE api_batch (
    batch_id          text PRIMARY KEY,
    tenant_id         text NOT NULL,
    input_file_id     text NOT NULL,
    endpoint          text NOT NULL,
    completion_window text NOT NULL,
    metadata          jsonb,
    model             text,
    status            text NOT NULL,
    total             int NOT NULL,
    completed         int NOT NULL DEFAULT 0,
    failed            int NOT NULL DEFAULT 0,
    output_file_id    text,
    error_file_id     text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    in_progress_at    timestamptz,
    expires_at        timestamptz NOT NULL,
    finalizing_at     timestamptz,
    completed_at      timestamptz,
    failed_at         timestamptz,
    expired_at        timestamptz,
    cancelling_at     timestamptz,
    cancelled_at      timestamptz,
    idempotency_key   text,
    UNIQUE (tenant_id, idempotency_key)
);
CREATE INDEX api_batch_by_tenant ON api_batch (tenant_id, created_at DESC, batch_id DESC);
-- The batches the sweeper looks at: those not ended.
CREATE INDEX api_batch_open ON api_batch (expires_at)
    WHERE status IN ('in_progress', 'finalizing', 'cancelling');
