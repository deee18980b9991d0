"""Flow control in worker pools (issue 26 item 8, issue 27 item 4; docs/pools.md, "Flow
control in a pool"): limits shared by every batch of a pool, budgets per pool batch, fair
share unchanged among the tasks that may run, and no stream held up by another's full
limit. Real PostgreSQL, real pool worker processes; times are the database's."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from jobrunner.model.types import Lease, Outcome
from jobrunner.model.usage import Usage
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store import flowcontrol as limits
from jobrunner.store import workerpools as pools
from tests.support.figures import show
from tests.support.limits_handlers import LOG_DDL, MAX_START_LAG, max_in_window
from tests.support.processes import cli, start_worker, wait_for

H = "tests.support.limits_handlers"


@pytest.fixture
def log_table(conn):
    conn.execute(LOG_DDL)
    conn.commit()


def _tasks(prefix: str, n: int, **extra) -> list[TaskSpec]:
    return [TaskSpec(f"{prefix}{i:04d}", **extra) for i in range(n)]


def _claim(q: Queue, pool: str, n: int = 1) -> list:
    return q.complete_and_claim("w", (), None, n, pool=pool)[1]


def _pool_workers(dsn: str, pool: str, n: int, tmp_path: Path, *handlers: str,
                  extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    args = [a for h in handlers[1:] for a in ("--handler", h)]
    return [start_worker(dsn, "", handlers[0], *args, *extra, "--worker-id", f"w{i}",
                         log=tmp_path / f"w{i}.log", pool=pool) for i in range(n)]


def _stop(workers: list[subprocess.Popen], tmp_path: Path) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    for i, w in enumerate(workers):
        code = w.wait(60)
        assert code == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]


def _log(conn) -> list[dict]:
    """The handlers' log (tests/support/limits_handlers.py) with each task's tenant:
    claimed_at is the time its limits admitted it, started_at the handler's own."""
    rows = conn.execute(
        "SELECT q.tenant_id AS tenant, extract(epoch FROM g.claimed_at)::float8 AS c,"
        " extract(epoch FROM g.started_at)::float8 AS s,"
        " extract(epoch FROM g.rate_limited_at)::float8 AS r"
        " FROM limit_log g JOIN agent_work_queue q ON q.task_key = g.task_key"
        " ORDER BY g.claimed_at").fetchall()
    conn.commit()
    return rows


# -- the claim, in one process ---------------------------------------------------------------
def test_a_pool_claim_takes_the_next_task_its_limits_allow_in_fair_order(conn):
    q = Queue(conn)
    limits.set_limit(conn, "slow", requests=1, per=3600)
    limits.set_limit(conn, "slot", max_concurrent=1)
    # A's tasks come first in the pool's order (weight 10), all under a limit that will be
    # full after one claim; B's (weight 1) name none; C's name a concurrency limit.
    pools.set_weight(conn, "p", "A", 10)
    q.enqueue("a", "A", _tasks("a", 20, limits=("slow",)), pool="p")
    q.enqueue("b", "B", _tasks("b", 5), pool="p")
    q.enqueue("c", "C", _tasks("c", 5, limits=("slot",)), pool="p")
    got = [lease.key for _ in range(12) for lease in _claim(q, "p")]
    # one of A's (the limit's one request), one of C's (its one slot), then only B's: A's
    # and C's next tasks, earlier in the order, hold no claim of batch 1 up
    assert got[:2] == ["a0000", "b0000"] and got.count("c0000") == 1, got
    assert sorted(got) == ["a0000", *[f"b{i:04d}" for i in range(5)], "c0000"], got
    assert _claim(q, "p") == [] and q.limit_wait and q.limit_wait > 3000
    # C's slot frees with its ack, and C goes on
    (lease,) = [x for x in _held(q, conn) if x.key == "c0000"]
    kept, more = q.complete_and_claim("w", [Outcome(lease, True, {})], None, 1, pool="p")
    assert kept == {lease.id}
    # (the ack and its claim read one snapshot, so the freed slot goes to the next claim)
    more += _claim(q, "p")
    assert [x.key for x in more] == ["c0001"]


