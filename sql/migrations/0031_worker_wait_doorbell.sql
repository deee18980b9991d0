-- A waiting worker's doorbell: its process's notifier session sleeps in a statement
-- instead of idling on LISTEN, and an enqueue that takes its row cancels that statement
-- (jobrunner/worker/notifier.py, docs/scaling.md "Waking a waiting fleet").
--
-- Why: PostgreSQL (up to 18) signals every LISTENing backend of the database on each
-- notifying commit, whatever the channel, and each of them wakes to read the queue. With
-- 1,000 waiting pods that is 1,000 processes woken per enqueue, and the named worker's
-- claim queues behind them for CPU: 18.6 ms median from NOTIFY to a follow-up round trip
-- with 1,000 idle listeners on other channels, against 0.7 ms with none (pg_cancel_backend
-- of one sleeping session: 0.9 ms with or without 1,000 others). A sleeping session is no
-- listener, so a doorbell signals exactly the backend it names.
--
-- The protocol (two advisory lock keys per waiting row, both transaction-scoped):
-- RUNG    (1246970230, key): shared by every transaction that took the row, until it ends;
-- ASLEEP  (1246970231, key): shared by the sleeping statement, while it sleeps.
-- A ringer, having taken (deleted) the row: takes RUNG; tries ASLEEP exclusively. If it
-- gets it, nobody sleeps on the row: it holds it to its commit, so a sleep that starts
-- meanwhile waits for that commit and then finds the row gone; it also sends the note on
-- the worker's channel, for a notifier still LISTENing. If it does not, the row's session
-- sleeps: it cancels that statement (when pg_locks shows the row's pid holding ASLEEP:
-- a forged pid is never signalled). The sleep (agent_worker_wait_sleep) first waits for
-- RUNG (for ringers still in their transaction), then takes ASLEEP, then reads its rows:
-- any gone, it returns them at once; else it sleeps. A cancel that arrives while the
-- session is between statements is ignored by the server, and is covered by the next
-- sleep's wait on RUNG. So a ring is never lost, and the woken worker never claims before
-- the enqueue that rang it has committed.
--
-- The key: the row's id folded to 31 bits (a collision only makes one ringer's probe see
-- another worker asleep: pg_locks then shows a different pid, and that worker is left to
-- its next sleep, at most a few seconds later).

ALTER TABLE agent_worker_wait ADD COLUMN pid integer;  -- the notifier session to ring

CREATE FUNCTION jobrunner_wait_key(p_wait_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT (p_wait_id & 2147483647)::integer $$;

-- The maintenance leadership's key (a session advisory lock: session_leader_try), one
-- constant for the two statements that take it.
CREATE FUNCTION jobrunner_leader_key() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT hashtext('jobrunner-maintenance-leader')::bigint $$;

-- The sleeping statement of a notifier: `gone`, the ids of those of `p_ids` whose rows are
-- gone (taken by an enqueue: the worker is wanted), at once if any already are, else
-- none after `p_seconds` (at once if its leadership try won) or when a ringer cancels
-- it. With `p_lead`, first the leadership try (session_leader_try's, in the same round
-- trip: a waiting pod's only other statement); `leader` says whether the session holds the lock (a try repeated
-- after a cancel says it again: the lock is re-entrant). SECURITY INVOKER: it reads the
-- rows under the caller's own privileges and row policy. Per id, plain statements whose
-- plans plpgsql keeps: a query over unnest(p_ids) was planned on every call and cost
-- twice the rest (60 µs of server CPU against 27 for a bare SELECT).
CREATE FUNCTION agent_worker_wait_sleep(p_ids bigint[], p_seconds double precision,
                                        p_lead boolean, OUT gone bigint[],
                                        OUT leader boolean)
LANGUAGE plpgsql VOLATILE AS $$
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

-- Whether a ring can reach the calling session (a notifier deciding to sleep rather than
-- LISTEN): the functions' owner may cancel its statements (a superuser; a member of the
-- session's role; or of pg_signal_backend, which cannot signal a superuser's session;
-- 'USAGE': with the role's privileges, as pg_cancel_backend checks them).
CREATE FUNCTION agent_worker_wait_can_ring() RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
    OR pg_has_role(current_user, session_user, 'USAGE')
    OR (pg_has_role(current_user, 'pg_signal_backend', 'USAGE')
        AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = session_user))
$$;

-- Ring the workers whose rows the caller's transaction has just taken (deleted), each
-- with its pid: cancel the sleeping ones, send `p_note` on the others' channels
-- (jobrunner_wake_ID: worker_waits.channel). Returns how many were rung. SECURITY
-- DEFINER for pg_cancel_backend alone: it signals only a session that holds the
-- row's ASLEEP lock, which only agent_worker_wait_sleep takes.
CREATE FUNCTION agent_worker_wait_ring(p_ids bigint[], p_pids integer[], p_note text)
RETURNS integer LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
