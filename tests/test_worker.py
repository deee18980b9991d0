"""The worker as a real process: crashes, restarts, signals, lease loss, handlers."""

from __future__ import annotations

import os
import signal
import sys
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.processes import child_env, start_worker, wait_for

FAST = ["--visibility-timeout", "3", "--heartbeat", "1", "--backoff-base", "0.05",
        "--backoff-cap", "0.2"]


def q(conn) -> Queue:
    return Queue(conn)


def one(conn, sql: str, *args):
    row = conn.execute(sql, args).fetchone()
    conn.rollback()
    return row


def executions(conn, key: str | None = None) -> int:
    if key is None:
        return one(conn, "SELECT count(*) AS n FROM exec_log")["n"]
    return one(conn, "SELECT count(*) AS n FROM exec_log WHERE task_key = %s", key)["n"]


def assert_all_settled(conn, batch: str) -> dict:
    counts = q(conn).counts(batch)
    assert counts["leased"] == 0 and counts["pending"] == 0, counts
    return counts


def test_drains_and_exits_when_drained(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {}) for i in range(30)])
    worker = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                          "--concurrency", "4", log=tmp_path / "w.log")
    assert worker.wait(60) == 0
    assert q(conn).counts("b")["done"] == 30
    result = one(conn, "SELECT result FROM agent_work_queue WHERE task_key = 't3'")["result"]
    assert result == {"key": "t3"}


def test_exit_when_drained_waits_for_scheduled_retries(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec("flaky", {"succeed_on": 3})])
    worker = start_worker(dsn, "b", "tests.support.handlers:flaky", "--exit-when-drained",
                          *FAST, log=tmp_path / "w.log")
    assert worker.wait(60) == 0
    r = one(conn, "SELECT status, attempts FROM agent_work_queue")
    assert (r["status"], r["attempts"]) == ("done", 3)


def test_kill_9_mid_task_is_rerun_after_lease_expiry(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 2}, shard_key=f"s{i % 2}")
                                  for i in range(4)])
    victim = start_worker(dsn, "b", "tests.support.handlers:record", *FAST,
                          log=tmp_path / "victim.log")
    wait_for(lambda: executions(conn) >= 1, what="the victim to start a task")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    killed = one(conn, "SELECT task_key FROM exec_log ORDER BY started_at LIMIT 1")["task_key"]
    rescuer = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                           "--concurrency", "2", *FAST, log=tmp_path / "rescuer.log")
    assert rescuer.wait(90) == 0
    counts = assert_all_settled(conn, "b")
    assert counts["done"] == 4
    r = one(conn, "SELECT attempts, last_error FROM agent_work_queue WHERE task_key = %s", killed)
    assert r["attempts"] == 2 and "lease expired" in r["last_error"]
    assert executions(conn, killed) == 2


def test_postgres_restart_mid_run(own_server, tmp_path):
    dsn = own_server.dsn()
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        conn.execute("CREATE TABLE exec_log (task_id bigint, task_key text, shard_key text,"
                     " attempt int, worker text, started_at timestamptz, ended_at timestamptz)")
        conn.commit()
        q(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 0.05}, shard_key=f"s{i % 3}")
                                      for i in range(150)])
    workers = [start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                            "--concurrency", "2", *FAST, log=tmp_path / f"w{i}.log")
               for i in range(3)]

    def done() -> int:
        with psycopg.connect(dsn, row_factory=dict_row) as c:
            return q(c).counts("b")["done"]

    wait_for(lambda: done() >= 20, what="progress before the first restart")
    own_server.restart("fast")
    wait_for(lambda: done() >= 60, what="progress after a fast restart")
    own_server.restart("immediate")
    for w in workers:
        assert w.wait(180) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        counts = assert_all_settled(conn, "b")
        assert counts["done"] == 150
    log = "".join((tmp_path / f"w{i}.log").read_text() for i in range(3))
    assert "database unavailable" in log or "heartbeat:" in log


def test_poison_task_goes_dead_and_does_not_block(dsn, conn, tmp_path):
    specs = [TaskSpec(f"t{i}", {}, shard_key="one-shard") for i in range(5)]
    specs.insert(0, TaskSpec("poison", {"poison": True}, shard_key="one-shard"))
    q(conn).enqueue("b", "acme", specs)
    worker = start_worker(dsn, "b", "tests.support.handlers:poison_or_record",
                          "--exit-when-drained", *FAST, log=tmp_path / "w.log")
    assert worker.wait(60) == 0
    counts = assert_all_settled(conn, "b")
    assert (counts["done"], counts["dead"]) == (5, 1)
    dead = q(conn).list_dead("b")
    assert dead[0]["task_key"] == "poison"
    assert "PermanentError: poison task poison" in dead[0]["last_error"]
    assert dead[0]["attempts"] == 1