def _held(q: Queue, conn) -> list[Lease]:
    """The leases worker "w" holds, as the worker knows them."""
    rows = conn.execute("SELECT * FROM agent_work_queue WHERE lease_owner = 'w'"
                        " AND status = 'leased'").fetchall()
    conn.commit()
    return [Lease(id=r["id"], batch_id=r["batch_id"], key=r["task_key"],
                  tenant_id=r["tenant_id"], shard_key=r["shard_key"], payload=r["payload"],
                  attempt=r["attempts"], max_attempts=r["max_attempts"],
                  locked_until=r["locked_until"], run_after=r["run_after"], vtag=r["vtag"])
            for r in rows]


def test_a_limit_with_room_for_some_of_a_claim_gives_it_in_fair_order(conn):
    q = Queue(conn)
    limits.set_limit(conn, "three", requests=3, per=3600)
    # A enqueued first: its tasks have the smaller ids; B's interleave with them in tags
    q.enqueue("a", "A", _tasks("a", 4, limits=("three",)), pool="p")
    q.enqueue("b", "B", _tasks("b", 4, limits=("three",)), pool="p")
    got = sorted(lease.key for lease in _claim(q, "p", 8))
    order = [r["task_key"] for r in conn.execute(
        "SELECT task_key FROM agent_work_queue WHERE pool = 'p' ORDER BY vtag, id")]
    conn.commit()
    # the limit's three requests go to the first three tasks in fair order (B's first
    # among them), not to the three oldest ids (all A's)
    assert got == sorted(order[:3]) == ["a0000", "a0001", "b0000"], (got, order)


def test_a_spent_budget_stops_its_pool_batch_and_not_the_others(conn):
    q = Queue(conn)
    pools.set_weight(conn, "p", "A", 10)
    q.enqueue("a", "A", _tasks("a", 10), pool="p")
    q.enqueue("b", "B", _tasks("b", 3), pool="p")
    q.set_budget("a", tokens=100)  # (refused before: pools took no budget)
    first = _claim(q, "p")
    assert [x.key for x in first] == ["a0000"]
    limits.record_usage(conn, first[0].id, first[0].attempt, Usage(tokens=100))
    got = [lease.key for _ in range(6) for lease in _claim(q, "p")]
    assert got == ["b0000", "b0001", "b0002"], got
    q.set_budget("a", tokens=1000)  # raising it resumes the batch
    assert [x.key for x in _claim(q, "p")] == ["a0001"]


def test_a_tenants_budget_in_a_pool_stops_every_batch_of_the_tenant_and_no_other(conn):
    q = Queue(conn)
    q.enqueue("a1", "A", _tasks("a1", 5), pool="p")
    q.enqueue("a2", "A", _tasks("a2", 5), pool="p")
    q.enqueue("b", "B", _tasks("b", 5), pool="p")
    q.enqueue("other", "A", _tasks("o", 2), pool="elsewhere")
    assert not pools.flow_controlled(q.session, "p")
    q.set_tenant_budget("p", "A", tokens=150)
    assert pools.flow_controlled(q.session, "p")
    conn.commit()
    # A's usage in the pool: 100 tokens from a1, 60 from a2 (reported while running)
    spent = []
    while len(spent) < 2:
        (lease,) = _claim(q, "p")
        if lease.key.startswith(("a1", "a2")) and lease.key[:2] not in {x[:2] for x in spent}:
            limits.record_usage(conn, lease.id, lease.attempt,
                                Usage(tokens=100 if lease.key.startswith("a1") else 60))
            spent.append(lease.key)
    assert q.tenant_usage("p", "A").tokens == 160 and q.tenant_usage("p", "A").exhausted
    # each batch alone is far under 150: only the tenant's budget stops them
    assert q.usage("a1", by_status=False).tokens == 100
    assert q.usage("a2", by_status=False).tokens == 60
    got = [lease.key for _ in range(12) for lease in _claim(q, "p")]
    assert got and all(k.startswith("b") for k in got), got
    assert q.counts("a1")["pending"] + q.counts("a2")["pending"] > 0
    # the tenant's budget is per pool: its batch in another pool is not stopped
    assert [x.key for x in _claim(q, "elsewhere")] == ["o0000"]
    q.set_tenant_budget("p", "A", tokens=10_000)  # raising it resumes A's batches
    assert _claim(q, "p")[0].key.startswith("a")


