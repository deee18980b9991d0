"""Every state transition of the lease queue, against a real PostgreSQL."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.model.errors import BadInput, UnknownBatch
from jobrunner.model.types import Outcome, Timing
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue

W1, W2 = "worker-1-aaaaaa", "worker-2-bbbbbb"


def tasks(n: int, shard: str | None = None, prefix: str = "t") -> list[TaskSpec]:
    return [TaskSpec(key=f"{prefix}{i}", payload={"i": i}, shard_key=shard) for i in range(n)]


def row(conn: psycopg.Connection, task_id: int) -> dict:
    r = conn.execute("SELECT * FROM agent_work_queue WHERE id = %s", (task_id,)).fetchone()
    conn.rollback()
    return r


def test_enqueue_is_idempotent_per_batch_and_key(queue: Queue):
    first = queue.enqueue("b1", "acme", tasks(5))
    again = queue.enqueue("b1", "acme", tasks(7))
    other = queue.enqueue("b2", "acme", tasks(2))
    assert (first.new, first.existing) == (5, 0)
    assert (again.new, again.existing) == (2, 5)
    assert (other.new, other.existing) == (2, 0)
    assert queue.counts("b1")["pending"] == 7


def test_enqueue_bulk_100k(queue: Queue):
    result = queue.enqueue("big", "acme", (TaskSpec(key=str(i), payload={"i": i})
                                           for i in range(100_000)))
    assert result.new == 100_000
    assert queue.counts("big")["pending"] == 100_000


def test_enqueue_rejects_other_tenant_for_same_batch(queue: Queue):
    queue.enqueue("b1", "acme", tasks(1))
    with pytest.raises(BadInput, match="belongs to tenant 'acme'"):
        queue.enqueue("b1", "globex", tasks(1))


def test_claim_marks_leased_with_database_time(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(3))
    leases = queue.claim("b", W1, limit=2)
    assert len(leases) == 2
    r = row(conn, leases[0].id)
    assert r["status"] == "leased" and r["lease_owner"] == W1 and r["attempts"] == 1
    db_now = conn.execute("SELECT now() AS n").fetchone()["n"]
    conn.rollback()
    assert 599 < (r["locked_until"] - db_now).total_seconds() <= 600.5
    # a leased row is invisible to other claimers
    rest = queue.claim("b", W2, limit=10)
    assert [lease.key for lease in rest] == ["t2"]
    assert queue.claim("b", W2, limit=10) == []


def test_claim_never_exceeds_limit(queue: Queue):
    queue.enqueue("b", "acme", tasks(50))
    for limit in (1, 3, 7, 10):
        assert len(queue.claim("b", W1, limit=limit)) == limit


def test_heartbeat_extends_and_detects_loss(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(2))
    a, b = queue.claim("b", W1, limit=2)
    conn.execute("UPDATE agent_work_queue SET locked_until = now() + interval '5 s'")
    conn.commit()
    assert queue.heartbeat(W1, [a, b]) == {a.id, b.id}
    assert (row(conn, a.id)["locked_until"] - row(conn, a.id)["updated_at"]).total_seconds() > 590
    # another owner's heartbeat renews nothing
    assert queue.heartbeat(W2, [a]) == set()


def test_ack_stores_result_and_is_fenced(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(1))
    (lease,) = queue.claim("b", W1)
    assert not queue.complete(W2, [Outcome(lease, True, {"x": 1})])  # wrong owner
    assert queue.ack(W1, lease, {"summary": "ok"})
    r = row(conn, lease.id)
    assert r["status"] == "done" and r["result"] == {"summary": "ok"}
    assert r["finished_at"] is not None and r["locked_until"] is None
    assert not queue.ack(W1, lease, {"again": True})  # a second ack changes nothing
    assert row(conn, lease.id)["result"] == {"summary": "ok"}


def test_stale_worker_cannot_overwrite_newer_attempt(conn):
    queue = Queue(conn, Timing(visibility_timeout=600))
    queue.enqueue("b", "acme", tasks(1, shard="repo-1"))
    (old,) = queue.claim("b", W1)
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'")
    conn.commit()
    assert [r["status"] for r in queue.expire()] == ["pending"]
    (new,) = queue.claim("b", W2)
    assert new.attempt == 2
    # The old worker comes back: every fenced operation is a no-op for it.
    assert queue.heartbeat(W1, [old]) == set()
    assert not queue.ack(W1, old, {"stale": True})
    assert queue.fail(W1, old, "stale failure") is None
    assert queue.release(W1, [old]) == set()
    # ... and it did not release the shard the new attempt holds: the shard's lease is
    # the leased row of its task (migration 0016), and another task of it is not claimed.
    assert conn.execute("SELECT id, lease_owner FROM agent_work_queue"
                        " WHERE status = 'leased' AND shard_key = 'repo-1'").fetchall() == [
        {"id": new.id, "lease_owner": W2}]
    conn.rollback()
    queue.enqueue("b", "acme", tasks(1, shard="repo-1", prefix="other"))
    assert queue.claim("b", W1) == []
    assert queue.ack(W2, new, {"fresh": True})
    r = row(conn, new.id)
    assert r["status"] == "done" and r["result"] == {"fresh": True}


def test_same_worker_cannot_ack_heartbeat_fail_or_release_its_older_attempt(conn):
    """Fencing is on the attempt too, not only the owner: a worker whose lease expired
    and which then claimed the same task again (attempt 2, same worker id: one process
    with a slow first attempt) cannot finish attempt 1 over attempt 2."""
    queue = Queue(conn, Timing(visibility_timeout=600))
    queue.enqueue("b", "acme", tasks(1, shard="repo-1"))
    (old,) = queue.claim("b", W1)
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'")
    conn.commit()
    assert [r["status"] for r in queue.expire()] == ["pending"]
    (new,) = queue.claim("b", W1)
    assert (new.id, new.attempt) == (old.id, 2)
    assert queue.heartbeat(W1, [old]) == set()
    assert not queue.ack(W1, old, {"stale": True})
    assert queue.fail(W1, old, "stale failure") is None
    assert queue.release(W1, [old]) == set()
    r = row(conn, new.id)
    assert (r["status"], r["attempts"], r["result"]) == ("leased", 2, None)
    assert queue.heartbeat(W1, [new]) == {new.id}
    assert queue.ack(W1, new, {"fresh": True})
    assert row(conn, new.id)["result"] == {"fresh": True}


def test_once_refuses_an_effect_after_the_lease_was_lost(queue: Queue, conn, dsn):
    """task.once's own fence, in the database: an attempt whose lease someone else now
    holds cannot apply its effect, whatever the worker believes (no lease_lost flag)."""
    from jobrunner.model.errors import LeaseLost
    from jobrunner.runtime.effects import Effects

    queue.enqueue("b", "acme", tasks(1))
    (old,) = queue.claim("b", W1)
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'")
    conn.commit()
    queue.expire()
    (new,) = queue.claim("b", W2)
    effects = Effects(dsn)
    try:
        with pytest.raises(LeaseLost):
            effects.once(old, W1, "write", lambda c: c.execute("SELECT 1") and "applied")
        assert effects.once(new, W2, "write", lambda c: "applied") == "applied"
    finally:
        effects.close()
    assert conn.execute("SELECT count(*) AS n FROM agent_task_effect").fetchone()["n"] == 1


def test_a_claim_skips_rows_another_transaction_holds_locked(queue: Queue, conn, dsn):
    """FOR UPDATE SKIP LOCKED: a row another claim has locked (its transaction still
    open) is skipped at once, never waited on. With a 2 s lock_timeout on the claiming
    session, a claim that waited would fail with LockNotAvailable."""
    queue.enqueue("b", "acme", tasks(3))
    conn.execute("SET lock_timeout = '2s'")
    conn.commit()
    with psycopg.connect(dsn) as other:
        other.execute("SELECT id FROM agent_work_queue WHERE task_key = 't0' FOR UPDATE")
        leases = queue.claim("b", W1, limit=3)
        assert sorted(lease.key for lease in leases) == ["t1", "t2"]
        other.rollback()
    assert [lease.key for lease in queue.claim("b", W2, limit=3)] == ["t0"]


def test_fail_backs_off_exponentially_with_jitter_from_db_time(conn):
    queue = Queue(conn, Timing(backoff_base=1.0, backoff_cap=3600))
    queue.enqueue("b", "acme", tasks(1), max_attempts=8)
    delays = []
    for attempt in (1, 2, 3):
        conn.execute("UPDATE agent_work_queue SET run_after = now()")
        conn.commit()
        (lease,) = queue.claim("b", W1)
        assert lease.attempt == attempt
        assert queue.fail(W1, lease, f"boom {attempt}") == "pending"
        r = row(conn, lease.id)
        delays.append((r["run_after"] - r["updated_at"]).total_seconds())
        assert r["last_error"] == f"boom {attempt}"
        assert queue.claim("b", W1) == []  # not before its run_after
    for attempt, delay in zip((1, 2, 3), delays, strict=True):
        assert 2**attempt <= delay <= 2**attempt * 1.25 + 0.01


def test_backoff_jitter_spreads_retries_over_up_to_25_percent(conn):
    """40 tasks failing their first attempt at the same instant: every delay is within
    [base * 2, base * 2 * 1.25] (the lower bound: no retry comes early), and they are
    spread over that range rather than all equal (a backoff without jitter would send
    them back together). 40 uniform draws over 0.5 s leave a range under 0.1 s with a
    probability below 1e-25."""
    queue = Queue(conn, Timing(backoff_base=1.0, backoff_cap=3600))
    queue.enqueue("b", "acme", tasks(40), max_attempts=3)
    leases = queue.claim("b", W1, limit=40)
    assert len(leases) == 40
    for lease in leases:
        assert queue.fail(W1, lease, "boom") == "pending"
    delays = [r["d"] for r in conn.execute(
        "SELECT extract(epoch FROM run_after - updated_at)::float8 AS d"
        " FROM agent_work_queue WHERE batch_id = 'b'").fetchall()]
    conn.rollback()
    assert all(2.0 <= d <= 2.5 + 1e-6 for d in delays), delays
    assert max(delays) - min(delays) > 0.1, delays
    assert len({round(d, 4) for d in delays}) >= 30, delays


def test_backoff_is_capped(conn):
    queue = Queue(conn, Timing(backoff_base=1.0, backoff_cap=5))
    queue.enqueue("b", "acme", tasks(1))
    conn.execute("UPDATE agent_work_queue SET attempts = 6")
    conn.commit()
    (lease,) = queue.claim("b", W1)
    queue.fail(W1, lease, "boom")
    r = row(conn, lease.id)
    assert (r["run_after"] - r["updated_at"]).total_seconds() == pytest.approx(5, abs=0.01)


def test_attempts_exhausted_or_permanent_goes_dead(queue: Queue, conn):
    queue.enqueue("b", "acme", [TaskSpec("once", {}, max_attempts=1), TaskSpec("perm", {})])
    leases = {lease.key: lease for lease in queue.claim("b", W1, limit=2)}
    assert queue.fail(W1, leases["once"], "last try") == "dead"
    assert queue.fail(W1, leases["perm"], "bad input", permanent=True) == "dead"
    assert queue.counts("b")["dead"] == 2
    dead = queue.list_dead("b")
    assert {d["task_key"]: d["last_error"] for d in dead} == {"once": "last try",
                                                              "perm": "bad input"}


def test_expire_returns_to_pending_or_dead_with_reason(queue: Queue, conn):
    queue.enqueue("b", "acme", [TaskSpec("a", {}), TaskSpec("b", {}, max_attempts=1)])
    leases = queue.claim("b", W1, limit=2)
    assert queue.expire() == []  # nothing is past its deadline yet
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'")
    conn.commit()
    moved = {r["id"]: r["status"] for r in queue.expire()}
    by_key = {lease.key: lease.id for lease in leases}
    assert moved == {by_key["a"]: "pending", by_key["b"]: "dead"}
    assert "lease expired" in row(conn, by_key["a"])["last_error"]
    assert W1 in row(conn, by_key["b"])["last_error"]


def test_release_does_not_burn_an_attempt(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(1, shard="s"))
    (lease,) = queue.claim("b", W1)
    assert queue.release(W2, [lease]) == set()  # fenced on the owner: not W2's to give back
    assert row(conn, lease.id)["status"] == "leased"
    assert queue.release(W1, [lease]) == {lease.id}
    r = row(conn, lease.id)
    assert r["status"] == "pending" and r["attempts"] == 0
    # nothing holds the shard: no task of it is leased
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue"
                        " WHERE status = 'leased' AND shard_key = 's'").fetchone()["n"] == 0
    conn.rollback()
    (again,) = queue.claim("b", W2)
    assert again.attempt == 1


def test_shard_lease_is_the_leased_row_taken_under_a_try_lock(queue: Queue, conn, dsn):
    """Migration 0016: a shard's lease is its leased task row (a unique index over the
    leased rows), taken by a claim under a transaction-scoped try-lock per shard and
    released by the row leaving 'leased' (nothing written for it)."""
    queue.enqueue("b", "acme", [*tasks(3, shard="s"), TaskSpec("x", {}, shard_key="t")])
    queue.enqueue("c", "other", tasks(1, shard="s", prefix="c"))
    with psycopg.connect(dsn, row_factory=dict_row) as other:
        # another claim in progress is taking shard t: this claim skips it, never waits
        assert other.execute("SELECT jobrunner_shard_take('acme', 't') AS got"
                             ).fetchone()["got"] is True
        first = queue.claim("b", W1, limit=4)
        assert [lease.shard_key for lease in first] == ["s"]  # one task per shard, t skipped
        other.rollback()
    (t_lease,) = queue.claim("b", W1, limit=4)
    assert t_lease.key == "x"
    assert queue.claim("b", W2, limit=4) == []  # s and t are both held
    # a shard is a tenant's: the other tenant's shard s is free
    assert [lease.key for lease in queue.claim("c", W2)] == ["c0"]
    # the unique index refuses a second leased task of a shard, whoever writes it
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("UPDATE agent_work_queue SET status = 'leased'"
                     " WHERE batch_id = 'b' AND shard_key = 's' AND status = 'pending'")
    conn.rollback()
    assert queue.ack(W1, first[0], None)
    (nxt,) = queue.claim("b", W2, limit=4)
    assert nxt.shard_key == "s" and nxt.id != first[0].id
    assert conn.execute("SELECT count(*) AS n FROM agent_shard_lease").fetchone()["n"] == 0


def test_one_index_holds_every_leased_row_and_finds_each_batchs_by_its_tenant(
        queue: Queue, conn):
    """Migration 0018: one unique index over the leased rows, (tenant_id, shard_key), for
    the shard exclusion and for every batch-keyed read of leased rows (through the batch's
    tenant). Tasks without a shard key all lease at once (NULLs never conflict); each
    batch of a tenant counts only its own leases; a claim writes one entry there."""
    indexes = {r["indexname"]: r["indexdef"] for r in conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'agent_work_queue'")}
    conn.rollback()
    leased = [name for name, d in indexes.items() if "'leased'" in d]
    assert leased == ["agent_work_queue_leased_uidx"], indexes
    assert "UNIQUE" in indexes["agent_work_queue_leased_uidx"]
    queue.enqueue("b1", "acme", tasks(5, prefix="x"))  # no shard key
    queue.enqueue("b2", "acme", [*tasks(2, prefix="y"), *tasks(2, shard="s", prefix="z")])
    queue.enqueue("c", "globex", tasks(1, shard="s", prefix="w"))
    assert len(queue.claim("b1", W1, limit=5)) == 5
    b2 = queue.claim("b2", W2, limit=5)
    assert sorted(lease.shard_key or "" for lease in b2) == ["", "", "s"]
    (c,) = queue.claim("c", W2)
    assert c.shard_key == "s"  # another tenant's shard s, while acme's s is leased
    assert queue.counts("b1")["leased"] == 5 and queue.counts("b1")["pending"] == 0
    assert queue.counts("b2")["leased"] == 3 and queue.counts("b2")["pending"] == 1
    assert queue.counts("c")["leased"] == 1
    assert queue.batch_open("b1") and queue.health("b1")["stuck"] == 0
    for lease in b2:
        assert queue.ack(W2, lease, None)
    assert queue.counts("b2")["leased"] == 0 and queue.counts("b1")["leased"] == 5
    (last,) = queue.claim("b2", W2, limit=5)
    assert queue.ack(W2, last, None)
    assert not queue.batch_open("b2")  # b1's leases of the same tenant do not keep it open
    assert queue.batch_open("b1") and queue.batch_open("c")
    # leases past their deadline: stuck per batch, and the expirer finds them
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 second'"
                 " WHERE batch_id = 'b1' AND status = 'leased'")
    conn.commit()
    assert queue.health("b1")["stuck"] == 5 and queue.health("c")["stuck"] == 0
    assert sorted(r["batch_id"] for r in queue.expire()) == ["b1"] * 5
    assert queue.counts("b1")["pending"] == 5 and queue.counts("c")["leased"] == 1


def test_cancel_moves_pending_only(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(4))
    (leased,) = queue.claim("b", W1)
    assert queue.cancel("b") == 3
    counts = queue.counts("b")
    assert counts["cancelled"] == 3 and counts["leased"] == 1
    assert queue.ack(W1, leased, None)  # a running task still finishes
    with pytest.raises(BadInput, match="was cancelled"):
        queue.enqueue("b", "acme", tasks(1, prefix="new"))


def test_a_failure_in_a_cancelled_batch_ends_cancelled_not_pending(queue: Queue):
    """Retryable failures and rate-limited answers of tasks running when their batch was
    cancelled end cancelled, as a release or an expired lease does: pending would strand
    them (no worker of the batch is left) and keep the batch from settling. Permanent
    failures stay dead, with their error."""
    queue.enqueue("b", "acme", tasks(3))
    failing, throttled, poisoned = queue.claim("b", W1, limit=3)
    assert queue.cancel("b") == 0
    assert queue.fail(W1, failing, "boom") == "cancelled"
    assert queue.complete(W1, [Outcome(throttled, False, error="429",
                                       throttle_after=1.0)]) == {throttled.id}
    assert queue.fail(W1, poisoned, "bad input", permanent=True) == "dead"
    assert queue.counts("b") == {"pending": 0, "leased": 0, "done": 0, "dead": 1,
                                 "cancelled": 2}
    rows = queue.conn.execute("SELECT status, finished_at IS NOT NULL AS finished, last_error"
                              " FROM agent_work_queue WHERE id = ANY(%s) ORDER BY id",
                              ([failing.id, throttled.id],)).fetchall()
    assert [(r["status"], r["finished"], r["last_error"]) for r in rows] == [
        ("cancelled", True, "boom"), ("cancelled", True, "429")]
    # (the batch row is read, not joined: a task whose batch has no row still fails as
    # before, and is not taken for a lost lease)
    queue.enqueue("nb", "acme", tasks(1))
    (orphan,) = queue.claim("nb", W1)
    queue.conn.execute("DELETE FROM agent_batch WHERE batch_id = 'nb'")
    assert queue.fail(W1, orphan, "boom") == "pending"


def test_requeue_dead(queue: Queue):
    queue.enqueue("b", "acme", tasks(2), max_attempts=1)
    for lease in queue.claim("b", W1, limit=2):
        queue.fail(W1, lease, "boom")
    assert queue.requeue_dead("b", ["t0"]) == 1
    assert queue.counts("b") == {"pending": 1, "leased": 0, "done": 0, "dead": 1, "cancelled": 0}
    assert queue.requeue_dead("b") == 1
    (lease, _) = queue.claim("b", W1, limit=2)
    assert lease.attempt == 1


def test_unknown_batch(queue: Queue):
    with pytest.raises(UnknownBatch, match="unknown batch 'nope'"):
        queue.cancel("nope")
    with pytest.raises(UnknownBatch):
        queue.list_dead("nope")


def test_shard_exclusion_sequential(queue: Queue):
    queue.enqueue("b", "acme", tasks(3, shard="repo-a", prefix="a") +
                  tasks(2, shard="repo-b", prefix="b") + tasks(2, prefix="free"))
    first = queue.claim("b", W1, limit=10)
    shards = [lease.shard_key for lease in first]
    # one per shard, and unsharded tasks are not serialised
    assert sorted(s or "" for s in shards) == ["", "", "repo-a", "repo-b"]
    assert queue.claim("b", W2, limit=10) == []
    done = next(lease for lease in first if lease.shard_key == "repo-a")
    queue.ack(W1, done, None)
    (nxt,) = queue.claim("b", W2, limit=10)
    assert nxt.shard_key == "repo-a"


def test_same_shard_in_other_tenant_is_independent(queue: Queue):
    queue.enqueue("b1", "acme", tasks(2, shard="s", prefix="x"))
    queue.enqueue("b2", "globex", tasks(2, shard="s", prefix="y"))
    assert len(queue.claim("b1", W1, limit=5)) == 1
    assert len(queue.claim("b2", W1, limit=5)) == 1


def test_task_waiting_out_backoff_does_not_block_its_shard(queue: Queue):
    queue.enqueue("b", "acme", tasks(2, shard="s"))
    (first,) = queue.claim("b", W1, limit=1)
    queue.fail(W1, first, "retry later")
    (second,) = queue.claim("b", W1, limit=5)
    assert second.key != first.key


def test_busy_shard_does_not_hide_other_work(queue: Queue):
    queue.enqueue("b", "acme", tasks(20, shard="hot", prefix="h"))
    queue.enqueue("b", "acme", tasks(1, shard="cold", prefix="c"))
    assert queue.claim("b", W1, limit=1)[0].shard_key == "hot"
    (other,) = queue.claim("b", W2, limit=1)
    assert other.shard_key == "cold"


def test_heartbeat_keeps_the_shard(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(2, shard="s"))
    (lease,) = queue.claim("b", W1)
    queue.heartbeat(W1, [lease])
    assert queue.claim("b", W2) == []


def test_complete_and_claim_is_one_transaction(queue: Queue):
    queue.enqueue("b", "acme", tasks(3, shard="s"))
    (lease,) = queue.claim("b", W1)
    kept, nxt = queue.complete_and_claim(W1, [Outcome(lease, True, {"ok": 1})], "b", 1)
    assert kept == {lease.id}
    # the ack released the shard inside the same transaction, so the claim got its next task
    assert len(nxt) == 1 and nxt[0].shard_key == "s"


def test_retention_deletes_and_archives_old_finished_rows(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(5))
    for lease in queue.claim("b", W1, limit=5):
        queue.ack(W1, lease, None)
    assert queue.retention(3600) == 0  # too young
    conn.execute("UPDATE agent_work_queue SET finished_at = now() - interval '2 days'")
    conn.commit()
    assert queue.retention(86400, archive=True, batch_size=2) == 5
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue_archive").fetchone()["n"] == 5
    conn.rollback()
    assert queue.counts("b")["done"] == 0


def test_counts_follow_every_transition(queue: Queue, conn):
    # Done is derived (the batch's task count minus the unfinished rows, migration 0009):
    # after every kind of transition it must agree with counting the rows themselves.
    def actual() -> dict[str, int]:
        rows = conn.execute("SELECT status, count(*) AS n FROM agent_work_queue"
                            " WHERE batch_id = 'b' GROUP BY status").fetchall()
        conn.rollback()
        return {s: 0 for s in ("pending", "leased", "done", "dead", "cancelled")} | {
            r["status"]: r["n"] for r in rows}

    assert queue.counts("b") == actual()  # unknown batch: all zero
    queue.enqueue("b", "acme", tasks(8) + tasks(4, shard="s", prefix="u"))
    queue.enqueue("b", "acme", tasks(8))  # idempotent: counts nothing twice
    queue.enqueue("other", "acme", tasks(3))
    assert queue.counts("b") == actual() and queue.counts("b")["pending"] == 12
    leases = queue.claim("b", W1, limit=5)
    assert queue.counts("b") == actual()
    queue.ack(W1, leases[0], {"ok": True})
    queue.fail(W1, leases[1], "retry later")
    queue.fail(W1, leases[2], "bad", permanent=True)
    assert queue.counts("b") == actual()
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'"
                 " WHERE status = 'leased'")
    conn.commit()
    queue.expire()
    assert queue.counts("b") == actual()
    for lease in queue.claim("b", W2, limit=3):
        queue.ack(W2, lease, None)
    queue.requeue_dead("b")
    assert queue.counts("b") == actual()
    conn.execute("UPDATE agent_work_queue SET finished_at = now() - interval '2 days'"
                 " WHERE status = 'done'")
    conn.commit()
    assert queue.retention(86400, batch_size=2) == 4
    assert queue.counts("b") == actual() and queue.counts("b")["done"] == 0
    queue.cancel("b")
    counts = queue.counts("b")
    assert counts == actual() and counts["cancelled"] > 0
    assert queue.counts("other") == {"pending": 3, "leased": 0, "done": 0, "dead": 0,
                                     "cancelled": 0}


def test_health_reports_stuck_leases(queue: Queue, conn):
    queue.enqueue("b", "acme", tasks(2))
    queue.claim("b", W1)
    assert queue.health("b")["stuck"] == 0
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'"
                 " WHERE status = 'leased'")
    conn.commit()
    health = queue.health("b")
    assert health["stuck"] == 1 and health["oldest_pending_seconds"] >= 0


def test_claims_resume_after_their_last_position_and_rescan_from_the_start(queue: Queue):
    """A worker's next claim starts scanning after its previous claim (so it does not
    step over the index entries of every row claimed since the last vacuum); a task it
    passed over is claimed again once a claim comes back short, or after a second."""
    other = Queue(queue.conn, queue.timing)  # a second worker: its own scan position
    queue.enqueue("b", "acme", [TaskSpec(key="a", payload={}, shard_key="s"),
                                TaskSpec(key="b", payload={}, shard_key="s"),
                                *tasks(3, prefix="c")])
    (a,) = queue.claim("b", W1, limit=1)
    assert a.key == "a"
    # shard s is busy: "b" is passed over; the claim is full, so the position is kept
    assert [lease.key for lease in other.claim("b", W2, limit=2)] == ["c0", "c1"]
    assert queue.ack(W1, a)  # shard s is free again, but "b" is behind W2's position
    assert [lease.key for lease in other.claim("b", W2, limit=1)] == ["c2"]
    assert other.claim("b", W2, limit=1) == []  # short: the next claim starts over
    assert [lease.key for lease in other.claim("b", W2, limit=1)] == ["b"]

    # the same after the full-scan interval, without a short claim in between
    queue.enqueue("b", "acme", [TaskSpec(key="d", payload={}, shard_key="t"),
                                TaskSpec(key="e", payload={}, shard_key="t"),
                                *tasks(3, prefix="f")])
    (d,) = queue.claim("b", W1, limit=1)
    assert [lease.key for lease in other.claim("b", W2, limit=1)] == ["f0"]
    assert queue.ack(W1, d)
    other.FULL_SCAN_EVERY = 0.0
    assert [lease.key for lease in other.claim("b", W2, limit=1)] == ["e"]


def test_a_claim_from_a_position_leaves_out_rows_another_claim_touched(queue: Queue, conn,
                                                                       dsn):
    """A scan from a position does not lock a row whose pending version another
    transaction locked or updated (a stale claimer would hold the newest version's lock
    and turn the taker's ack 'busy'); the next scan from the start, which does not
    filter, still claims it if it is claimable (its locker passed it over). A row made
    pending again by expiry (which locks it before its update) is not left out."""
    queue.enqueue("b", "acme", tasks(6))
    assert [lease.key for lease in queue.claim("b", W1, limit=2)] == ["t0", "t1"]
    # another claim locks t2 and t3, then passes them over (say their shards were busy)
    with psycopg.connect(dsn) as other:
        other.execute("SELECT id FROM agent_work_queue WHERE task_key IN ('t2', 't3')"
                      " FOR UPDATE")
    assert [lease.key for lease in queue.claim("b", W1, limit=2)] == ["t4", "t5"]
    assert queue.claim("b", W1, limit=2) == []  # short: the next claim starts over
    assert [lease.key for lease in queue.claim("b", W1, limit=2)] == ["t2", "t3"]
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'"
                 " WHERE task_key = 't2'")
    conn.commit()
    assert [r["status"] for r in queue.expire()] == ["pending"]
    assert [lease.key for lease in queue.claim("b", W1, limit=1)] == ["t2"]  # (a position)