def test_retryable_failures_end_dead_after_max_attempts(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec("t", {})], max_attempts=3)
    worker = start_worker(dsn, "b", "tests.support.handlers:always_fails",
                          "--exit-when-drained", *FAST, log=tmp_path / "w.log")
    assert worker.wait(60) == 0
    r = one(conn, "SELECT status, attempts, last_error FROM agent_work_queue")
    assert (r["status"], r["attempts"]) == ("dead", 3)
    assert "RuntimeError: this handler always fails" in r["last_error"]


def test_sigterm_releases_running_tasks_without_burning_attempts(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 30}) for i in range(2)])
    worker = start_worker(dsn, "b", "tests.support.handlers:record", "--concurrency", "2",
                          "--grace-period", "1", log=tmp_path / "w.log")
    wait_for(lambda: executions(conn) == 2, what="both tasks to start")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    rows = conn.execute("SELECT status, attempts, lease_owner FROM agent_work_queue").fetchall()
    conn.rollback()
    assert rows == [{"status": "pending", "attempts": 0, "lease_owner": None}] * 2


def test_sigterm_lets_short_tasks_finish(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec("t", {"sleep": 1.5})])
    worker = start_worker(dsn, "b", "tests.support.handlers:record", "--grace-period", "20",
                          log=tmp_path / "w.log")
    wait_for(lambda: executions(conn) == 1, what="the task to start")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert one(conn, "SELECT status FROM agent_work_queue")["status"] == "done"


def test_long_handler_is_kept_alive_by_heartbeats_and_runs_once(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec("long", {"sleep": 7})])
    workers = [start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                            *FAST, log=tmp_path / f"w{i}.log") for i in range(2)]
    for w in workers:
        assert w.wait(60) == 0
    r = one(conn, "SELECT status, attempts FROM agent_work_queue")
    assert (r["status"], r["attempts"]) == ("done", 1)
    assert executions(conn, "long") == 1


def test_lease_lost_kills_command_handler_and_never_acks(dsn, conn, tmp_path):
    marker = tmp_path / "finished"
    q(conn).enqueue("b", "acme", [TaskSpec("cmd", {})])
    cmd = f"sleep 20; touch {marker}"
    args = [sys.executable, "-m", "jobrunner", "worker", "--batch", "b", "--handler-cmd", cmd,
            *FAST]
    import subprocess

    log = open(tmp_path / "w.log", "ab")  # noqa: SIM115
    worker = subprocess.Popen(args, env=child_env(dsn), stdout=log, stderr=log,
                              start_new_session=True)
    try:
        wait_for(lambda: one(conn, "SELECT status FROM agent_work_queue")["status"] == "leased")
        # Someone else takes the task over (as after an expiry): the lease is gone.
        conn.execute("UPDATE agent_work_queue SET lease_owner = 'intruder',"
                     " attempts = attempts + 1")
        conn.commit()
        wait_for(lambda: "lease lost" in (tmp_path / "w.log").read_text(), timeout=20,
                 what="the worker to notice the lost lease")
        time.sleep(1)
        r = one(conn, "SELECT status, lease_owner FROM agent_work_queue")
        assert (r["status"], r["lease_owner"]) == ("leased", "intruder")
        for pattern in (f"^/bin/sh -c sleep 20; touch {marker}", "^sleep 20$"):
            out = subprocess.run(["pgrep", "-f", pattern], capture_output=True)
            assert out.stdout.strip() == b"", f"the command handler ({pattern}) was not killed"
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert not marker.exists()
    # the worker counted its outcome lost and dropped it: it sent nothing for the task
    # (the fenced ack would have changed nothing either; this is the worker's own rule)
    assert "'lost': 1" in (tmp_path / "w.log").read_text()