def test_a_tenant_arriving_while_another_is_held_joins_the_streams_being_served(conn):
    """Migration 0020: the pool's virtual time now is at least the largest tag its workers
    hold. A held stream's oldest task (small tag) must not be where a newcomer starts:
    laid there it would be ahead of everything the pool is serving."""
    q = Queue(conn)
    limits.set_limit(conn, "slow", requests=1, per=3600)
    q.enqueue("a", "A", _tasks("a", 20, limits=("slow",)), pool="p")
    q.enqueue("b", "B", _tasks("b", 60), pool="p")
    got = [lease.key[0] for _ in range(30) for lease in _claim(q, "p")]
    assert got.count("a") == 1 and got.count("b") == 29, got  # A is held at its first task
    q.enqueue("c", "C", _tasks("c", 20), pool="p")
    q.forget_scan_position(("pool", "p"))  # (as a worker does on the enqueue's NOTIFY)
    got = [lease.key[0] for _ in range(20) for lease in _claim(q, "p")]
    # B and C alternate (equal weights); laid at A's oldest task, C would take all 20
    assert 9 <= got.count("c") <= 11, got


def test_a_pool_claims_with_limits_only_while_it_has_such_work(conn):
    q = Queue(conn)
    limits.set_limit(conn, "l", requests=1000, per=1)
    q.enqueue("plain", "A", _tasks("p", 2), pool="p")
    assert not pools.flow_controlled(q.session, "p")
    q.enqueue("lim", "B", _tasks("l", 1, limits=("l",)), pool="p")
    assert pools.flow_controlled(q.session, "p")
    conn.commit()
    got = sorted(lease.key for _ in range(3) for lease in _claim(q, "p"))
    assert got == ["l0000", "p0000", "p0001"]
    # nothing pending under flow control: the pool's claims go back to the plain statement
    assert not pools.flow_controlled(q.session, "p")


def test_limits_and_budgets_through_the_command_line_in_a_pool(dsn, conn):
    cli("limit", "set", "gpt", "--requests", "10", dsn=dsn, check=True)
    lines = "".join(json.dumps({"key": f"k{i}", "limits": ["gpt"], "tokens": 5}) + "\n"
                    for i in range(3))
    r = cli("enqueue", "--batch", "cb", "--tenant", "A", "--pool", "cp", "-", dsn=dsn,
            input=lines)
    assert r.returncode == 0, r.stderr
    r = cli("budget", "set", "--batch", "cb", "--tokens", "100", dsn=dsn)
    assert r.returncode == 0, r.stderr
    row = conn.execute("SELECT b.flow_control, u.budget_tokens FROM agent_batch b"
                       " JOIN agent_batch_usage u USING (batch_id) WHERE batch_id = 'cb'"
                       ).fetchone()
    assert row == {"flow_control": True, "budget_tokens": 100}
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue WHERE batch_id = 'cb'"
                        " AND limits = '{gpt}' AND tokens = 5 AND vtag IS NOT NULL"
                        ).fetchone()["n"] == 3


