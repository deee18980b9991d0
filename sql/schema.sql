-- The current schema, as the migrations in sql/migrations build it (PostgreSQL 18).
-- Generated: do not edit. `python hack/schema.py` (or `python -m jobrunner.store.schema
-- --dsn <an empty database>`) writes it again; tests/test_schema.py checks it is current.

CREATE DOMAIN public.agent_task_status AS text
	CONSTRAINT agent_task_status_check CHECK ((VALUE = ANY (ARRAY['pending'::text, 'leased'::text, 'done'::text, 'dead'::text, 'cancelled'::text])));

CREATE TYPE public.jobrunner_admission AS (
	task_id bigint,
	name text,
	lane integer,
	tokens bigint,
	ok boolean,
	wait boolean,
	clock timestamp with time zone
);

CREATE FUNCTION public.agent_worker_wait_can_ring() RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path TO '$user', 'public'
    AS $$
SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
    OR pg_has_role(current_user, session_user, 'USAGE')
    OR (pg_has_role(current_user, 'pg_signal_backend', 'USAGE')
        AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = session_user))
$$;

CREATE FUNCTION public.agent_worker_wait_ring(p_ids bigint[], p_pids integer[], p_note text) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO '$user', 'public'
    AS $$
DECLARE
    asleep integer[] := '{}';
    k integer;
    n integer := 0;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        k := jobrunner_wait_key(p_ids[i]);
        PERFORM pg_advisory_xact_lock_shared(1246970230, k);
        IF pg_try_advisory_xact_lock(1246970231, k) OR p_pids[i] IS NULL THEN
            PERFORM pg_notify('jobrunner_wake_' || p_ids[i], p_note);
        ELSE
            asleep := asleep || i;
        END IF;
        n := n + 1;
    END LOOP;
    IF cardinality(asleep) > 0 THEN
        FOR k IN
            SELECT l.pid FROM pg_locks l, unnest(asleep) i
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid = 1246970231 AND l.objid = jobrunner_wait_key(p_ids[i])::oid
              AND l.pid = p_pids[i]
        LOOP
            BEGIN
                PERFORM pg_cancel_backend(k);
            EXCEPTION WHEN insufficient_privilege THEN
                NULL;  -- (can_ring said no to that session: it LISTENs and polls instead)
            END;
        END LOOP;
    END IF;
    RETURN n;
END
$$;

CREATE FUNCTION public.agent_worker_wait_sleep(p_ids bigint[], p_seconds double precision, p_lead boolean, OUT gone bigint[], OUT leader boolean) RETURNS record
    LANGUAGE plpgsql
    AS $$
DECLARE
    i bigint;
BEGIN
    gone := '{}';
    leader := p_lead AND pg_try_advisory_lock(jobrunner_leader_key());
    FOREACH i IN ARRAY p_ids LOOP
        -- Wait for the ringers still in their transaction, without keeping RUNG: a block
        -- rolled back gives back the locks it took (and it never holds one RUNG while it
        -- waits for another: a ringer of several rows holds some).
        BEGIN
            PERFORM pg_advisory_xact_lock(1246970230, jobrunner_wait_key(i));
            RAISE SQLSTATE 'JRW01';
        EXCEPTION WHEN SQLSTATE 'JRW01' THEN
            NULL;
        END;
        PERFORM pg_advisory_xact_lock_shared(1246970231, jobrunner_wait_key(i));
        PERFORM 1 FROM agent_worker_wait w WHERE w.wait_id = i;
        IF NOT FOUND THEN
            gone := gone || i;
        END IF;
    END LOOP;
    -- (a try that won returns at once: the new leader's maintenance waits for it)
    IF cardinality(gone) = 0 AND p_seconds > 0 AND NOT leader THEN
        PERFORM pg_sleep(p_seconds);
    END IF;
END
$$;

CREATE FUNCTION public.jobrunner_batch_settled(p_batch_id text, p_on_dead text) RETURNS boolean
    LANGUAGE sql STABLE
    AS $$
    SELECT EXISTS (SELECT 1 FROM agent_task_key k
                   WHERE k.batch_id = p_batch_id
                     AND k.task_key NOT IN ('__reduce__', '__generate__'))
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.batch_id = p_batch_id AND q.status = 'pending')
       AND NOT EXISTS (SELECT 1 FROM agent_work_queue q
                       WHERE q.tenant_id = (SELECT b.tenant_id FROM agent_batch b
                                            WHERE b.batch_id = p_batch_id)
                         AND q.batch_id = p_batch_id AND q.status = 'leased')
       AND NOT EXISTS (SELECT 1 FROM agent_task_key k
                       JOIN agent_work_queue q ON q.id = k.task_id
                       WHERE k.batch_id = p_batch_id AND k.task_key = '__generate__'
                         AND q.status IN ('dead', 'cancelled'))
       AND (p_on_dead IN ('skip', 'include')
            OR NOT EXISTS (SELECT 1 FROM agent_work_queue q
                           WHERE q.batch_id = p_batch_id AND q.status = 'dead'))
