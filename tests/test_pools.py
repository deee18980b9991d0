"""Worker pools (issue 18, docs/pools.md): workers that claim across every open batch of
a pool, fair across tenants by weight, batch priorities; every claim guarantee holds.
Real PostgreSQL, real worker processes; times are the database's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobrunner import pools
from jobrunner.errors import BadInput
from jobrunner.queue import Outcome, Queue
from jobrunner.validation import TaskSpec
from tests.conftest import REPO, _spawned, child_env, cli, wait_for

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
    _spawned.append(proc)
    return proc


def _stop(workers: list[subprocess.Popen], tmp_path: Path) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    for i, w in enumerate(workers):
        code = w.wait(60)
        assert code == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]


def _done(conn, batch: str) -> int:
    return conn.execute("SELECT count(*) AS n FROM agent_work_queue"
                        " WHERE batch_id = %s AND status = 'done'", (batch,)).fetchone()["n"]


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
    with pytest.raises(BadInput, match="names limit 'gpt'"):
        q.enqueue("n", "A", _tasks(3, limits=("gpt",)), pool="p")
    with pytest.raises(BadInput, match="names limit 'gpt'"):
        q.enqueue("n", "A", _tasks(3), pool="p", limits=["gpt"])
    with pytest.raises(BadInput, match="pools do not take"):
        q.set_budget("b", tokens=100)
    for bad in (0, -1, float("nan"), 2_000_000, "3"):
        with pytest.raises(BadInput, match="weight must be"):
            pools.set_weight(conn, "p", "A", bad)
    conn.rollback()
    assert q.counts("b")["pending"] == 2
    assert conn.execute("SELECT count(*) AS n FROM agent_batch WHERE batch_id = 'n'"
                        ).fetchone()["n"] == 0
    r = cli("worker", "--handler", NOOP, dsn=str(conn.info.dsn))
    assert r.returncode == 2 and "exactly one of --batch and --pool" in r.stderr
