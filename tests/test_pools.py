"""Worker pools (issue 18, docs/pools.md): workers that claim across every open batch of
a pool, fair across tenants by weight, batch priorities; every claim guarantee holds.
Real PostgreSQL, real worker processes; times are the database's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobrunner.model.errors import BadInput
from jobrunner.model.types import Outcome
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store import workerpools as pools
from tests.support import figures
from tests.support.processes import REPO, child_env, cli, spawned, wait_for

NOOP = "tests.support.handlers:noop"


def _tasks(n: int, prefix: str = "t", **extra) -> list[TaskSpec]:
    return [TaskSpec(key=f"{prefix}{i:06d}", payload={}, **extra) for i in range(n)]


def start_pool_worker(dsn: str, pool: str, handler: str, *extra: str, log: Path | None = None
                      ) -> subprocess.Popen:
    args = [sys.executable, "-m", "jobrunner", "worker", "--pool", pool, "--handler", handler,
            "--log-level", "info", *extra]
    stream = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(args, env=child_env(dsn), cwd=REPO, stdout=stream, stderr=stream,
                            start_new_session=True)
    spawned.append(proc)
    return proc


def _stop(workers: list[subprocess.Popen], tmp_path: Path) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    for i, w in enumerate(workers):
        code = w.wait(60)
        assert code == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]


def _done(conn, batch: str) -> int:
    n = conn.execute("SELECT count(*) AS n FROM agent_work_queue"
                     " WHERE batch_id = %s AND status = 'done'", (batch,)).fetchone()["n"]
    conn.commit()  # (so that an enqueue after it is its own transaction, not a savepoint)
    return n


# -- the claim, in one process -------------------------------------------------------------
def test_pool_claim_takes_every_batch_of_the_pool_in_fair_order(conn):
    q = Queue(conn)
    q.enqueue("a1", "A", _tasks(6), pool="p")
    q.enqueue("b1", "B", _tasks(3), pool="p")
    q.enqueue("other", "A", _tasks(5))  # not in the pool: never claimed by it
    leases = []
    for _ in range(9):
        leases += q.complete_and_claim("w", (), None, 1, pool="p")[1]
    # B joined at the pool's virtual time now (A's next tag): one for one from there
    assert [lease.batch_id for lease in leases] == [
        "a1", "a1", "b1", "a1", "b1", "a1", "b1", "a1", "a1"]
    assert q.complete_and_claim("w", (), None, 1, pool="p")[1] == []
    kept, more = q.complete_and_claim("w", [Outcome(lease, True, {"ok": 1}) for lease in leases],
                                      None, 1, pool="p")
    assert kept == {lease.id for lease in leases} and more == []
    assert q.counts("a1")["done"] == 6 and q.counts("other")["pending"] == 5


def test_a_tenant_enqueued_concurrently_is_not_laid_behind_the_others_backlog(dsn):
    """Two runs applied together (migration 0015): B's enqueue transaction starts, A's
    commits its tasks, then B takes the pool's lock; A's tasks must count as due, so B is
    laid at A's next tag, not after A's whole backlog."""
    import psycopg

    with psycopg.connect(dsn) as b_conn, psycopg.connect(dsn, autocommit=True) as a_conn:
        with b_conn.transaction():
            b_conn.execute("SELECT now()")  # B's transaction (and its now()) starts here
            time.sleep(0.05)
            Queue(a_conn).enqueue("a", "A", _tasks(4), pool="p")
            Queue(b_conn).enqueue("b", "B", _tasks(4), pool="p")
        order = [r[0] for r in a_conn.execute(
            "SELECT batch_id FROM agent_work_queue WHERE pool = 'p' ORDER BY vtag, id")]
    assert order[:4].count("b") >= 1 and order[-1] == "b", order
    assert order != ["a"] * 4 + ["b"] * 4


def test_batches_of_one_tenant_share_its_part_and_weights_and_priority_apply(conn):
    q = Queue(conn)
    q.enqueue("x1", "A", _tasks(8), pool="p")
    q.enqueue("x2", "A", _tasks(4), pool="p")  # joins x1: A's part is shared round-robin
    q.enqueue("y", "B", _tasks(8), pool="p")
    order = []
    for _ in range(12):
        order += [lease.batch_id for lease in q.complete_and_claim("w", (), None, 1,
                                                                     pool="p")[1]]
    # A and B alternate; A's turns alternate between x1 and x2
    assert 5 <= order.count("y") <= 6, order
    a_turns = [b for b in order if b != "y"]
    assert a_turns[:6] == ["x1", "x2", "x1", "x2", "x1", "x2"], order

    q.enqueue("c", "C", _tasks(40), pool="w3")
    q.enqueue("d", "D", _tasks(40), pool="w3")
    assert pools.set_weight(conn, "w3", "C", 3) == 1  # re-lays C's pending tasks
    got = [lease.tenant_id for _ in range(40)
           for lease in q.complete_and_claim("w", (), None, 1, pool="w3")[1]]
    assert 29 <= got.count("C") <= 31, got  # 3:1, give or take the first turn

    q.enqueue("big", "E", _tasks(100), pool="pr")
    q.enqueue("urgent", "E", _tasks(10), pool="pr", priority=1)
    got = [lease.batch_id for _ in range(11)
           for lease in q.complete_and_claim("w", (), None, 1, pool="pr")[1]]
    assert got.count("urgent") >= 9 and "big" in got, got  # 10x the weight; big still moves


def test_bad_pool_input_is_refused_and_writes_nothing(conn):
    q = Queue(conn)
    q.enqueue("b", "A", _tasks(2), pool="p")
    with pytest.raises(BadInput, match="belongs to pool 'p'"):
        q.enqueue("b", "A", _tasks(3), pool="other")
    with pytest.raises(BadInput, match="belongs to pool 'p'"):
        q.enqueue("b", "A", _tasks(3))
    q.enqueue("plain", "A", _tasks(1))
    with pytest.raises(BadInput, match="not in a pool"):
        q.enqueue("plain", "A", _tasks(3), pool="p")
    with pytest.raises(BadInput, match="priority 0, not 2"):
        q.enqueue("b", "A", _tasks(3), pool="p", priority=2)
    with pytest.raises(BadInput, match="priority must be between"):
        q.enqueue("n", "A", _tasks(3), pool="p", priority=4)
    # (limits are taken in a pool, docs/pools.md; an unknown one is refused as anywhere)
    with pytest.raises(BadInput, match="unknown limit 'gpt'"):
        q.enqueue("n", "A", _tasks(3, limits=("gpt",)), pool="p")
    with pytest.raises(BadInput, match="unknown limit 'gpt'"):
        q.enqueue("n", "A", _tasks(3), pool="p", limits=["gpt"])
    for bad in (0, -1, 0.0001, float("nan"), 1001, "3"):
        with pytest.raises(BadInput, match="weight must be"):
            pools.set_weight(conn, "p", "A", bad)
    conn.rollback()
    assert q.counts("b")["pending"] == 2
    assert conn.execute("SELECT count(*) AS n FROM agent_batch WHERE batch_id = 'n'"
                        ).fetchone()["n"] == 0
    r = cli("worker", "--handler", NOOP, dsn=str(conn.info.dsn))
    assert r.returncode == 2 and "exactly one of --batch and --pool" in r.stderr


# -- fairness with real worker processes ---------------------------------------------------
WORKERS = 4
URGENT = 2000  # the priority test's urgent batch


def _pool_workers(dsn, pool, n, tmp_path, handler=NOOP, *extra):
    return [start_pool_worker(dsn, pool, handler, "--worker-id", f"w{i}", *extra,
                              log=tmp_path / f"w{i}.log") for i in range(n)]


def _epoch(conn, sql: str, *args) -> float:
    return float(conn.execute(sql, args).fetchone()["t"])


# The small tenant's tasks. At 50 its fair time was ~100 ms, the scale of one worker's
# scheduling delay on a loaded machine: a cold CI run, its Go compiles outweighing the
# suite's cgroup, measured 274 ms against a bound of 202 (start lags of 647 ms were seen
# in the same conditions: tests/support/limits_handlers.py). At 500 the fair time is
# ~1 s, and starvation (B behind A's 19,000 remaining tasks) would still take ~20x.
SMALL = 500


def test_a_small_tenant_is_not_starved_by_a_large_one(dsn, conn, tmp_path, capsys):
    q = Queue(conn)
    q.enqueue("a-big", "A", _tasks(20_000), pool="p")
    workers = _pool_workers(dsn, "p", WORKERS, tmp_path)
    wait_for(lambda: _done(conn, "a-big") >= 1000, 120, what="tenant A under way")
    q.enqueue("b-small", "B", _tasks(SMALL), pool="p")
    wait_for(lambda: _done(conn, "b-small") == SMALL, 60, what="tenant B done")
    _stop(workers, tmp_path)
    # Database clock: from B's enqueue (its transaction's now()) to B's last finish.
    t0 = _epoch(conn, "SELECT extract(epoch FROM created_at) AS t FROM agent_batch"
                " WHERE batch_id = 'b-small'")
    t1 = _epoch(conn, "SELECT extract(epoch FROM max(finished_at)) AS t FROM agent_work_queue"
                " WHERE batch_id = 'b-small'")
    a_during = conn.execute(
        "SELECT count(*) AS n FROM agent_work_queue WHERE batch_id = 'a-big'"
        " AND finished_at > to_timestamp(%s) AND finished_at <= to_timestamp(%s)",
        (t0, t1)).fetchone()["n"]
    rate = (a_during + SMALL) / (t1 - t0)  # the pool's throughput while B had work
    fair_alone = SMALL / (rate / 2)  # B's tasks at half the pool (two equal tenants)
    assert _done(conn, "a-big") < 20_000  # A was backlogged throughout
    with capsys.disabled():
        print(f"\npools starvation: B's {SMALL} tasks done {1000 * (t1 - t0):.0f} ms after their "
              f"enqueue, behind 20,000 of A; at half the pool ({rate:.0f} tasks/s) alone "
              f"{1000 * fair_alone:.0f} ms; ratio {(t1 - t0) / fair_alone:.2f} (bound 2); "
              f"A tasks finished meanwhile: {a_during}", flush=True)
    assert t1 - t0 <= 2 * fair_alone


def test_weights_3_to_1_split_throughput_75_25(dsn, conn, tmp_path, capsys):
    q = Queue(conn)
    q.enqueue("wa", "A", _tasks(4000), pool="w")
    q.enqueue("wb", "B", _tasks(4000), pool="w")
    cli("pool", "set-weight", "w", "A", "3", dsn=dsn, check=True)  # re-lays A's tasks
    workers = _pool_workers(dsn, "w", WORKERS, tmp_path)
    wait_for(lambda: _done(conn, "wa") + _done(conn, "wb") >= 2400, 120, what="2,400 done")
    _stop(workers, tmp_path)
    rows = conn.execute("SELECT batch_id FROM agent_work_queue WHERE status = 'done'"
                        " ORDER BY finished_at, id OFFSET 200 LIMIT 2000").fetchall()
    share = sum(r["batch_id"] == "wa" for r in rows) / len(rows)
    assert _done(conn, "wb") < 4000 and _done(conn, "wa") < 4000  # both backlogged
    with capsys.disabled():
        print(f"\npools weights 3:1: tenant A's share of 2,000 tasks (both backlogged, "
              f"{WORKERS} workers): {100 * share:.1f} % (goal 75 ± 5)", flush=True)
    assert 0.70 <= share <= 0.80


def test_a_priority_batch_starts_within_a_second_and_the_large_one_still_moves(
        dsn, conn, tmp_path, capsys):
    q = Queue(conn)
    q.enqueue("large", "A", _tasks(20_000), pool="pr")
    workers = _pool_workers(dsn, "pr", WORKERS, tmp_path)
    wait_for(lambda: _done(conn, "large") >= 500, 120, what="the large batch under way")
    q.enqueue("urgent", "B", _tasks(URGENT), pool="pr", priority=1)
    committed = _epoch(conn, "SELECT extract(epoch FROM clock_timestamp()) AS t")
    wait_for(lambda: _done(conn, "urgent") == URGENT, 60, what="urgent done")
    _stop(workers, tmp_path)
    t0 = _epoch(conn, "SELECT extract(epoch FROM created_at) AS t FROM agent_batch"
                " WHERE batch_id = 'urgent'")
    first, last = (_epoch(conn, f"SELECT extract(epoch FROM {f}(finished_at)) AS t FROM"
                          " agent_work_queue WHERE batch_id = 'urgent'") for f in ("min", "max"))

    def large_between(a: float, b: float) -> int:
        return conn.execute(
            "SELECT count(*) AS n FROM agent_work_queue WHERE batch_id = 'large'"
            " AND finished_at >= to_timestamp(%s) AND finished_at <= to_timestamp(%s)",
            (a, b)).fetchone()["n"]

    # Its share from its arrival, the start of its enqueue, when its tags were laid from
    # the pool's virtual time (docs/pools.md). The claims made while that enqueue's
    # transaction is open take the large batch's tasks whose turns fell among the urgent
    # ones; the urgent batch then catches up on them first. So the large batch's ~200
    # turns among 2,000 urgent tasks are taken during the enqueue, after it, or both: how
    # many of each depends on how long the enqueue takes (under CI load, all of them
    # during it), the sum does not.
    large_during = large_between(t0, last)
    share = URGENT / (URGENT + large_during)
    figures.show(capsys, f"pools priority: the urgent batch (priority 1) behind 20,000 "
                 f"tasks: first task done {1000 * (first - committed):.0f} ms after its "
                 f"enqueue committed ({1000 * (committed - t0):.0f} ms after it began); its "
                 f"share from its arrival to its last task {100 * share:.1f} % (weight 10:1 "
                 f"-> 90.9 %); the large batch finished {large_during} meanwhile, "
                 f"{large_between(first, last)} of them after the urgent batch's first")
    assert first - committed <= 1.0
    assert large_during > 0 and share >= 0.8


def test_priority_does_not_starve_the_large_batch(dsn, conn, tmp_path, capsys):
    """The test above measures the urgent batch's latency; its count of the large batch's
    tasks includes those taken while the urgent tasks were not visible yet, so it would
    pass if priority starved the large batch. Here both batches are queued before any
    worker starts: no enqueue window, nothing to catch up. With priority 1 (weight x10)
    the large batch must get about 1 turn in 11 while the urgent batch runs: starvation
    (0) fails, and so does priority ignored (1 in 2)."""
    q = Queue(conn)
    urgent = 1000
    q.enqueue("large2", "A", _tasks(20_000), pool="ps")
    q.enqueue("urgent2", "B", _tasks(urgent), pool="ps", priority=1)
    conn.commit()
    workers = _pool_workers(dsn, "ps", WORKERS, tmp_path)
    wait_for(lambda: _done(conn, "urgent2") == urgent, 120, what="the urgent batch done")
    _stop(workers, tmp_path)
    # Claims, not completions: the large batch's tasks claimed up to the last urgent claim
    # (leased_at: the claim statement's time, kept in the row). Counted by completion, the
    # urgent batch's tail (its last tasks in flight, the others' claims meanwhile going to
    # the large batch) counted too: on a loaded machine (a cold CI run, run queue 30-50 on
    # 2 cores) a starving mutant (weight 10^10) reached 6.2 % that way and survived.
    last = _epoch(conn, "SELECT extract(epoch FROM max(leased_at)) AS t"
                  " FROM agent_work_queue WHERE batch_id = 'urgent2'")
    large = conn.execute("SELECT count(*) AS n FROM agent_work_queue WHERE batch_id = 'large2'"
                         " AND leased_at <= to_timestamp(%s)", (last,)).fetchone()["n"]
    share = large / (large + urgent)
    figures.show(capsys, f"pools priority, no starvation: while the urgent batch (priority "
                 f"1, {urgent} tasks) was claimed, the large one's claims took {large} tasks: "
                 f"{100 * share:.1f} % of the pool (weight 1:10 -> 9.1 %; bounds 5..15 %)")
    assert 0.05 <= share <= 0.15


def test_kill_9_of_pool_workers_loses_nothing_and_duplicates_no_effect(dsn, conn, tmp_path,
                                                                       capsys):
    import random

    q = Queue(conn)
    sizes = {"k-a1": 200, "k-a2": 100, "k-b": 200}
    q.enqueue("k-a1", "A", [TaskSpec(f"a1-{i}", {"sleep": 0.01}, shard_key=f"s{i % 10}")
                            for i in range(200)], pool="k")
    q.enqueue("k-a2", "A", [TaskSpec(f"a2-{i}", {"sleep": 0.01}) for i in range(100)],
              pool="k")
    q.enqueue("k-b", "B", [TaskSpec(f"b-{i}", {"sleep": 0.01}, shard_key=f"s{i % 5}")
                           for i in range(200)], pool="k")
    args = ("--exit-when-drained", "--visibility-timeout", "2", "--heartbeat", "0.5",
            "--concurrency", "2", "--log-level", "warning")
    handler = "tests.support.handlers:with_effect"

    def spawn(i: int) -> subprocess.Popen:
        return start_pool_worker(dsn, "k", handler, *args, log=tmp_path / f"w{i}.log")

    workers = {i: spawn(i) for i in range(WORKERS)}
    rng = random.Random(18)
    kills = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        finished = sum(_done(conn, b) for b in sizes)
        if finished == sum(sizes.values()):
            break
        if kills < 4 and finished > 60 * (kills + 1):
            victim = rng.choice(list(workers))
            os.killpg(workers[victim].pid, signal.SIGKILL)
            workers[victim].wait()
            kills += 1
            workers[victim] = spawn(victim)
        time.sleep(0.05)
    for i, w in workers.items():
        assert w.wait(60) == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
    counts = {b: q.counts(b) for b in sizes}
    assert all(c["done"] == sizes[b] and c["pending"] == c["leased"] == 0
               for b, c in counts.items()), counts
    one = lambda sql: next(iter(conn.execute(sql).fetchone().values()))  # noqa: E731
    effects = one("SELECT count(*) FROM effect_out")
    duplicated = one("SELECT count(*) FROM (SELECT task_key FROM effect_out GROUP BY task_key"
                     " HAVING count(*) > 1) d")
    overlaps = one("""
        WITH acked AS (
            SELECT q.tenant_id, r.shard_key, r.started_at, r.ended_at, r.task_key
            FROM exec_log r JOIN agent_work_queue q
              ON q.id = r.task_id AND q.attempts = r.attempt AND q.lease_owner = r.worker
            WHERE q.pool = 'k' AND q.status = 'done' AND r.shard_key IS NOT NULL)
        SELECT count(*) FROM acked a JOIN acked b
          ON a.tenant_id = b.tenant_id AND a.shard_key = b.shard_key AND a.task_key < b.task_key
         AND a.started_at < b.ended_at AND b.started_at < a.ended_at""")
    runs = one("SELECT count(*) FROM exec_log")
    with capsys.disabled():
        print(f"\npools kill -9: {kills} pool workers killed across 3 batches of 2 tenants; "
              f"500 done, {effects} effects ({duplicated} duplicated), {runs - 500} "
              f"re-executions, {overlaps} shard overlaps", flush=True)
    assert kills == 4
    assert effects == 500 and duplicated == 0 and overlaps == 0


def test_sigterm_gives_pool_tasks_back_without_using_attempts(dsn, conn, tmp_path):
    q = Queue(conn)
    q.enqueue("s1", "A", [TaskSpec(f"s{i}", {"sleep": 30}) for i in range(2)], pool="s")
    q.enqueue("s2", "B", [TaskSpec(f"s{i}", {"sleep": 30}) for i in range(2)], pool="s")
    w = start_pool_worker(dsn, "s", "tests.support.handlers:record", "--concurrency", "4",
                          "--grace-period", "0.2", log=tmp_path / "w0.log")
    wait_for(lambda: conn.execute("SELECT count(*) AS n FROM exec_log").fetchone()["n"] == 4,
             60, what="4 tasks running")
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    rows = conn.execute("SELECT status, attempts FROM agent_work_queue WHERE pool = 's'"
                        ).fetchall()
    assert rows and all(r["status"] == "pending" and r["attempts"] == 0 for r in rows), rows
    assert q.counts("s1")["pending"] == 2 and q.counts("s2")["pending"] == 2


def test_a_pool_batch_with_a_reduce_step_is_reduced_once(dsn, conn, tmp_path):
    from jobrunner.features.reduce import ReduceSpec

    q = Queue(conn)
    q.enqueue("r1", "A", _tasks(30), pool="rp",
              reduce=ReduceSpec(handler="tests.support.reduce_handlers:count").as_json())
    q.enqueue("r2", "B", _tasks(20), pool="rp")
    workers = _pool_workers(dsn, "rp", 2, tmp_path, NOOP, "--exit-when-drained")
    for i, w in enumerate(workers):
        assert w.wait(60) == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
    row = conn.execute("SELECT result, reduced_at FROM agent_batch WHERE batch_id = 'r1'"
                       ).fetchone()
    assert row["reduced_at"] is not None and row["result"] == 30
    assert q.counts("r2")["done"] == 20


def test_the_pool_claim_shares_the_ack_and_shard_halves_of_ack_and_claim():
    """ack_and_claim_pool must ack, release and take shard leases exactly as ack_and_claim
    does: the shared text is kept identical, so a change to one fails here."""
    from jobrunner.store.sqlfiles import query

    plain, pooled = query("task_ack_and_claim"), query("task_ack_and_claim_pool")

    def between(text: str, start: str, end: str) -> str:
        return text[text.index(start):text.index(end, text.index(start))]

    for start, end in (("WITH lockable AS", "candidates AS ("),
                       ("one_per_shard AS (", "claimed AS (")):
        assert between(plain, start, end) == between(pooled, start, end)
    assert "WHERE q.pool = %(pool)s" in pooled and "ORDER BY q.vtag, q.id" in pooled


def test_cli_enqueue_into_a_pool_set_weight_and_show(dsn, conn):
    lines = "".join(f'{{"key": "k{i}", "payload": {{}}}}\n' for i in range(5))
    r = cli("enqueue", "-", "--batch", "c1", "--tenant", "A", "--pool", "cp", "--priority", "1",
            dsn=dsn, input=lines)
    assert r.returncode == 0, r.stderr
    row = conn.execute("SELECT pool, priority FROM agent_batch WHERE batch_id = 'c1'").fetchone()
    assert row == {"pool": "cp", "priority": 1}
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue WHERE pool = 'cp'"
                        " AND vtag IS NOT NULL").fetchone()["n"] == 5
    r = cli("enqueue", "-", "--batch", "c1", "--tenant", "A", "--pool", "other", dsn=dsn,
            input=lines)
    assert r.returncode == 2 and "belongs to pool 'cp'" in r.stderr
    assert cli("pool", "set-weight", "cp", "A", "2.5", dsn=dsn).returncode == 0
    r = cli("pool", "show", "cp", "--json", dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"tenant_id": "A", "weight": 2.5, "batches": 1,
                                     "pending": 5, "leased": 0}]
    r = cli("pool", "set-weight", "cp", "A", "0", dsn=dsn)
    assert r.returncode == 2 and "weight must be between 0.001 and 1000" in r.stderr


def test_a_generator_is_refused_on_a_pool_batch(conn):
    from jobrunner.features import generators

    Queue(conn).enqueue("g", "A", _tasks(1), pool="gp")
    spec = generators.GeneratorSpec(handler="tests.support.handlers:noop")
    with pytest.raises(BadInput, match="pools do not run generators yet"):
        generators.start(conn, "g", "A", spec)
    conn.rollback()
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue WHERE batch_id = 'g'"
                        ).fetchone()["n"] == 1
