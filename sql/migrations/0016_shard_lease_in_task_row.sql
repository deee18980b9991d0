-- Shard leases without a row of their own (issue 18, item 5: less WAL per task).
--
-- Until now a claim inserted a row into agent_shard_lease (a speculative heap insert, its
-- confirmation and a primary-key entry) and the ack, fail, release or expiry deleted it:
-- 189 of the 1,322 bytes of WAL a task wrote (one client, pg_waldump --stats), plus
-- the page pruning of that table. The lease now lives where the task's state already
-- is: a task of a shard holds the shard's lease exactly while its row is 'leased'.
--
--   exclusion  a UNIQUE index on (tenant_id, shard_key) over the leased rows: two
--              leased tasks of one shard cannot exist, whatever any process does. The
--              claim's update is not HOT anyway (status is in the claim index's
--              predicate), so its new version takes this entry instead of the lease
--              table's primary-key entry: the same one B-tree insert per claim.
--   release    nothing to write: ack, fail, release and expiry move the task out of
--              'leased', and its entry stops counting (it points at a dead version).
--   claiming   a unique violation would abort the whole claim, so claims never race
--              for the index: jobrunner_shard_take (below) first takes a transaction-
--              scoped advisory lock on the shard, without waiting (a shard another
--              claim is taking right now is skipped, as a lost INSERT race was), then
--              checks in a snapshot taken after that lock that no task of the shard is
--              leased. Every claim of a shard holds that lock until its commit, so the
--              check sees every claim that committed before it: the index is never
--              violated by jobrunner's own claims, it only proves that it cannot be.
--              Advisory locks live in memory (no WAL) and are released at commit or
--              rollback; transaction-scoped, they work behind PgBouncer's transaction
--              pooling.
--
-- agent_shard_lease is no longer written or read by this version. It stays for one
-- release so that workers of the previous version, still running during a rolling
-- upgrade, do not fail on a missing table. They still take their shards there and do
-- not see the new workers' leases; the unique index keeps them from leasing one shard
-- twice all the same: such a claim fails with a unique violation (the old worker stops
-- with that error, its leases expire and are rescued, nothing runs twice at once).
CREATE UNIQUE INDEX agent_work_queue_shard_leased_uidx
    ON agent_work_queue (tenant_id, shard_key)
    WHERE status = 'leased' AND shard_key IS NOT NULL;

-- Whether this transaction may lease the shard (p_tenant, p_shard) now, for a claim of one
-- of its tasks. Called once per shard of a claim's candidates. The lock is only tried
-- (a shard another claim is taking right now: false at once). plpgsql and VOLATILE:
-- the check is a statement of its own, so it runs in a snapshot taken after the lock
-- and not in the claim statement's older one (measured: the same server CPU per task
-- as the lease table's insert and delete; an array version with one call per claim
-- cost 10 % more).
CREATE FUNCTION jobrunner_shard_take(p_tenant text, p_shard text)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
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
