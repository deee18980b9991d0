"""Rescue latency, asserted: README says a task whose worker died (kill -9) is returned
to pending "within about a second of locked_until" by any live worker, and then runs
again. The bound asserted here: every killed task is running again (its handler's second
execution has started, by the database's clock_timestamp()) no later than
locked_until + 2 s, and never before locked_until.

Where the second comes from: a live worker's expiry pass runs every expire_interval
(1 s by default), and an idle worker polls for work every 0.2-0.5 s (or is woken by the
expiry's NOTIFY). So a rescue takes up to ~1 s after locked_until, plus the next claim's
poll: 2 s leaves room for a loaded CI machine, while a rescue that waited for anything
else (a second lease, a restart) would exceed it. Measured distribution: printed as a
figure line (min / median / max over the killed tasks).
"""

from __future__ import annotations

import os
import signal
import statistics

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.figures import show
from tests.support.processes import start_worker, wait_for

LEASE = ["--visibility-timeout", "2", "--heartbeat", "0.5", "--backoff-base", "0.05",
         "--backoff-cap", "0.2"]
HANDLER = "tests.support.handlers:slow_first_attempt"
TASKS_PER_ROUND, ROUNDS, BOUND = 6, 2, 2.0


def _one(conn, sql: str, *args):
    row = conn.execute(sql, args).fetchone()
    conn.rollback()
    return row


def _round(dsn, conn, tmp_path, rescuer, rnd: int) -> list[float]:
    """One victim takes TASKS_PER_ROUND tasks and is killed mid-run: each task's rescue
    latency (its second run's start minus its final locked_until, both database time)."""
    keys = [f"r{rnd}-{i}" for i in range(TASKS_PER_ROUND)]
    victim = start_worker(dsn, "b", HANDLER, "--concurrency", str(TASKS_PER_ROUND),
                          "--batch-size", str(TASKS_PER_ROUND), *LEASE,
                          log=tmp_path / f"victim{rnd}.log")

    def count(sql: str) -> int:
        return _one(conn, sql, keys)["n"]

    # enqueued with the rescuer paused (SIGSTOP), so that the victim takes all of them
    os.kill(rescuer.pid, signal.SIGSTOP)
    try:
        Queue(conn).enqueue("b", "acme", [TaskSpec(k, {"sleep": 60}) for k in keys])
        wait_for(lambda: count("SELECT count(*) AS n FROM exec_log WHERE attempt = 1"
                               " AND task_key = ANY(%s)") == len(keys),
                 timeout=30, what="the victim to start every task")
    finally:
        os.kill(rescuer.pid, signal.SIGCONT)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    # no heartbeat can move locked_until any more: it is final
    deadline = {r["task_key"]: r["locked_until"] for r in conn.execute(
        "SELECT task_key, locked_until FROM agent_work_queue WHERE task_key = ANY(%s)",
        (keys,)).fetchall()}
    conn.rollback()
    assert all(deadline[k] is not None for k in keys), deadline
    wait_for(lambda: count("SELECT count(*) AS n FROM agent_work_queue"
                           " WHERE task_key = ANY(%s) AND status = 'done'") == len(keys),
             timeout=30, what="the rescued tasks to finish")
    with psycopg.connect(dsn, row_factory=dict_row) as c:
        reruns = {r["task_key"]: r["started_at"] for r in c.execute(
            "SELECT task_key, started_at FROM exec_log WHERE attempt = 2"
            " AND task_key = ANY(%s)", (keys,)).fetchall()}
    assert sorted(reruns) == sorted(keys)
    return [(reruns[k] - deadline[k]).total_seconds() for k in keys]


def test_a_killed_holders_tasks_run_again_within_locked_until_plus_2s(dsn, conn, tmp_path,
                                                                    capsys):
    # (a worker needs its batch to exist: a task the rescuer runs at once)
    Queue(conn).enqueue("b", "acme", [TaskSpec("warm-up", {})])
    rescuer = start_worker(dsn, "b", HANDLER, "--concurrency", str(TASKS_PER_ROUND), *LEASE,
                           log=tmp_path / "rescuer.log")
    # The bound assumes a live maintenance leader (it sweeps every second). A victim that
    # led would leave the rescue to the rescuer's takeover, 4-6 s later (docs/guarantees.md;
    # tests/test_waiting.py asserts that bound): seen in a cold CI run, where the rescuer
    # took 10 s to start and the first victim, started after it, led.
    wait_for(lambda: "is the maintenance leader" in (tmp_path / "rescuer.log").read_text(),
             timeout=60, what="the rescuer to lead the maintenance")
    latencies = [x for rnd in range(ROUNDS) for x in _round(dsn, conn, tmp_path, rescuer, rnd)]
    rescuer.terminate()
    show(capsys, f"rescue latency (second run's start - locked_until) over {len(latencies)} "
         f"tasks of kill -9'd holders: min={min(latencies):.2f}s "
         f"median={statistics.median(latencies):.2f}s max={max(latencies):.2f}s "
         f"(bound: 0 <= latency <= {BOUND:.0f}s)")
    assert all(0 <= x <= BOUND for x in latencies), sorted(latencies)
