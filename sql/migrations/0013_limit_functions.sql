-- The limits' part of the claim (ack_and_claim_limited) as two functions: admit, which
-- locks one lane per limit and says which candidates it admits, and charge, which
-- charges the lanes for the tasks finally claimed (docs/flow-control.md, "Why the
-- lanes are locked in functions").
--
-- Why functions: lanes are rows that every claim of a limit updates. Locked or updated
-- from inside the claim statement, a lane another claim changed after this statement's
-- snapshot is re-read by EvalPlanQual, and PostgreSQL starts every EvalPlanQual recheck
-- by initialising *all* the subplans of the statement (every CTE of the claim): with 4
-- workers on a limit that never binds, that made each claim cost 2.4 times the server
-- CPU of the same claim without contention (59 % of the unlimited throughput). A
-- VOLATILE function's statements each take a fresh snapshot, so the lane it locks is
-- already the newest version (a recheck, when a commit slips in between, re-runs only
-- the function's small statement), and the charge, under the same lock, sees it too.
--
-- Semantics are those of the single statement before (0010 and sql/queries.sql): for
-- each limit the candidates name, one free lane (FOR NO KEY UPDATE SKIP LOCKED, never
-- waited for; preferred: earliest TAT, then fewest live leases), the clock read after
-- every lane is locked, GCRA admission per candidate in id order, live leases counted
-- as the rows this snapshot sees plus the slots the lane handed out since.

-- One candidate under one limit: the lane of that limit this claim locked (NULL: every
-- lane was held by other claims), whether the limit admits it, at what clock.
CREATE TYPE jobrunner_admission AS (
    task_id  bigint,
    name     text,
    lane     int,
    tokens   bigint,
    ok       boolean,
    wait     boolean,   -- every lane of an existing limit was held: come back at once
    clock    timestamptz
);

-- p_ids: the claim's candidates that name limits, locked by the claim (their limits and
-- estimates are read here: one array in, one subplan less in the claim).
CREATE FUNCTION jobrunner_limit_admit(p_ids bigint[])
RETURNS SETOF jobrunner_admission
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    RETURN QUERY
    WITH wanted AS MATERIALIZED (
        -- (candidate, limit it names, its token estimate)
        SELECT q.id, w.name, coalesce(q.tokens, 0) AS tokens
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
                 row_number() OVER (PARTITION BY x.name ORDER BY x.id) AS rank,
                 coalesce(sum(x.tokens) OVER (PARTITION BY x.name ORDER BY x.id
                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                     AS tokens_before
          FROM wanted x) w
    CROSS JOIN limit_clock c
    LEFT JOIN limit_conf f ON f.name = w.name
    LEFT JOIN limit_lanes k ON k.limit_name = w.name
    LEFT JOIN limit_live v ON v.limit_name = w.name;
END
$fn$;

-- Charge the lanes admit locked for the tasks finally claimed (p_chosen: the claim may
-- lose a shard race after admission), at the clock of the admission; a slot row per
-- task under a limit with slots. Returns the clock (the claim stamps it on the tasks).
CREATE FUNCTION jobrunner_limit_charge(p_admitted jobrunner_admission[], p_chosen bigint[])
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    p_ids bigint[];
    p_names text[];
    p_lanes int[];
    p_tokens bigint[];
    p_clock timestamptz;
BEGIN
    SELECT array_agg(a.task_id), array_agg(a.name), array_agg(a.lane), array_agg(a.tokens),
           max(a.clock)
    INTO p_ids, p_names, p_lanes, p_tokens, p_clock
    FROM unnest(p_admitted) AS a
    WHERE a.task_id = ANY(p_chosen);
    IF p_ids IS NULL THEN
        RETURN NULL;
    END IF;

    UPDATE agent_limit_lane l
    SET request_tat = CASE WHEN l.requests IS NULL THEN l.request_tat
                           ELSE greatest(l.request_tat, p_clock)
                                + make_interval(secs => g.n * f.per_seconds / l.requests) END,
        token_tat = CASE WHEN l.tokens IS NULL THEN l.token_tat
                         ELSE greatest(l.token_tat, p_clock)
                              + make_interval(secs => g.tokens * f.per_seconds / l.tokens) END,
        acquired = l.acquired + CASE WHEN l.max_concurrent IS NULL THEN 0 ELSE g.n END
    FROM (SELECT u.name, u.lane, count(*) AS n, sum(u.tokens) AS tokens
          FROM unnest(p_names, p_lanes, p_tokens) AS u(name, lane, tokens)
          GROUP BY u.name, u.lane) g
    JOIN agent_limit f ON f.name = g.name
    WHERE (l.limit_name, l.lane) = (g.name, g.lane);

    INSERT INTO agent_limit_lease (limit_name, task_id, lane)
    SELECT u.name, u.id, u.lane
    FROM unnest(p_ids, p_names, p_lanes) AS u(id, name, lane)
    JOIN agent_limit_lane x ON (x.limit_name, x.lane) = (u.name, u.lane)
    WHERE x.max_concurrent IS NOT NULL
    ON CONFLICT DO NOTHING;

    RETURN p_clock;
END
$fn$;