# -- real pool workers -----------------------------------------------------------------------
def test_a_request_limit_shared_by_two_tenants_holds_and_splits_by_weight(
        dsn, conn, log_table, tmp_path, capsys):
    cli("limit", "set", "model", "--requests", "20", "--per", "1", dsn=dsn, check=True)
    pools.set_weight(conn, "fp", "A", 3)
    q = Queue(conn)
    # (both tenants stay backlogged while the claims are counted: 160 of 600 tasks)
    q.enqueue("a", "A", _tasks("a", 300, payload={"sleep": 0.05}, limits=("model",)),
              pool="fp")
    q.enqueue("b", "B", _tasks("b", 300, payload={"sleep": 0.05}, limits=("model",)),
              pool="fp")
    workers = _pool_workers(dsn, "fp", 4, tmp_path, f"{H}:paced")
    wait_for(lambda: len(_log(conn)) >= 160, timeout=120, what="160 claims")
    _stop(workers, tmp_path)
    rows = _log(conn)
    claimed = sorted(r["c"] for r in rows)
    started = sorted(r["s"] for r in rows)
    # The limit, on the database clock of the claims: never more than 20 in any second,
    # across both batches and every worker.
    assert max_in_window(claimed, 1.0) <= 20
    # The independent witness: the handlers' own start times. A start follows its claim
    # by start_lag at most (the largest measured here), so the starts of any 1 s window
    # belong to claims of a window of 1 + start_lag s: at most 20 + 20 * start_lag of
    # them (MAX_START_LAG bounds the lag, and says why).
    lags = [r["s"] - r["c"] for r in rows]
    start_lag = max(0.5, max(lags))  # (never tighter than the 0.5 s it always allowed)
    assert min(lags) >= 0 and start_lag <= MAX_START_LAG, (min(lags), start_lag)
    most = max_in_window(started, 1.0)
    assert most <= 20 + math.ceil(20 * start_lag)
    # Used, not just respected: the claims came at the limit's rate.
    first160 = claimed[:160]
    span = first160[-1] - first160[0]
    assert span <= 1.25 * 159 / 20, span
    # Fair share of what the limit allows: A (weight 3) gets 3/4 of the claims.
    ordered = sorted(rows, key=lambda r: r["c"])[:160]
    share = sum(r["tenant"] == "A" for r in ordered) / len(ordered)
    show(capsys, f"pool, limit 20/s shared by A (weight 3) and B (1), 4 workers: claims at "
         f"most {max_in_window(claimed, 1.0)} per s, handler starts at most {most} per s "
         f"(bound {20 + math.ceil(20 * start_lag)}); 160 claims in {span:.1f} s; A's share "
         f"{share:.3f}")
    assert 0.70 <= share <= 0.80, share