$$;

CREATE FUNCTION public.jobrunner_leader_key() RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT hashtext('jobrunner-maintenance-leader')::bigint $$;

CREATE FUNCTION public.jobrunner_limit_admit(p_ids bigint[]) RETURNS SETOF public.jobrunner_admission
    LANGUAGE plpgsql
    AS $$
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
$$;

CREATE FUNCTION public.jobrunner_limit_charge(p_admitted public.jobrunner_admission[], p_chosen bigint[]) RETURNS timestamp with time zone
    LANGUAGE plpgsql
    AS $$
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
$$;

CREATE FUNCTION public.jobrunner_pool_now(p_pool text) RETURNS double precision
    LANGUAGE sql
    AS $$
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

CREATE FUNCTION public.jobrunner_pool_relay(p_pool text, p_tenant text, p_priority integer, p_start double precision, p_stride double precision) RETURNS double precision
    LANGUAGE plpgsql
    AS $$
DECLARE
    n bigint;
    last float8;
BEGIN
    WITH pending AS (
        SELECT q.id,
               row_number() OVER (PARTITION BY q.batch_id ORDER BY q.vtag, q.id) AS k,
               b.created_at, b.batch_id
        FROM agent_batch b
        JOIN agent_work_queue q ON q.batch_id = b.batch_id AND q.status = 'pending'
        WHERE b.pool = p_pool AND b.tenant_id = p_tenant AND b.priority = p_priority
          AND b.cancelled_at IS NULL
    ),
    ranked AS (
        SELECT id, row_number() OVER (ORDER BY k, created_at, batch_id) AS j FROM pending
    )
    -- (the first at p_start: the stream's next task keeps its turn)
    UPDATE agent_work_queue q SET vtag = p_start + (r.j - 1) * p_stride
    FROM ranked r
    WHERE q.id = r.id AND q.status = 'pending';
    GET DIAGNOSTICS n = ROW_COUNT;
    last := p_start + greatest(n - 1, 0) * p_stride;
    INSERT INTO agent_pool_stream AS s (pool, tenant_id, priority, last_tag)
    VALUES (p_pool, p_tenant, p_priority, last)
    ON CONFLICT (pool, tenant_id, priority) DO UPDATE SET last_tag = EXCLUDED.last_tag;
    UPDATE agent_pool SET vclock = greatest(vclock, last) WHERE pool = p_pool;
    RETURN last;
END
$$;

CREATE FUNCTION public.jobrunner_pool_set_weight(p_pool text, p_tenant text, p_weight double precision) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
DECLARE
    v float8;
    p int;
    streams bigint := 0;
BEGIN
    INSERT INTO agent_pool (pool) VALUES (p_pool) ON CONFLICT (pool) DO NOTHING;
    PERFORM 1 FROM agent_pool WHERE pool = p_pool FOR UPDATE;
    INSERT INTO agent_pool_tenant AS t (pool, tenant_id, weight)
    VALUES (p_pool, p_tenant, p_weight)
    ON CONFLICT (pool, tenant_id) DO UPDATE SET weight = EXCLUDED.weight, updated_at = now();
    v := jobrunner_pool_now(p_pool);
    FOR p IN SELECT DISTINCT b.priority FROM agent_batch b
             WHERE b.pool = p_pool AND b.tenant_id = p_tenant AND b.cancelled_at IS NULL
             ORDER BY 1
    LOOP
        PERFORM jobrunner_pool_relay(p_pool, p_tenant, p, v,
                                     jobrunner_pool_stride(p_pool, p_tenant, p));
        streams := streams + 1;
    END LOOP;
    RETURN streams;
END
$$;

CREATE FUNCTION public.jobrunner_pool_start(p_pool text, p_tenant text, p_priority integer, p_batch text, OUT vstart double precision, OUT vstride double precision, OUT relay boolean) RETURNS record
    LANGUAGE plpgsql
    AS $$
DECLARE
    v float8;
    last float8;
BEGIN
    INSERT INTO agent_pool (pool) VALUES (p_pool) ON CONFLICT (pool) DO NOTHING;
    PERFORM 1 FROM agent_pool WHERE pool = p_pool FOR UPDATE;
    v := jobrunner_pool_now(p_pool);
    vstride := jobrunner_pool_stride(p_pool, p_tenant, p_priority);
    relay := NOT EXISTS (SELECT 1 FROM agent_work_queue q
                         WHERE q.batch_id = p_batch AND q.status = 'pending')
             AND EXISTS (SELECT 1 FROM agent_batch b
                         WHERE b.pool = p_pool AND b.tenant_id = p_tenant
                           AND b.priority = p_priority AND b.batch_id <> p_batch
                           AND b.cancelled_at IS NULL
                           AND EXISTS (SELECT 1 FROM agent_work_queue q
                                       WHERE q.batch_id = b.batch_id AND q.status = 'pending'));
    IF relay THEN
        vstart := v;
    ELSE
        SELECT s.last_tag INTO last FROM agent_pool_stream s
        WHERE s.pool = p_pool AND s.tenant_id = p_tenant AND s.priority = p_priority;
        -- an idle stream starts at the pool's time now: it banks no credit while idle
        vstart := greatest(v, coalesce(last, v));
    END IF;
END
$$;

CREATE FUNCTION public.jobrunner_pool_stride(p_pool text, p_tenant text, p_priority integer) RETURNS double precision
    LANGUAGE sql STABLE
    AS $$
    SELECT 1.0 / (coalesce((SELECT t.weight FROM agent_pool_tenant t
                            WHERE t.pool = p_pool AND t.tenant_id = p_tenant), 1)
                  * power(10.0, p_priority))::float8
$$;

CREATE FUNCTION public.jobrunner_shard_take(p_tenant text, p_shard text) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
BEGIN
    -- (two int4 keys: a lock space apart from the bigint keys of migrate.py and of
    -- applications; a hash collision only makes two shards skip each other while both
    -- are being claimed at the same instant)
    IF NOT pg_try_advisory_xact_lock(1246970229, hashtext(p_tenant || '/' || p_shard)) THEN
        RETURN false;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM agent_work_queue l
                       WHERE l.tenant_id = p_tenant AND l.shard_key = p_shard
                         AND l.status = 'leased');