def test_lease_lost_to_failed_heartbeats_is_never_recorded(dsn, conn, tmp_path):
    """A worker that gave its lease up (no renewal for a whole lease) records nothing for
    the attempt, even when the row still names it: there the database's fence on (id,
    owner, attempt) would let the outcome through, so only the worker's rule keeps it
    out. (A lease lost to a re-claim is refused by that fence whatever the worker sends,
    which is why the command-handler test above cannot tell.)"""
    q(conn).enqueue("b", "acme", [TaskSpec("held", {"sleep": 60})], max_attempts=1)
    worker = start_worker(dsn, "b", "tests.support.handlers:record", *FAST,
                          log=tmp_path / "w.log")
    try:
        wait_for(lambda: executions(conn, "held") == 1, what="the task to start")
        owner = one(conn, "SELECT lease_owner FROM agent_work_queue")["lease_owner"]
        # A row lock held past the heartbeat's statement timeout: no renewal lands, so the
        # worker gives the lease up, while the row stays leased to it.
        with psycopg.connect(dsn) as locker:
            locker.execute("SELECT 1 FROM agent_work_queue WHERE task_key = 'held' FOR UPDATE")
            wait_for(lambda: "no heartbeat succeeded for a whole lease"
                     in (tmp_path / "w.log").read_text(), timeout=30,
                     what="the worker to give the lease up")
            # No rescue may end the attempt before the worker's outcome would reach the
            # row: then only an outcome the worker sent can change it.
            locker.execute("UPDATE agent_work_queue SET locked_until = now() + interval '1 hour'"
                           " WHERE task_key = 'held'")
        # The stopped handler's outcome rides on the statement that claims the next task
        # (concurrency 1: nothing is claimed before that handler is done), so once "after"
        # runs, whatever the worker was going to send about "held" has been committed.
        q(conn).enqueue("b", "acme", [TaskSpec("after", {})])
        wait_for(lambda: executions(conn, "after") == 1, what="the next task to start")
        r = one(conn, "SELECT status, lease_owner, attempts, last_error FROM agent_work_queue"
                      " WHERE task_key = 'held'")
        assert r == {"status": "leased", "lease_owner": owner, "attempts": 1,
                     "last_error": None}, "the worker recorded an attempt it had given up"
        ended = one(conn, "SELECT ended_at FROM exec_log WHERE task_key = 'held'")["ended_at"]
        assert ended is None  # its handler was stopped, not left to finish
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def test_stalled_worker_loses_lease_and_applies_no_effect(dsn, conn, tmp_path):
    """SIGSTOP past the lease, SIGCONT: the stale worker must not ack or apply its effect."""
    q(conn).enqueue("b", "acme", [TaskSpec("t", {"sleep": 1.0})])
    stale = start_worker(dsn, "b", "tests.support.handlers:stalls_then_effect", *FAST,
                         log=tmp_path / "stale.log")
    wait_for(lambda: executions(conn) == 1, what="the first attempt to start")
    os.killpg(stale.pid, signal.SIGSTOP)
    try:
        rescuer = start_worker(dsn, "b", "tests.support.handlers:stalls_then_effect",
                               "--exit-when-drained", *FAST, log=tmp_path / "rescuer.log")
        assert rescuer.wait(60) == 0
    finally:
        os.killpg(stale.pid, signal.SIGCONT)
    time.sleep(3)
    stale.send_signal(signal.SIGTERM)
    stale.wait(30)
    r = one(conn, "SELECT status, attempts, result FROM agent_work_queue")
    assert (r["status"], r["attempts"]) == ("done", 2)
    effects = conn.execute("SELECT attempt FROM effect_out").fetchall()
    conn.rollback()
    assert effects == [{"attempt": 2}], "the stale worker applied its effect"
    assert r["result"]["applied_by"] != "stale"


def test_effect_is_applied_once_across_a_crash(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec("t", {"sleep": 30})])
    victim = start_worker(dsn, "b", "tests.support.handlers:with_effect", *FAST,
                          log=tmp_path / "victim.log")
    wait_for(lambda: one(conn, "SELECT count(*) AS n FROM effect_out")["n"] == 1,
             what="the effect to be applied")
    os.killpg(victim.pid, signal.SIGKILL)  # crash after the effect, before the ack
    victim.wait()
    conn.execute("UPDATE agent_work_queue SET payload = '{\"sleep\": 0}'")
    conn.commit()
    rescuer = start_worker(dsn, "b", "tests.support.handlers:with_effect",
                           "--exit-when-drained", *FAST, log=tmp_path / "rescuer.log")
    assert rescuer.wait(60) == 0
    r = one(conn, "SELECT status, attempts, result FROM agent_work_queue")
    assert (r["status"], r["attempts"]) == ("done", 2)
    assert one(conn, "SELECT count(*) AS n FROM effect_out")["n"] == 1
    assert executions(conn) == 2  # the handler itself ran twice: at-least-once
    ledger = one(conn, "SELECT attempt FROM agent_task_effect")
    assert ledger["attempt"] == 1