class _Always429(BaseHTTPRequestHandler):
    """Every POST answers 429 with Retry-After: 2 (a model that is rate limited)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(429)
        self.send_header("Retry-After", "2")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def always_429():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Always429)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("held", ["requests", "slots", "429"])
def test_a_tenant_whose_limit_is_full_does_not_stop_another_tenant(
        dsn, conn, log_table, tmp_path, always_429, held, capsys):
    q = Queue(conn)
    # A's stream goes first in the pool's order (weight 10): under head-of-line blocking
    # its held tasks would be every claim's first candidates.
    pools.set_weight(conn, "hp", "A", 10)
    if held == "requests":  # one request an hour: exhausted by A's first task
        limits.set_limit(conn, "model-a", requests=1, per=3600)
        a_payload, a_handler = {"sleep": 0.05}, f"{H}:paced"
    elif held == "slots":  # one slot, which A's first task holds for 8 s
        limits.set_limit(conn, "model-a", max_concurrent=1)
        a_payload, a_handler = {"sleep": 8}, f"{H}:paced"
    else:  # every call of A is answered 429 (Retry-After 2): its limit keeps pausing
        limits.set_limit(conn, "model-a", requests=1000, per=1)
        a_payload = {"url": always_429, "limit": "model-a"}
        a_handler = f"{H}:http_call"
    limits.set_limit(conn, "model-b", requests=1000, per=1)
    q.enqueue("a", "A", _tasks("a", 20, payload=a_payload, limits=("model-a",)), pool="hp",
              handler=a_handler)
    q.enqueue("b", "B", _tasks("b", 30, payload={"sleep": 0.1}, limits=("model-b",)),
              pool="hp", handler=f"{H}:paced")
    conn.commit()
    workers = _pool_workers(dsn, "hp", 2, tmp_path, f"{H}:paced", f"{H}:http_call",
                            extra=("--concurrency", "2"))
    wait_for(lambda: q.counts("b")["done"] == 30, timeout=60, what="B's 30 tasks")
    _stop(workers, tmp_path)
    rows = _log(conn)
    a_rows = [r for r in rows if r["tenant"] == "A"]
    b_starts = sorted(r["s"] for r in rows if r["tenant"] == "B")
    assert len(b_starts) == 30
    if held == "requests":
        assert len(a_rows) == 1  # the limit's one request, and no more
        held_until = float("inf")
    elif held == "slots":
        assert len(a_rows) == 1  # its one slot, held for the whole of B's run
        held_until = a_rows[0]["s"] + 8
    else:
        pauses = sorted(r["r"] for r in a_rows if r["r"] is not None)
        assert pauses, a_rows
        # A's limit really was paused: no A start within a pause (claims admitted before
        # the 429 may start up to start_lag later)
        for at in pauses:
            inside = [r["s"] - at for r in a_rows if at + 0.5 < r["s"] < at + 2.0]
            assert inside == [], (at, inside)
        # ... and B went on inside A's pauses
        in_pauses = [s for s in b_starts if any(at < s < at + 2.0 for at in pauses)]
        assert in_pauses, (pauses, b_starts)
        held_until = float("inf")
    # B's whole run fits while A is held: A's full limit held none of B's claims up
    assert b_starts[-1] < held_until, (b_starts[-1], held_until)
    show(capsys, f"pool, A held by its limit ({held}): B's 30 tasks in "
         f"{b_starts[-1] - b_starts[0]:.2f} s, A claimed {len(a_rows)}")


def test_a_budget_on_a_pool_batch_stops_it_and_not_the_other_batch(dsn, conn, log_table,
                                                                  tmp_path):
    q = Queue(conn)
    q.enqueue("a", "A", _tasks("a", 40, payload={"tokens": 100, "sleep": 0.2}), pool="bp")
    q.enqueue("b", "B", _tasks("b", 40, payload={"tokens": 100, "sleep": 0.2}), pool="bp")
    r = cli("budget", "set", "--batch", "a", "--tokens", "1000", dsn=dsn)
    assert r.returncode == 0, r.stderr
    workers = _pool_workers(dsn, "bp", 4, tmp_path, f"{H}:spend_at_end")

    def settled() -> bool:
        return (q.counts("b")["done"] == 40 and q.counts("a")["leased"] == 0
                and q.usage("a", by_status=False).exhausted)

    wait_for(settled, timeout=90, what="B done and A stopped by its budget")
    time.sleep(1.0)  # the workers keep polling: nothing more of A is claimed
    a, used = q.counts("a"), q.usage("a", by_status=False)
    assert a["leased"] == 0 and a["pending"] > 0, a
    # overshoot: at most what was in flight (4 workers x 1 task x 100 tokens)
    assert 1000 <= used.tokens <= 1000 + 4 * 100 and used.tokens == 100 * a["done"]
    assert q.counts("b")["done"] == 40 and q.usage("b", by_status=False).tokens == 4000
    # raising the budget resumes the batch
    cli("budget", "set", "--batch", "a", "--tokens", "100000", dsn=dsn, check=True)
    wait_for(lambda: q.counts("a")["done"] == 40, timeout=60, what="A to finish")
    _stop(workers, tmp_path)


def test_a_tenant_budget_over_two_pool_batches_stops_both_and_not_the_other_tenant(
        dsn, conn, log_table, tmp_path):
    q = Queue(conn)
    for batch, tenant in (("a1", "A"), ("a2", "A"), ("b", "B")):
        q.enqueue(batch, tenant, _tasks(batch, 30, payload={"tokens": 100, "sleep": 0.2}),
                  pool="tp")
    r = cli("budget", "set", "--pool", "tp", "--tenant", "A", "--tokens", "1500", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert "tenant A in pool tp: budget tokens 1500" in r.stdout, r.stdout
    workers = _pool_workers(dsn, "tp", 4, tmp_path, f"{H}:spend_at_end")

    def a_done() -> int:
        return q.counts("a1")["done"] + q.counts("a2")["done"]

    def settled() -> bool:
        return (q.counts("b")["done"] == 30 and q.counts("a1")["leased"] == 0
                and q.counts("a2")["leased"] == 0 and q.tenant_usage("tp", "A").exhausted)

    wait_for(settled, timeout=90, what="B done and A's two batches stopped by A's budget")
    time.sleep(1.0)  # the workers keep polling: nothing more of A is claimed
    used = q.tenant_usage("tp", "A")
    # the witness: the handlers' own log of what ran, not the totals the claim reads
    ran = conn.execute("SELECT count(DISTINCT task_key) AS n FROM limit_log"
                       " WHERE task_key LIKE 'a%'").fetchone()["n"]
    assert a_done() == ran and q.counts("a1")["leased"] + q.counts("a2")["leased"] == 0
    # overshoot: at most what was in flight (4 workers x 1 task x 100 tokens)
    assert 1500 <= used.tokens <= 1500 + 4 * 100 and used.tokens == 100 * ran, (used, ran)
    assert q.counts("a1")["done"] > 0 and q.counts("a2")["done"] > 0  # both drew from it
    assert q.usage("a1", by_status=False).tokens + q.usage("a2", by_status=False).tokens \
        == used.tokens
    assert q.counts("b")["done"] == 30 and q.usage("b", by_status=False).tokens == 3000
    cli("budget", "set", "--pool", "tp", "--tenant", "A", "--tokens", "100000", dsn=dsn,
        check=True)
    wait_for(lambda: a_done() == 60, timeout=60, what="A's batches to finish")
    _stop(workers, tmp_path)


def test_a_tenant_budget_needs_a_pool_and_a_tenant(dsn):
    r = cli("budget", "set", "--pool", "tp", "--tokens", "5", dsn=dsn)
    assert r.returncode == 2 and "--pool and --tenant" in r.stderr, r.stderr
    r = cli("budget", "set", "--batch", "x", "--pool", "tp", "--tenant", "A", "--tokens", "5",
            dsn=dsn)
    assert r.returncode == 2 and "either --batch, or --pool and --tenant" in r.stderr, r.stderr


def test_the_pool_claim_with_limits_shares_its_halves_with_the_other_claims():
    """task_ack_and_claim_pool_limited must ack as every claim does, and admit, charge and
    stamp as task_ack_and_claim_limited does: the shared text is kept identical, so a
    change to one that is not made to the other fails here."""
    from jobrunner.store.sqlfiles import query

    plain, limited = query("task_ack_and_claim"), query("task_ack_and_claim_limited")
    pooled = query("task_ack_and_claim_pool_limited")

    def between(text: str, start: str, end: str) -> str:
        return text[text.index(start):text.index(end, text.index(start))]

    assert between(plain, "WITH lockable AS", "candidates AS (") == between(
        pooled, "WITH lockable AS", "candidates AS (")
    for start, end in (("limit_ok AS (", "one_per_shard AS ("),
                       ("shard_leases AS (", "claimed AS ("),
                       ("SET status = 'leased'", "RETURNING")):
        assert between(limited, start, end) == between(pooled, start, end), start
    # the batch's pre-filter of visibly full limits, plus the slots (see the statement)
    prefilter = between(limited, "AND (q.limits IS NULL OR", "AND NOT EXISTS (\n")
    assert prefilter.rstrip(")\n ") in pooled
    assert "ORDER BY q.vtag, q.id" in pooled and "ORDER BY vtag, id))" in pooled