END
$$;

CREATE FUNCTION public.jobrunner_task_key_delete() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    -- (one index probe per deleted task; task_id so that only this task's key goes)
    DELETE FROM agent_task_key
    WHERE batch_id = OLD.batch_id AND task_key = OLD.task_key AND task_id = OLD.id;
    RETURN NULL;
END
$$;

CREATE FUNCTION public.jobrunner_task_key_fixed() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'a task''s batch_id and task_key cannot change (task %)', OLD.id
        USING ERRCODE = 'feature_not_supported';
END
$$;

CREATE FUNCTION public.jobrunner_task_key_insert() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    -- (NEW.id is already drawn from the sequence: defaults come before BEFORE triggers)
    INSERT INTO agent_task_key (batch_id, task_key, task_id)
    VALUES (NEW.batch_id, NEW.task_key, NEW.id)
    ON CONFLICT (batch_id, task_key) DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;  -- the key exists: this task is not inserted, as ON CONFLICT DO NOTHING
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION public.jobrunner_task_key_truncate() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    TRUNCATE agent_task_key;
    RETURN NULL;
END
$$;

CREATE FUNCTION public.jobrunner_wait_key(p_wait_id bigint) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT (p_wait_id & 2147483647)::integer $$;

CREATE TABLE public.agent_batch (
    batch_id text NOT NULL,
    tenant_id text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    cancelled_at timestamp with time zone,
    tasks bigint DEFAULT 0 NOT NULL,
    flow_control boolean DEFAULT false NOT NULL,
    reduce jsonb,
    reduce_enqueued_at timestamp with time zone,
    result jsonb,
    result_bytes bigint,
    reduced_at timestamp with time zone,
    generator jsonb,
    pool text,
    priority integer DEFAULT 0 NOT NULL,
    handler text,
    CONSTRAINT agent_batch_priority_check CHECK (((priority >= '-3'::integer) AND (priority <= 3)))
);

ALTER TABLE ONLY public.agent_batch FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_batch_usage (
    batch_id text NOT NULL,
    budget_tokens bigint,
    budget_cost numeric,
    tokens bigint DEFAULT 0 NOT NULL,
    input_tokens bigint DEFAULT 0 NOT NULL,
    output_tokens bigint DEFAULT 0 NOT NULL,
    cost numeric DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT agent_batch_usage_budget_cost_check CHECK ((budget_cost >= (0)::numeric)),
    CONSTRAINT agent_batch_usage_budget_tokens_check CHECK ((budget_tokens >= 0))
);

ALTER TABLE ONLY public.agent_batch_usage FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_limit (
    name text NOT NULL,
    requests bigint,
    tokens bigint,
    per_seconds double precision DEFAULT 60 NOT NULL,
    max_concurrent integer,
    lanes integer DEFAULT 1 NOT NULL,
    blocked_until timestamp with time zone,
    blocked_seconds double precision DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT agent_limit_check CHECK (((requests IS NOT NULL) OR (tokens IS NOT NULL) OR (max_concurrent IS NOT NULL))),
    CONSTRAINT agent_limit_lanes_check CHECK (((lanes >= 1) AND (lanes <= 64))),
    CONSTRAINT agent_limit_max_concurrent_check CHECK ((max_concurrent > 0)),
    CONSTRAINT agent_limit_per_seconds_check CHECK ((per_seconds > (0)::double precision)),
    CONSTRAINT agent_limit_requests_check CHECK ((requests > 0)),
    CONSTRAINT agent_limit_tokens_check CHECK ((tokens > 0))
);

CREATE TABLE public.agent_limit_lane (
    limit_name text NOT NULL,
    lane integer NOT NULL,
    requests bigint,
    tokens double precision,
    max_concurrent integer,
    request_tat timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    token_tat timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    acquired bigint DEFAULT 0 NOT NULL
)
WITH (autovacuum_vacuum_scale_factor='0.0', autovacuum_vacuum_threshold='500');

CREATE TABLE public.agent_limit_lease (
    limit_name text NOT NULL,
    task_id bigint NOT NULL,
    lane integer NOT NULL
)
WITH (autovacuum_vacuum_scale_factor='0.0', autovacuum_vacuum_threshold='500');

CREATE TABLE public.agent_pool (
    pool text NOT NULL,
    vclock double precision DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.agent_pool_stream (
    pool text NOT NULL,
    tenant_id text NOT NULL,
    priority integer NOT NULL,
    last_tag double precision NOT NULL
);

ALTER TABLE ONLY public.agent_pool_stream FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_pool_tenant (
    pool text NOT NULL,
    tenant_id text NOT NULL,
    weight double precision DEFAULT 1 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT agent_pool_tenant_weight_check CHECK (((weight >= (0.001)::double precision) AND (weight <= (1000)::double precision)))
);

ALTER TABLE ONLY public.agent_pool_tenant FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_pool_tenant_usage (
    pool text NOT NULL,
    tenant_id text NOT NULL,
    budget_tokens bigint,
    budget_cost numeric,
    tokens bigint DEFAULT 0 NOT NULL,
    input_tokens bigint DEFAULT 0 NOT NULL,
    output_tokens bigint DEFAULT 0 NOT NULL,
    cost numeric DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT agent_pool_tenant_usage_budget_cost_check CHECK ((budget_cost >= (0)::numeric)),
    CONSTRAINT agent_pool_tenant_usage_budget_tokens_check CHECK ((budget_tokens >= 0))
);

ALTER TABLE ONLY public.agent_pool_tenant_usage FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_schedule (
    namespace text NOT NULL,
    name text NOT NULL,
    tenant_id text NOT NULL,
    schedule text NOT NULL,
    time_zone text,
    suspend boolean NOT NULL,
    concurrency_policy text NOT NULL,
    ready text NOT NULL,
    message text NOT NULL,
    next_run_at timestamp with time zone,
    last_schedule_at timestamp with time zone,
    last_successful_at timestamp with time zone,
    active_runs text[] DEFAULT '{}'::text[] NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

ALTER TABLE ONLY public.agent_schedule FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_schedule_trigger (
    id bigint NOT NULL,
    namespace text NOT NULL,
    name text NOT NULL,
    tenant_id text NOT NULL,
    requested_by text NOT NULL,
    requested_at timestamp with time zone DEFAULT now() NOT NULL,
    taken_at timestamp with time zone,
    outcome text,
    run_name text,
    message text,
    CONSTRAINT agent_schedule_trigger_outcome_check CHECK ((outcome = ANY (ARRAY['started'::text, 'refused'::text]))),
    CONSTRAINT agent_schedule_trigger_taken_check CHECK (((taken_at IS NULL) = (outcome IS NULL)))
);

ALTER TABLE ONLY public.agent_schedule_trigger FORCE ROW LEVEL SECURITY;

CREATE SEQUENCE public.agent_schedule_trigger_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.agent_schedule_trigger_id_seq OWNED BY public.agent_schedule_trigger.id;

CREATE TABLE public.agent_shard_lease (
    tenant_id text NOT NULL,
    shard_key text NOT NULL,
    task_id bigint NOT NULL,
    lease_owner text NOT NULL,
    leased_at timestamp with time zone DEFAULT now() NOT NULL
)
WITH (autovacuum_vacuum_scale_factor='0.0', autovacuum_vacuum_threshold='500');

ALTER TABLE ONLY public.agent_shard_lease FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_task_attempt (
    task_id bigint NOT NULL,
    attempt integer NOT NULL,
    ended_at timestamp with time zone DEFAULT now() NOT NULL,
    batch_id text NOT NULL,
    tenant_id text NOT NULL,
    worker text,
    started_at timestamp with time zone,
    outcome text NOT NULL,
    status text NOT NULL,
    error text,
    CONSTRAINT agent_task_attempt_outcome_check CHECK ((outcome = ANY (ARRAY['failed'::text, 'rate_limited'::text, 'released'::text, 'expired'::text])))
);

ALTER TABLE ONLY public.agent_task_attempt FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_task_effect (
    batch_id text NOT NULL,
    task_key text NOT NULL,
    effect_key text NOT NULL,
    task_id bigint NOT NULL,
    attempt integer NOT NULL,
    lease_owner text NOT NULL,
    result jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

ALTER TABLE ONLY public.agent_task_effect FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_task_key (
    batch_id text NOT NULL,
    task_key text NOT NULL,
    task_id bigint NOT NULL
);

ALTER TABLE ONLY public.agent_task_key FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_task_usage (
    task_id bigint NOT NULL,
    attempt integer NOT NULL,
    batch_id text NOT NULL,
    task_key text NOT NULL,
    tokens bigint DEFAULT 0 NOT NULL,
    input_tokens bigint DEFAULT 0 NOT NULL,
    output_tokens bigint DEFAULT 0 NOT NULL,
    cost numeric DEFAULT 0 NOT NULL,
    reports integer DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);

ALTER TABLE ONLY public.agent_task_usage FORCE ROW LEVEL SECURITY;

CREATE TABLE public.agent_work_queue (
    id bigint NOT NULL,
    tenant_id text NOT NULL,
    shard_key text,
    payload jsonb NOT NULL,
    status public.agent_task_status DEFAULT 'pending'::text NOT NULL,
    run_after timestamp with time zone DEFAULT now() NOT NULL,
    locked_until timestamp with time zone,
    lease_owner text,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 8 NOT NULL,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    batch_id text NOT NULL,
    task_key text NOT NULL,
    result jsonb,
    finished_at timestamp with time zone,
    limits text[],
    tokens bigint,
    throttles integer,
    pool text,
    vtag double precision,
    trace_context jsonb,
    leased_at timestamp with time zone
)
WITH (autovacuum_vacuum_scale_factor='0.01', autovacuum_vacuum_threshold='1000', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_limit='2000', fillfactor='80');

ALTER TABLE ONLY public.agent_work_queue FORCE ROW LEVEL SECURITY;

CREATE SEQUENCE public.agent_work_queue_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.agent_work_queue_id_seq OWNED BY public.agent_work_queue.id;

CREATE TABLE public.agent_work_queue_archive (
    id bigint DEFAULT nextval('public.agent_work_queue_id_seq'::regclass) CONSTRAINT agent_work_queue_id_not_null NOT NULL,
    tenant_id text CONSTRAINT agent_work_queue_tenant_id_not_null NOT NULL,
    shard_key text,
    payload jsonb CONSTRAINT agent_work_queue_payload_not_null NOT NULL,
    status text DEFAULT 'pending'::text CONSTRAINT agent_work_queue_status_not_null NOT NULL,
    run_after timestamp with time zone DEFAULT now() CONSTRAINT agent_work_queue_run_after_not_null NOT NULL,
    locked_until timestamp with time zone,
    lease_owner text,
    attempts integer DEFAULT 0 CONSTRAINT agent_work_queue_attempts_not_null NOT NULL,
    max_attempts integer DEFAULT 8 CONSTRAINT agent_work_queue_max_attempts_not_null NOT NULL,
    last_error text,
    created_at timestamp with time zone DEFAULT now() CONSTRAINT agent_work_queue_created_at_not_null NOT NULL,
    updated_at timestamp with time zone DEFAULT now() CONSTRAINT agent_work_queue_updated_at_not_null NOT NULL,
    batch_id text CONSTRAINT agent_work_queue_batch_id_not_null NOT NULL,
    task_key text CONSTRAINT agent_work_queue_task_key_not_null NOT NULL,
    result jsonb,
    finished_at timestamp with time zone,
    limits text[],
    tokens bigint,
    throttles integer,
    pool text,
    vtag double precision,
    trace_context jsonb,
    leased_at timestamp with time zone
);

ALTER TABLE ONLY public.agent_work_queue_archive FORCE ROW LEVEL SECURITY;

CREATE UNLOGGED TABLE public.agent_worker_wait (
    wait_id bigint NOT NULL,
    batch_id text,
    pool text,
    seen_at timestamp with time zone DEFAULT now() NOT NULL,
    pid integer,
    CONSTRAINT agent_worker_wait_check CHECK (((batch_id IS NULL) <> (pool IS NULL)))
);

ALTER TABLE ONLY public.agent_worker_wait FORCE ROW LEVEL SECURITY;

CREATE TABLE public.api_batch (
    batch_id text NOT NULL,
    tenant_id text NOT NULL,
    input_file_id text NOT NULL,
    endpoint text NOT NULL,
    completion_window text NOT NULL,
    metadata jsonb,
    model text,
    status text NOT NULL,
    total integer NOT NULL,
    completed integer DEFAULT 0 NOT NULL,
    failed integer DEFAULT 0 NOT NULL,
    output_file_id text,
    error_file_id text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    in_progress_at timestamp with time zone,
    expires_at timestamp with time zone NOT NULL,
    finalizing_at timestamp with time zone,
    completed_at timestamp with time zone,
    failed_at timestamp with time zone,
    expired_at timestamp with time zone,
    cancelling_at timestamp with time zone,
    cancelled_at timestamp with time zone,
    idempotency_key text
);

ALTER TABLE ONLY public.api_batch FORCE ROW LEVEL SECURITY;

CREATE TABLE public.api_file (
    file_id text NOT NULL,
    tenant_id text NOT NULL,
    filename text NOT NULL,
    purpose text NOT NULL,
    bytes bigint DEFAULT 0 NOT NULL,
    lines bigint DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    expires_at timestamp with time zone,
    idempotency_key text
);

ALTER TABLE ONLY public.api_file FORCE ROW LEVEL SECURITY;

CREATE TABLE public.api_file_chunk (
    file_id text NOT NULL,
    seq integer NOT NULL,
    data bytea NOT NULL
);
ALTER TABLE ONLY public.api_file_chunk ALTER COLUMN data SET STORAGE EXTERNAL;

ALTER TABLE ONLY public.api_file_chunk FORCE ROW LEVEL SECURITY;

CREATE TABLE public.api_key (
    key_id text NOT NULL,
    tenant_id text NOT NULL,
    name text,
    key_hash bytea NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    revoked_at timestamp with time zone,
    role text DEFAULT 'read'::text NOT NULL,
    CONSTRAINT api_key_role_check CHECK ((role = ANY (ARRAY['read'::text, 'admin'::text])))
);

ALTER TABLE ONLY public.api_key FORCE ROW LEVEL SECURITY;

CREATE TABLE public.console_audit (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    key_id text NOT NULL,
    tenant_id text NOT NULL,
    action text NOT NULL,
    batch_id text,
    detail jsonb,
    rows bigint NOT NULL
);

ALTER TABLE ONLY public.console_audit FORCE ROW LEVEL SECURITY;

CREATE SEQUENCE public.console_audit_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.console_audit_id_seq OWNED BY public.console_audit.id;

CREATE TABLE public.jobrunner_component_role (
    component text NOT NULL,
    role_name name NOT NULL,
    CONSTRAINT jobrunner_component_role_component_check CHECK ((component = ANY (ARRAY['owner'::text, 'operator'::text, 'worker'::text, 'api'::text, 'readonly'::text])))
);

CREATE TABLE public.jobrunner_schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.jobrunner_tenant_role (
    role_name name NOT NULL,
    tenant_id text NOT NULL
);

ALTER TABLE ONLY public.agent_schedule_trigger ALTER COLUMN id SET DEFAULT nextval('public.agent_schedule_trigger_id_seq'::regclass);

ALTER TABLE ONLY public.agent_work_queue ALTER COLUMN id SET DEFAULT nextval('public.agent_work_queue_id_seq'::regclass);

ALTER TABLE ONLY public.console_audit ALTER COLUMN id SET DEFAULT nextval('public.console_audit_id_seq'::regclass);

ALTER TABLE ONLY public.agent_batch
    ADD CONSTRAINT agent_batch_pkey PRIMARY KEY (batch_id);

ALTER TABLE ONLY public.agent_batch_usage
    ADD CONSTRAINT agent_batch_usage_pkey PRIMARY KEY (batch_id);

ALTER TABLE ONLY public.agent_limit_lane
    ADD CONSTRAINT agent_limit_lane_pkey PRIMARY KEY (limit_name, lane);

ALTER TABLE ONLY public.agent_limit_lease
    ADD CONSTRAINT agent_limit_lease_pkey PRIMARY KEY (limit_name, task_id);

ALTER TABLE ONLY public.agent_limit
    ADD CONSTRAINT agent_limit_pkey PRIMARY KEY (name);

ALTER TABLE ONLY public.agent_pool
    ADD CONSTRAINT agent_pool_pkey PRIMARY KEY (pool);

ALTER TABLE ONLY public.agent_pool_stream
    ADD CONSTRAINT agent_pool_stream_pkey PRIMARY KEY (pool, tenant_id, priority);

ALTER TABLE ONLY public.agent_pool_tenant
    ADD CONSTRAINT agent_pool_tenant_pkey PRIMARY KEY (pool, tenant_id);

ALTER TABLE ONLY public.agent_pool_tenant_usage
    ADD CONSTRAINT agent_pool_tenant_usage_pkey PRIMARY KEY (pool, tenant_id);

ALTER TABLE ONLY public.agent_schedule
    ADD CONSTRAINT agent_schedule_pkey PRIMARY KEY (namespace, name);

ALTER TABLE ONLY public.agent_schedule_trigger
    ADD CONSTRAINT agent_schedule_trigger_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.agent_shard_lease
    ADD CONSTRAINT agent_shard_lease_pkey PRIMARY KEY (tenant_id, shard_key);

ALTER TABLE ONLY public.agent_task_attempt
    ADD CONSTRAINT agent_task_attempt_pkey PRIMARY KEY (task_id, attempt, ended_at);

ALTER TABLE ONLY public.agent_task_effect
    ADD CONSTRAINT agent_task_effect_pkey PRIMARY KEY (batch_id, task_key, effect_key);

ALTER TABLE ONLY public.agent_task_key
    ADD CONSTRAINT agent_task_key_pkey PRIMARY KEY (batch_id, task_key);

ALTER TABLE ONLY public.agent_task_usage
    ADD CONSTRAINT agent_task_usage_pkey PRIMARY KEY (task_id, attempt);

ALTER TABLE ONLY public.agent_work_queue_archive
    ADD CONSTRAINT agent_work_queue_archive_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.agent_work_queue
    ADD CONSTRAINT agent_work_queue_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.agent_worker_wait
    ADD CONSTRAINT agent_worker_wait_pkey PRIMARY KEY (wait_id);

ALTER TABLE ONLY public.api_batch
    ADD CONSTRAINT api_batch_pkey PRIMARY KEY (batch_id);

ALTER TABLE ONLY public.api_batch
    ADD CONSTRAINT api_batch_tenant_id_idempotency_key_key UNIQUE (tenant_id, idempotency_key);

ALTER TABLE ONLY public.api_file_chunk
    ADD CONSTRAINT api_file_chunk_pkey PRIMARY KEY (file_id, seq);

ALTER TABLE ONLY public.api_file
    ADD CONSTRAINT api_file_pkey PRIMARY KEY (file_id);

ALTER TABLE ONLY public.api_file
    ADD CONSTRAINT api_file_tenant_id_idempotency_key_key UNIQUE (tenant_id, idempotency_key);

ALTER TABLE ONLY public.api_key
    ADD CONSTRAINT api_key_key_hash_key UNIQUE (key_hash);

ALTER TABLE ONLY public.api_key
    ADD CONSTRAINT api_key_pkey PRIMARY KEY (key_id);

ALTER TABLE ONLY public.console_audit
    ADD CONSTRAINT console_audit_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.jobrunner_component_role
    ADD CONSTRAINT jobrunner_component_role_pkey PRIMARY KEY (component);

ALTER TABLE ONLY public.jobrunner_schema_migrations
    ADD CONSTRAINT jobrunner_schema_migrations_pkey PRIMARY KEY (version);

ALTER TABLE ONLY public.jobrunner_tenant_role
    ADD CONSTRAINT jobrunner_tenant_role_pkey PRIMARY KEY (role_name, tenant_id);

CREATE INDEX agent_batch_pool_idx ON public.agent_batch USING btree (pool, tenant_id, priority) WHERE (pool IS NOT NULL);

CREATE INDEX agent_schedule_trigger_by_schedule ON public.agent_schedule_trigger USING btree (namespace, name, id DESC);

CREATE INDEX agent_schedule_trigger_untaken ON public.agent_schedule_trigger USING btree (id) WHERE (taken_at IS NULL);

CREATE INDEX agent_task_usage_batch_idx ON public.agent_task_usage USING btree (batch_id);

CREATE INDEX agent_work_queue_batch_failed_idx ON public.agent_work_queue USING btree (batch_id, status, id) WHERE ((status)::text = ANY (ARRAY['dead'::text, 'cancelled'::text]));

CREATE INDEX agent_work_queue_batch_pending_idx ON public.agent_work_queue USING btree (batch_id, run_after, id) WHERE ((status)::text = 'pending'::text);

CREATE UNIQUE INDEX agent_work_queue_leased_uidx ON public.agent_work_queue USING btree (tenant_id, shard_key) WHERE ((status)::text = 'leased'::text);

CREATE INDEX agent_work_queue_pool_pending_idx ON public.agent_work_queue USING btree (pool, vtag, id) WHERE (((status)::text = 'pending'::text) AND (pool IS NOT NULL));

CREATE INDEX agent_worker_wait_batch ON public.agent_worker_wait USING btree (batch_id, seen_at) WHERE (batch_id IS NOT NULL);

CREATE INDEX agent_worker_wait_pool ON public.agent_worker_wait USING btree (pool, seen_at) WHERE (pool IS NOT NULL);

CREATE INDEX api_batch_by_tenant ON public.api_batch USING btree (tenant_id, created_at DESC, batch_id DESC);

CREATE INDEX api_batch_open ON public.api_batch USING btree (expires_at) WHERE (status = ANY (ARRAY['in_progress'::text, 'finalizing'::text, 'cancelling'::text]));

CREATE INDEX api_file_by_expiry ON public.api_file USING btree (expires_at) WHERE (expires_at IS NOT NULL);

CREATE INDEX api_file_by_tenant ON public.api_file USING btree (tenant_id, created_at DESC, file_id DESC);

CREATE INDEX console_audit_by_batch ON public.console_audit USING btree (batch_id, id DESC);

CREATE TRIGGER agent_work_queue_key_delete AFTER DELETE ON public.agent_work_queue FOR EACH ROW EXECUTE FUNCTION public.jobrunner_task_key_delete();

CREATE TRIGGER agent_work_queue_key_fixed BEFORE UPDATE OF batch_id, task_key ON public.agent_work_queue FOR EACH ROW WHEN (((old.batch_id IS DISTINCT FROM new.batch_id) OR (old.task_key IS DISTINCT FROM new.task_key))) EXECUTE FUNCTION public.jobrunner_task_key_fixed();

CREATE TRIGGER agent_work_queue_key_insert BEFORE INSERT ON public.agent_work_queue FOR EACH ROW EXECUTE FUNCTION public.jobrunner_task_key_insert();

CREATE TRIGGER agent_work_queue_key_truncate AFTER TRUNCATE ON public.agent_work_queue FOR EACH STATEMENT EXECUTE FUNCTION public.jobrunner_task_key_truncate();

ALTER TABLE ONLY public.api_file_chunk
    ADD CONSTRAINT api_file_chunk_file_id_fkey FOREIGN KEY (file_id) REFERENCES public.api_file(file_id) ON DELETE CASCADE;

ALTER TABLE public.agent_batch ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_batch_usage ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_pool_stream ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_pool_tenant ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_pool_tenant_usage ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_schedule ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_schedule_trigger ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_shard_lease ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_task_attempt ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_task_effect ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_task_key ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_task_usage ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_work_queue ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_work_queue_archive ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.agent_worker_wait ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.api_batch ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.api_file ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.api_file_chunk ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.api_key ENABLE ROW LEVEL SECURITY;

ALTER TABLE public.console_audit ENABLE ROW LEVEL SECURITY;

CREATE POLICY jobrunner_all ON public.agent_batch USING (true);

CREATE POLICY jobrunner_all ON public.agent_batch_usage USING (true);

CREATE POLICY jobrunner_all ON public.agent_pool_stream USING (true);

CREATE POLICY jobrunner_all ON public.agent_pool_tenant USING (true);

CREATE POLICY jobrunner_all ON public.agent_pool_tenant_usage USING (true);

CREATE POLICY jobrunner_all ON public.agent_schedule USING (true);

CREATE POLICY jobrunner_all ON public.agent_schedule_trigger USING (true);

CREATE POLICY jobrunner_all ON public.agent_shard_lease USING (true);

CREATE POLICY jobrunner_all ON public.agent_task_attempt USING (true);

CREATE POLICY jobrunner_all ON public.agent_task_effect USING (true);

CREATE POLICY jobrunner_all ON public.agent_task_key USING (true);

CREATE POLICY jobrunner_all ON public.agent_task_usage USING (true);

CREATE POLICY jobrunner_all ON public.agent_work_queue USING (true);

CREATE POLICY jobrunner_all ON public.agent_work_queue_archive USING (true);

CREATE POLICY jobrunner_all ON public.agent_worker_wait USING (true);

CREATE POLICY jobrunner_all ON public.api_batch USING (true);

CREATE POLICY jobrunner_all ON public.api_file USING (true);

CREATE POLICY jobrunner_all ON public.api_file_chunk USING (true);

CREATE POLICY jobrunner_all ON public.api_key USING (true);

CREATE POLICY jobrunner_all ON public.console_audit USING (true);

CREATE POLICY jobrunner_own ON public.jobrunner_tenant_role FOR SELECT USING ((role_name = SESSION_USER));

ALTER TABLE public.jobrunner_tenant_role ENABLE ROW LEVEL SECURITY;
