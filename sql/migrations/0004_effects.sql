-- The effects ledger: one row per (task, effect) that has been applied. The row is
-- written in the same transaction as the effect itself, so the effect and its record
-- commit together or not at all.
CREATE TABLE agent_task_effect (
    batch_id    text        NOT NULL,
    task_key    text        NOT NULL,
    effect_key  text        NOT NULL,
    task_id     bigint      NOT NULL,
    attempt     int         NOT NULL,
    lease_owner text        NOT NULL,
    result      jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (batch_id, task_key, effect_key)
);
