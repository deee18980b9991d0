-- The article's table, kept as is: the contract every later migration extends.
CREATE TABLE agent_work_queue (
    id           bigserial PRIMARY KEY,
    tenant_id    text        NOT NULL,
    shard_key    text,
    payload      jsonb       NOT NULL,
    status       text        NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'leased', 'done', 'dead')),
    run_after    timestamptz NOT NULL DEFAULT now(),
    locked_until timestamptz,
    lease_owner  text,
    attempts     int         NOT NULL DEFAULT 0,
    max_attempts int         NOT NULL DEFAULT 8,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX agent_work_queue_pending_idx
    ON agent_work_queue (run_after, id) WHERE status = 'pending';
