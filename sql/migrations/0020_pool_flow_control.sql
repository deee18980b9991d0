-- Flow control in worker pools (issue 26 item 8, issue 27 item 4; docs/pools.md, "Flow
-- control in a pool"): a pool batch may name limits and have a budget, claimed by
-- task_ack_and_claim_pool_limited.
--
-- jobrunner_limit_admit ranked the candidates under a limit by task id: a limit that
-- admits k of a claim's n candidates took the k oldest. A pool claim's candidates come
-- in fair order, (vtag, id), and ids say nothing about it (a tenant that enqueued first
-- has the smallest ids), so with a claim batch above 1 the id order would hand the
-- limit's room to the oldest batch, whatever the weights. The candidates are now ranked
-- by their position in p_ids, the order the claim passes them in: the pool claim passes
-- them in (vtag, id) order, task_ack_and_claim_limited in id order (its admissions are
-- unchanged). Nothing else differs from 0013.
CREATE OR REPLACE FUNCTION jobrunner_limit_admit(p_ids bigint[])
RETURNS SETOF jobrunner_admission
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    RETURN QUERY
    WITH wanted AS MATERIALIZED (
        -- (candidate, its rank in the claim's order, limit it names, its token estimate)
        SELECT q.id, array_position(p_ids, q.id) AS pos, w.name,
               coalesce(q.tokens, 0) AS tokens
        FROM agent_work_queue q, unnest(q.limits) AS w(name)
        WHERE q.id = ANY(p_ids)
    ),
    limit_conf AS MATERIALIZED (
        SELECT l.name, l.per_seconds, l.blocked_until FROM agent_limit l
        WHERE l.name = ANY(ARRAY(SELECT name FROM wanted))
    ),
    limit_lanes AS MATERIALIZED (
        SELECT ln.limit_name, ln.lane, ln.requests, ln.tokens, ln.max_concurrent,
               ln.request_tat, ln.token_tat, ln.acquired
        FROM limit_conf n
        CROSS JOIN LATERAL (
            SELECT x.limit_name, x.lane, x.requests, x.tokens, x.max_concurrent,
                   x.request_tat, x.token_tat, x.acquired
            FROM agent_limit_lane x
            WHERE x.limit_name = n.name
            ORDER BY greatest(CASE WHEN x.requests IS NOT NULL THEN x.request_tat END,
                              CASE WHEN x.tokens IS NOT NULL THEN x.token_tat END),
                     CASE WHEN x.max_concurrent IS NOT NULL THEN
                         (SELECT count(*) FROM agent_limit_lease s
                          WHERE s.limit_name = x.limit_name AND s.lane = x.lane) END,
                     x.lane
            LIMIT 1
            FOR NO KEY UPDATE OF x SKIP LOCKED) ln
    ),
    limit_clock AS MATERIALIZED (
        -- Read once every lane above is locked (the aggregate consumes limit_lanes
        -- first). A claim that locked a lane commits without waiting for its WAL flush
        -- (docs/flow-control.md: what a PostgreSQL crash may forget, and why
        -- at-least-once is unchanged).
        SELECT clock_timestamp() AS t,
               CASE WHEN count(*) > 0 THEN set_config('synchronous_commit', 'off', true) END
                   AS async
        FROM limit_lanes
    ),
    limit_live AS MATERIALIZED (
        SELECT k.limit_name, k.lane,
               (SELECT count(*) FROM agent_limit_lease s
                WHERE s.limit_name = k.limit_name AND s.lane = k.lane)
               + k.acquired
               - coalesce((SELECT a.acquired FROM agent_limit_lane a
                           WHERE a.limit_name = k.limit_name AND a.lane = k.lane), 0) AS live
        FROM limit_lanes k
        WHERE k.max_concurrent IS NOT NULL
    )
    SELECT w.id, w.name, k.lane, w.tokens,
           coalesce(k.lane IS NOT NULL
           AND (f.blocked_until IS NULL OR f.blocked_until <= c.t)
           AND (k.requests IS NULL OR (w.rank <= k.requests AND k.request_tat
                + make_interval(secs => (w.rank - 1) * f.per_seconds / k.requests) <= c.t))
           AND (k.tokens IS NULL OR (w.tokens_before <= k.tokens AND k.token_tat
                + make_interval(secs => w.tokens_before * f.per_seconds / k.tokens) <= c.t))
           AND (k.max_concurrent IS NULL OR v.live + w.rank <= k.max_concurrent), false),
           k.lane IS NULL AND f.name IS NOT NULL,
           c.t
    FROM (SELECT x.id, x.name, x.tokens,
                 row_number() OVER (PARTITION BY x.name ORDER BY x.pos) AS rank,
                 coalesce(sum(x.tokens) OVER (PARTITION BY x.name ORDER BY x.pos
                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                     AS tokens_before
          FROM wanted x) w
    CROSS JOIN limit_clock c
    LEFT JOIN limit_conf f ON f.name = w.name
    LEFT JOIN limit_lanes k ON k.limit_name = w.name
    LEFT JOIN limit_live v ON v.limit_name = w.name;
END
$fn$;

-- The pool's virtual time now, where a new stream's tags start: no longer the smallest tag
-- of a due pending task alone, but at least the largest tag of a task the pool's workers
-- hold (the service's frontier: claims take tags in order, so the newest claims carry the
-- largest tags).
--
-- With flow control a stream can be held back while the others are served: a tenant whose
-- limit is full, paused by a 429 or whose budget is spent keeps its oldest tasks pending
-- at small tags while the rest of the pool moves on. The smallest due pending tag is then
-- that held stream's, far behind the frontier, and a tenant arriving would be laid there:
-- ahead of every pending task of the streams being served, it would take every claim
-- until its tags caught up with theirs (credit for idleness, which docs/pools.md rules
-- out). The frontier is where the service is: a newcomer joins the streams being served
-- at their pace. Without flow control the two agree, give or take the claims in flight
-- (and a retried or shard-blocked task no longer pulls the newcomer back either). With
-- nothing leased at the moment of the enqueue, the smallest due pending tag is all there
-- is (docs/pools.md says so).
--
-- The leased tasks are found per tenant of the pool (agent_batch's pool index, then the
-- leased index by tenant: a tenant's live leases), at an enqueue, under the pool's lock:
-- never in a claim.
CREATE OR REPLACE FUNCTION jobrunner_pool_now(p_pool text) RETURNS float8
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(
        greatest(
            (SELECT q.vtag FROM agent_work_queue q
             WHERE q.pool = p_pool AND q.status = 'pending' AND q.run_after <= clock_timestamp()
             ORDER BY q.vtag, q.id LIMIT 1),
            (SELECT max(l.vtag)
             FROM (SELECT DISTINCT b.tenant_id FROM agent_batch b WHERE b.pool = p_pool) t
             CROSS JOIN LATERAL (
                 SELECT max(q.vtag) AS vtag FROM agent_work_queue q
                 WHERE q.tenant_id = t.tenant_id AND q.status = 'leased'
                   AND q.pool = p_pool) l)),
        (SELECT p.vclock FROM agent_pool p WHERE p.pool = p_pool),
        0)
$$;
