-- A tenant's budget in a worker pool: every batch of the tenant in the pool draws from one
-- budget of tokens and/or cost (docs/pools.md, "Flow control"; the Batch API's tenants:
-- docs/batch-api.md). A batch's own budget (agent_batch_usage) still applies as well.

-- The tenant's running totals in the pool, kept with each usage report of any of its
-- pool batches (usage_batch_add, same transaction as the batch's totals), and its budget.
-- The totals count every report since the row exists; the row is created by the first
-- report or the first budget, and this migration starts it from the totals of the
-- tenant's pool batches so far, so a budget set later covers the usage before it too.
-- The pool claim under flow control reads this one row per candidate (its primary key)
-- to leave out a tenant whose budget is spent.
CREATE TABLE agent_pool_tenant_usage (
    pool          text        NOT NULL,
    tenant_id     text        NOT NULL,
    budget_tokens bigint      CHECK (budget_tokens >= 0),
    budget_cost   numeric     CHECK (budget_cost >= 0),
    tokens        bigint      NOT NULL DEFAULT 0,
    input_tokens  bigint      NOT NULL DEFAULT 0,
    output_tokens bigint      NOT NULL DEFAULT 0,
    cost          numeric     NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, tenant_id)
);

INSERT INTO agent_pool_tenant_usage (pool, tenant_id, tokens, input_tokens, output_tokens, cost)
SELECT b.pool, b.tenant_id, sum(u.tokens), sum(u.input_tokens), sum(u.output_tokens),
       sum(u.cost)
FROM agent_batch_usage u JOIN agent_batch b USING (batch_id)
WHERE b.pool IS NOT NULL
GROUP BY b.pool, b.tenant_id;