def test_async_handler(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 0.1}) for i in range(4)])
    worker = start_worker(dsn, "b", "tests.support.handlers:async_record",
                          "--exit-when-drained", "--concurrency", "4", log=tmp_path / "w.log")
    assert worker.wait(60) == 0
    assert q(conn).counts("b")["done"] == 4


@pytest.mark.parametrize(("script", "status", "attempts", "error"), [
    ("import sys, json; d = json.load(sys.stdin); print(json.dumps({'got': d['n']}))",
     "done", 1, None),
    ("import sys; sys.exit(75)", "dead", 2, "asked for a retry"),
    ("import sys; print('bad things', file=sys.stderr); sys.exit(3)", "dead", 1,
     "exit code 3: bad things"),
])
def test_command_handler_exit_codes(dsn, conn, tmp_path, script, status, attempts, error):
    import subprocess

    q(conn).enqueue("b", "acme", [TaskSpec("t", {"n": 7})], max_attempts=2)
    cmd = f"{sys.executable} -c \"{script}\""
    args = [sys.executable, "-m", "jobrunner", "worker", "--batch", "b", "--handler-cmd", cmd,
            "--exit-when-drained", *FAST]
    assert subprocess.run(args, env=child_env(dsn), capture_output=True, timeout=60
                          ).returncode == 0
    r = one(conn, "SELECT status, attempts, last_error, result FROM agent_work_queue")
    assert (r["status"], r["attempts"]) == (status, attempts)
    if error:
        assert error in r["last_error"]
    else:
        assert r["result"] == {"got": 7}


def test_command_handler_gets_task_environment(dsn, conn, tmp_path):
    import subprocess

    q(conn).enqueue("b", "acme", [TaskSpec("k1", {}, shard_key="s1")])
    cmd = ("python -c \"import os, json; print(json.dumps({k: v for k, v in os.environ.items()"
           " if k.startswith('JOBRUNNER_')}))\"")
    args = [sys.executable, "-m", "jobrunner", "worker", "--batch", "b", "--handler-cmd", cmd,
            "--exit-when-drained"]
    subprocess.run(args, env=child_env(dsn), capture_output=True, timeout=60, check=True)
    env = one(conn, "SELECT result FROM agent_work_queue")["result"]
    assert env["JOBRUNNER_TASK_KEY"] == "k1" and env["JOBRUNNER_SHARD_KEY"] == "s1"
    assert env["JOBRUNNER_BATCH_ID"] == "b" and env["JOBRUNNER_ATTEMPT"] == "1"
    assert "JOBRUNNER_DATABASE_URL" not in env  # the command gets its task, not the queue
    # every variable README promises, as strings (the result is the command's JSON stdout)
    promised = {f"JOBRUNNER_{n}" for n in ("TASK_ID", "TASK_KEY", "BATCH_ID", "TENANT_ID",
                                           "SHARD_KEY", "ATTEMPT", "WORKER_ID",
                                           "IDEMPOTENCY_KEY")}
    assert promised <= set(env) and all(isinstance(v, str) for v in env.values()), env
    assert env["JOBRUNNER_TENANT_ID"] == "acme"


def test_notify_wakes_an_idle_worker_long_before_its_poll(dsn, conn, tmp_path):
    """With a 60 s poll interval, only the NOTIFY sent by enqueue can start the task soon."""
    q(conn).enqueue("b", "acme", [TaskSpec("first", {})])
    worker = start_worker(dsn, "b", "tests.support.handlers:record", "--poll-interval", "60",
                          log=tmp_path / "w.log")
    try:
        wait_for(lambda: executions(conn) == 1, timeout=30, what="the first task")
        time.sleep(1)  # the worker is now idle, sleeping up to 60 s
        q(conn).enqueue("b", "acme", [TaskSpec("second", {})])
        wait_for(lambda: executions(conn, "second") == 1, timeout=20,
                 what="the NOTIFY wake-up (polling alone would take 24-60 s)")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def test_polling_finds_work_without_notify(dsn, conn, tmp_path):
    q(conn).enqueue("b", "acme", [TaskSpec("first", {})])
    worker = start_worker(dsn, "b", "tests.support.handlers:record", "--no-listen",
                          "--poll-interval", "0.3", log=tmp_path / "w.log")
    try:
        wait_for(lambda: executions(conn) == 1, timeout=30, what="the first task")
        q(conn).enqueue("b", "acme", [TaskSpec("second", {})])
        wait_for(lambda: executions(conn, "second") == 1, timeout=30, what="polling")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def test_worker_ids_are_unique_per_process_start():
    from jobrunner.worker.config import default_worker_id

    ids = {default_worker_id("pod-a") for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("pod-a-") for i in ids)
