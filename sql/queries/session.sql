-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
--
-- A connection's session and transaction settings (jobrunner/store/session.py).

-- name: session_settings
-- Give the session (local: only the transaction) the queue's planner settings and timeout.
--
-- - statement_timeout: a stuck claim poll must not hang a worker. NULL leaves the
--   server's own statement_timeout alone.
-- - plan_cache_mode = force_generic_plan: the hot statements are planned once per
--   connection. With custom plans PostgreSQL re-plans them on every execution, which
--   cost more server CPU than executing them (measured: ~500 vs ~200 µs per claim).
-- - enable_seqscan, enable_bitmapscan, enable_sort = off: that one plan must not
--   depend on the statistics of a table that swings from empty to millions of rows. A
--   worker that starts on an empty queue would otherwise cache a plan that scans the
--   table, or reads every pending row through another index and sorts them, and keep
--   using it on 20,000 pending rows (measured: claims 10x slower, at random, until the
--   plan happened to be invalidated). Every queue statement has an index path that
--   needs no sort except the few rows of one claim (one_per_shard), which stays.
SELECT set_config('plan_cache_mode', 'force_generic_plan', %(local)s),
       set_config('enable_seqscan', 'off', %(local)s),
       set_config('enable_bitmapscan', 'off', %(local)s),
       set_config('enable_sort', 'off', %(local)s),
       CASE WHEN %(timeout)s::text IS NOT NULL
            THEN set_config('statement_timeout', %(timeout)s::text, %(local)s) END;

-- name: session_statement_timeout
-- The transaction's statement timeout (SET LOCAL: it also holds behind a transaction pooler).
SELECT set_config('statement_timeout', %(timeout)s, true);

-- name: session_reset_timeout
-- Give the session back the server's statement timeout.
RESET statement_timeout;

-- name: session_read_only
-- Make the current transaction read-only (the result exports).
SET TRANSACTION READ ONLY;

-- name: session_utc
-- Timestamps of the current transaction rendered in UTC.
SELECT set_config('TimeZone', 'UTC', true);

-- name: session_listen_batches
-- Receive worker_wait_everyone's wake-ups of batches (payload: the batch id).
LISTEN jobrunner_queue;

-- name: session_listen_pools
-- Receive worker_wait_everyone's wake-ups of pools (payload: the pool name).
LISTEN jobrunner_pool;

-- name: session_listen_wake
-- Receive worker_wait_wake_*'s word to watchers that a batch or pool got work (payload:
-- "batch ID" or "pool NAME"); its named workers were told on their own channels.
LISTEN jobrunner_wake;

-- name: session_listen_due
-- Receive task_retry_notify's retry times (payload: "batch ID SECONDS" or "pool NAME SECONDS").
LISTEN jobrunner_due;

-- name: session_listen_leader
-- Receive session_leader_resign's hand-over: the maintenance leader is leaving.
LISTEN jobrunner_leader;

-- name: session_unlisten_all
-- Stop listening to anything: a notifier about to sleep on its waiting workers' rows
-- (worker_wait_sleep) is then no listener, which every notifying commit signals.
UNLISTEN *;

-- name: session_leader_try
-- Become this database's maintenance leader if nobody is (a session advisory lock).
--
-- One session per database holds it: the maintenance leader, which sweeps expired leases
-- and enqueues due reduce steps for every batch (jobrunner/worker/notifier.py). It is
-- held until the session ends, so a leader killed with kill -9 loses it the moment its
-- socket closes. The key is a constant of jobrunner's own (jobrunner_leader_key: a
-- sleeping notifier tries it in agent_worker_wait_sleep).
SELECT pg_try_advisory_lock(jobrunner_leader_key()) AS leader;

-- name: session_leader_resign
-- Tell the other candidates that the leader is leaving, so one takes over at once.
SELECT pg_notify('jobrunner_leader', 'resign');
