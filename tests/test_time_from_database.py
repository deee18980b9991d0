"""Time comes from the database, never from a worker's clock (README's guarantees),
proven with worker processes whose clock is off by hours: libfaketime (Debian's
`faketime` package, in the Makefile's SYSTEM_PACKAGES) preloaded into the worker with
FAKETIME="-3h" or "+5h". Their monotonic clock is left alone (it has no epoch to be
wrong about; the worker's intervals use it).

A worker 3 h behind must still hold a lease for the whole visibility timeout and keep it
by heartbeats (a deadline from its clock would be 3 h in the past: rescued at once, run
twice); a worker 5 h ahead that is killed must be rescued within locked_until + 2 s (a
deadline from its clock: 5 h later); a retry waits its backoff on the database's clock.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.processes import child_env, start_worker, wait_for

LEASE = ["--visibility-timeout", "2", "--heartbeat", "0.5", "--backoff-base", "1",
         "--backoff-cap", "10"]
HANDLER = "tests.support.handlers:skew_probe"


def _libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
                   + glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    if not found:  # (under CI=true a skip fails: tests/conftest.py)
        pytest.skip("libfaketime is not installed (make system-deps installs `faketime`)")
    return found[0]


# libfaketime 0.9.10 (Debian 12) fails Python's time.sleep with EINVAL when the monotonic
# clock is left alone (its clock_nanosleep wrapper shifts the absolute CLOCK_MONOTONIC
# deadline Python passes), and hangs it when that clock is faked too. Every other wait
# (Event.wait, select, lock and queue timeouts) works, so the worker processes get a
# time.sleep made of select(): a sitecustomize on their PYTHONPATH. Only sleeping
# changes; every clock read (time.time, datetime.now, ...) is the faked one.
SLEEP_SHIM = """
import select, time

def _sleep(seconds):
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        select.select([], [], [], left)

time.sleep = _sleep
"""


def skewed_env(dsn: str, offset: str, shim_dir) -> dict[str, str]:
    (shim_dir / "sitecustomize.py").write_text(SLEEP_SHIM)
    env = child_env(dsn, LD_PRELOAD=_libfaketime(), FAKETIME=offset,
                    FAKETIME_DONT_FAKE_MONOTONIC="1")
    env["PYTHONPATH"] = f"{shim_dir}:{env['PYTHONPATH']}"
    return env


def _clock_of(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", "import time, datetime; time.sleep(0.01);"
                          " print(time.time(), datetime.datetime.now().timestamp())"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    now = time.time()
    assert abs(float(out[0]) - float(out[1])) < 5  # datetime sees the same skewed clock
    return float(out[0]) - now


def _one(conn, sql: str, *args):
    row = conn.execute(sql, args).fetchone()
    conn.rollback()
    return row


def test_workers_with_clocks_off_by_hours_lease_heartbeat_back_off_and_are_rescued(
        dsn, conn, tmp_path):
    behind, ahead = skewed_env(dsn, "-3h", tmp_path), skewed_env(dsn, "+5h", tmp_path)
    # the skew is real in the worker's process (what time.time() and datetime.now() see)
    assert abs(_clock_of(behind) + 3 * 3600) < 60 and abs(_clock_of(ahead) - 5 * 3600) < 60

    # 1. Lease, heartbeat and backoff, by a worker 3 h behind.
    Queue(conn).enqueue("b", "acme", [TaskSpec("long", {"sleep": 5}),
                                      TaskSpec("flaky", {"fail_first": True})])
    slow = start_worker(dsn, "b", HANDLER, "--concurrency", "2", "--exit-when-drained", *LEASE,
                        env=behind, log=tmp_path / "behind.log")
    wait_for(lambda: _one(conn, "SELECT count(*) AS n FROM exec_log WHERE task_key = 'long'"
                          )["n"] == 1, timeout=30, what="the long task to start")
    remaining = []
    for _ in range(6):  # its deadline, while it runs: now() + about the lease, never past
        r = _one(conn, "SELECT status, extract(epoch FROM locked_until - now())::float8 AS left"
                 " FROM agent_work_queue WHERE task_key = 'long'")
        if r["status"] == "leased":
            remaining.append(r["left"])
        time.sleep(0.5)
    assert slow.wait(60) == 0, (tmp_path / "behind.log").read_text()[-3000:]
    assert remaining and all(0 < x <= 2.1 for x in remaining), remaining
    long = _one(conn, "SELECT status, attempts FROM agent_work_queue WHERE task_key = 'long'")
    assert (long["status"], long["attempts"]) == ("done", 1)  # heartbeats kept its lease
    assert _one(conn, "SELECT count(*) AS n FROM exec_log WHERE task_key = 'long'")["n"] == 1
    flaky = _one(conn, "SELECT status, attempts, updated_at FROM agent_work_queue"
                 " WHERE task_key = 'flaky'")
    assert (flaky["status"], flaky["attempts"]) == ("done", 2)
    # the retry waited its backoff (base 1 s * 2^1, up to 25 % more) on the database's
    # clock: its second run started at least 2 s after the first one (which failed)
    runs = [r["started_at"] for r in conn.execute(
        "SELECT started_at FROM exec_log WHERE task_key = 'flaky' ORDER BY attempt").fetchall()]
    conn.rollback()
    assert len(runs) == 2 and (runs[1] - runs[0]).total_seconds() >= 2.0, runs

    # 2. Expiry: a worker 5 h ahead is killed holding a task; one 3 h behind rescues it.
    Queue(conn).enqueue("b", "acme", [TaskSpec("victim", {"sleep": 60})])
    # The rescuer behind must be the one that sweeps: the worker ahead does not stand for the
    # maintenance election (--no-listen), or, elected first, its death would hand the sweep
    # over only at the next candidate's retry (up to 6 s: docs/guarantees.md), not within
    # the one-second sweep this bound is about.
    fast = start_worker(dsn, "b", HANDLER, *LEASE, "--no-listen", env=ahead,
                        log=tmp_path / "ahead.log")
    wait_for(lambda: _one(conn, "SELECT count(*) AS n FROM exec_log WHERE task_key = 'victim'"
                          )["n"] == 1, timeout=30, what="the victim task to start")
    rescuer = start_worker(dsn, "b", HANDLER, "--exit-when-drained", "--worker-id",
                           "rescuer-behind", *LEASE, env=behind, log=tmp_path / "rescuer.log")
    wait_for(lambda: _one(conn, "SELECT count(*) AS n FROM pg_stat_activity"
                          " WHERE application_name LIKE %s", "%rescuer-behind%")["n"] >= 1,
             timeout=30, what="the rescuer to connect")
    os.killpg(fast.pid, signal.SIGKILL)
    fast.wait()
    deadline = _one(conn, "SELECT locked_until, extract(epoch FROM locked_until - now())::float8"
                    " AS left FROM agent_work_queue WHERE task_key = 'victim'")
    assert deadline["left"] <= 2.1, deadline  # (not 5 h ahead)
    assert rescuer.wait(60) == 0, (tmp_path / "rescuer.log").read_text()[-3000:]
    rerun = _one(conn, "SELECT started_at FROM exec_log WHERE task_key = 'victim'"
                 " AND attempt = 2")
    assert rerun is not None
    assert 0 <= (rerun["started_at"] - deadline["locked_until"]).total_seconds() <= 2.0
