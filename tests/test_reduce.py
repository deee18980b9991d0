"""Reduce (issue 17): a step that runs exactly once after every task of its batch is
terminal, as a task of its own; its return value is the batch's result. Real PostgreSQL,
real worker processes, kill -9."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.features import reduce
from jobrunner.features.reduce import REDUCE_KEY, ReduceSpec
from jobrunner.model.errors import BadInput
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.processes import child_env, cli, start_worker, wait_for
from tests.support.reduce_handlers import SLEEP_ENV

FAST = ["--visibility-timeout", "3", "--heartbeat", "1", "--backoff-base", "0.05",
        "--backoff-cap", "0.2"]
COLLECT = "tests.support.reduce_handlers:collect"


def enqueue(conn, batch: str, tasks: list[TaskSpec], step: str = COLLECT,
            on_dead: str = "fail") -> None:
    Queue(conn).enqueue(batch, "acme", tasks,
                        reduce=ReduceSpec(handler=step, on_dead=on_dead).as_json())


def one(conn, sql: str, *args):
    row = conn.execute(sql, args).fetchone()
    conn.rollback()
    return row


def reduce_row(conn, batch: str = "b") -> dict | None:
    return one(conn, "SELECT status::text, attempts, result, last_error FROM agent_work_queue"
                     " WHERE batch_id = %s AND task_key = %s", batch, REDUCE_KEY)


def reduce_runs(conn) -> int:
    return one(conn, "SELECT count(*) AS n FROM exec_log WHERE task_key = %s", REDUCE_KEY)["n"]


def batch_result(conn, batch: str = "b"):
    found = reduce.batch_result(conn, batch)
    return found.value() if found and found.stored else None


def workers(dsn: str, n: int, handler: str, *extra: str, tmp_path: Path,
            env: dict[str, str] | None = None) -> list:
    return [start_worker(dsn, "b", handler, "--exit-when-drained", *FAST, *extra,
                         env=env, log=tmp_path / f"w{i}.log") for i in range(n)]


def test_reduce_runs_once_after_every_task_and_its_result_is_the_batchs(dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec(f"t{i:02d}", {"sleep": 0.05}) for i in range(20)])
    assert Queue(conn).counts("b")["pending"] == 20
    procs = workers(dsn, 2, "tests.support.handlers:record", "--concurrency", "2",
                    tmp_path=tmp_path)
    assert [p.wait(90) for p in procs] == [0, 0]
    row = reduce_row(conn)
    assert (row["status"], row["attempts"]) == ("done", 1)
    assert reduce_runs(conn) == 1
    result = batch_result(conn)
    assert result["count"] == 20
    assert [r["key"] for r in result["seen"]] == [f"t{i:02d}" for i in range(20)]  # key order
    assert result["seen"][3] == {"key": "t03", "status": "done", "result": {"key": "t03"},
                                 "error": None}
    # The reduce is not one of the batch's tasks: counts and exports leave it out.
    assert Queue(conn).counts("b") == {"pending": 0, "leased": 0, "done": 20, "dead": 0,
                                       "cancelled": 0}
    exported = cli("results", "--batch", "b", dsn=dsn, check=True).stdout.splitlines()
    assert len(exported) == 20 and all(REDUCE_KEY not in line for line in exported)
    status = json.loads(cli("status", "--batch", "b", "--json", dsn=dsn, check=True).stdout)
    assert status["done"] == 20 and status["total"] == 20
    assert status["reduce"]["state"] == "done" and status["reduce"]["result"] == result
    whole = cli("results", "--batch", "b", "--reduce", dsn=dsn, check=True).stdout
    assert json.loads(whole) == result
    text = cli("status", "--batch", "b", dsn=dsn, check=True).stdout
    assert "reduce: done" in text and "jobrunner results --batch b --reduce" in text


def test_kill_9_of_the_worker_running_the_reduce_reruns_it_and_its_effect_applies_once(
        dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec(f"t{i}", {}) for i in range(5)])
    victim = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                          *FAST, env=child_env(dsn, **{SLEEP_ENV: "60"}),
                          log=tmp_path / "victim.log")
    wait_for(lambda: one(conn, "SELECT count(*) AS n FROM effect_out")["n"] == 1, timeout=60,
             what="the reduce to apply its effect")
    assert reduce_row(conn)["status"] == "leased"
    os.killpg(victim.pid, signal.SIGKILL)  # after its effect, before its result or ack
    victim.wait()
    assert batch_result(conn) is None
    rescuer = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                           *FAST, log=tmp_path / "rescuer.log")
    assert rescuer.wait(60) == 0
    row = reduce_row(conn)
    assert (row["status"], row["attempts"]) == ("done", 2)
    assert "lease expired" in row["last_error"]
    assert reduce_runs(conn) == 2  # at-least-once: the step itself ran again
    effects = one(conn, "SELECT count(*) AS n, min(attempt) AS attempt FROM effect_out")
    assert (effects["n"], effects["attempt"]) == (1, 1)  # its effect: once, by attempt 1
    assert batch_result(conn)["count"] == 5
    stored = one(conn, "SELECT attempt FROM agent_task_effect WHERE effect_key = %s",
                 reduce.RESULT_EFFECT)
    assert stored["attempt"] == 2
    assert one(conn, "SELECT count(*) AS n FROM agent_work_queue WHERE task_key = %s",
               REDUCE_KEY)["n"] == 1


def test_workers_racing_to_finish_the_last_tasks_enqueue_one_reduce(dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec(f"t{i:03d}", {"sleep": 0.1}) for i in range(48)],
            step="tests.support.reduce_handlers:count")
    procs = workers(dsn, 6, "tests.support.handlers:record", "--concurrency", "2",
                    tmp_path=tmp_path)
    assert [p.wait(120) for p in procs] == [0] * 6
    assert one(conn, "SELECT count(*) AS n FROM agent_work_queue WHERE task_key = %s",
               REDUCE_KEY)["n"] == 1
    assert reduce_runs(conn) == 1
    assert batch_result(conn) == 48
    # Every worker stayed until the reduce was done: none exited before it finished.
    reduced_at = one(conn, "SELECT reduced_at FROM agent_batch WHERE batch_id = 'b'")
    assert reduced_at["reduced_at"] is not None


def test_concurrent_triggers_insert_one_reduce_task(dsn, conn):
    enqueue(conn, "b", [TaskSpec("t", {})])
    conn.execute("UPDATE agent_work_queue SET status = 'done', finished_at = now()")
    conn.commit()
    start = threading.Barrier(12)
    states: list[str | None] = []

    def fire() -> None:
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as c:
            start.wait()
            states.append(reduce.trigger(c, "b").task_status)

    threads = [threading.Thread(target=fire) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert states == ["pending"] * 12  # each saw the one reduce task after its call
    assert one(conn, "SELECT count(*) AS n FROM agent_work_queue WHERE task_key = %s",
               REDUCE_KEY)["n"] == 1
    st = reduce.state(conn, "b")
    assert st.enqueued and not st.due and st.task_status == "pending"
    assert reduce.trigger(conn, "b").task_status == "pending"  # and again: nothing new


def test_a_late_retry_as_the_last_task_delays_the_reduce_until_it_succeeds(dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec("ok-1", {}), TaskSpec("ok-2", {}),
                        TaskSpec("late", {"succeed_on": 4})])
    proc = start_worker(dsn, "b", "tests.support.handlers:flaky", "--exit-when-drained",
                        "--visibility-timeout", "3", "--heartbeat", "1", "--backoff-base",
                        "0.3", "--backoff-cap", "1", log=tmp_path / "w.log")
    assert proc.wait(60) == 0
    late = one(conn, "SELECT attempts, finished_at FROM agent_work_queue WHERE task_key = 'late'")
    assert late["attempts"] == 4
    assert reduce_runs(conn) == 1
    started = one(conn, "SELECT started_at FROM exec_log WHERE task_key = %s", REDUCE_KEY)
    assert started["started_at"] > late["finished_at"]
    seen = batch_result(conn)["seen"]
    assert [(r["key"], r["status"]) for r in seen] == [("late", "done"), ("ok-1", "done"),
                                                       ("ok-2", "done")]


def _poisoned(conn, on_dead: str) -> None:
    enqueue(conn, "b", [TaskSpec("a", {}), TaskSpec("b", {"poison": True}), TaskSpec("c", {})],
            on_dead=on_dead)


def test_on_dead_fail_never_runs_the_reduce_until_the_dead_tasks_are_fixed(dsn, conn, tmp_path):
    _poisoned(conn, "fail")
    proc = start_worker(dsn, "b", "tests.support.handlers:poison_or_record",
                        "--exit-when-drained", *FAST, log=tmp_path / "w.log")
    assert proc.wait(60) == 0  # drained: nothing is due
    assert reduce_row(conn) is None and reduce_runs(conn) == 0
    st = reduce.state(conn, "b")
    assert not st.due and not st.enqueued
    counts = Queue(conn).counts("b")
    assert st.phase(counts) == "skipped"
    status = json.loads(cli("status", "--batch", "b", "--json", dsn=dsn).stdout)
    assert status["reduce"]["state"] == "skipped"
    assert status["top_errors"][0]["message"].startswith("PermanentError: poison task b")
    # Decided from the rows: once the dead task is requeued and done, the reduce runs.
    conn.execute("UPDATE agent_work_queue SET payload = '{}' WHERE task_key = 'b'")
    conn.commit()
    assert Queue(conn).requeue_dead("b") == 1
    proc = start_worker(dsn, "b", "tests.support.handlers:poison_or_record",
                        "--exit-when-drained", *FAST, log=tmp_path / "w2.log")
    assert proc.wait(60) == 0
    assert reduce_runs(conn) == 1
    assert [r["key"] for r in batch_result(conn)["seen"]] == ["a", "b", "c"]


@pytest.mark.parametrize(("on_dead", "expected"), [
    ("skip", [("a", "done", None), ("c", "done", None)]),
    ("include", [("a", "done", None), ("b", "dead", "PermanentError: poison task b"),
                 ("c", "done", None)]),
])
def test_on_dead_skip_and_include(dsn, conn, tmp_path, on_dead, expected):
    _poisoned(conn, on_dead)
    proc = start_worker(dsn, "b", "tests.support.handlers:poison_or_record",
                        "--exit-when-drained", *FAST, log=tmp_path / "w.log")
    assert proc.wait(60) == 0
    assert reduce_runs(conn) == 1
    seen = batch_result(conn)["seen"]
    assert [(r["key"], r["status"], r["error"] and r["error"].split(" (at ")[0])
            for r in seen] == expected
    dead = next((r for r in seen if r["status"] == "dead"), None)
    assert dead is None or dead["result"] is None


def test_a_batch_cancelled_mid_run_never_reduces(dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec(f"t{i}", {"sleep": 1}) for i in range(6)])
    proc = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                        *FAST, log=tmp_path / "w.log")
    wait_for(lambda: one(conn, "SELECT count(*) AS n FROM exec_log")["n"] >= 1,
             what="the first task to start")
    assert cli("cancel", "--batch", "b", dsn=dsn).returncode == 0
    assert proc.wait(60) == 0
    counts = Queue(conn).counts("b")
    assert counts["cancelled"] >= 1 and counts["pending"] == counts["leased"] == 0
    assert reduce_row(conn) is None and reduce_runs(conn) == 0
    st = reduce.trigger(conn, "b")
    assert st.phase(counts) == "cancelled" and not st.enqueued


def test_a_cancel_committed_as_the_trigger_fires_stops_the_reduce(dsn, conn, tmp_path):
    """The trigger's lock-free look says "due"; a cancel that commits before it takes the
    batch's lock must still stop the reduce: the batch row is read again under the lock.
    (A batch cancelled before that look is never even tried, which is why the mid-run
    cancel above cannot tell.) Every task is done already, so the cancel changes no task
    and the batch stays settled: only cancelled_at says no."""
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {}) for i in range(3)])
    assert [p.wait(60) for p in workers(dsn, 1, "tests.support.handlers:record",
                                        tmp_path=tmp_path)] == [0]
    # The reduce step comes after the run (the operator's attach), so no worker has
    # enqueued it yet: the batch is settled and the reduce due.
    reduce.attach(conn, "b", ReduceSpec(handler=COLLECT))
    assert reduce.state(conn, "b").due
    fired: list = []

    def fire() -> None:
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row,
                             application_name="reduce-trigger") as c:
            fired.append(reduce.trigger(c, "b"))

    def trigger_waits_for_the_batch_lock() -> bool:
        return one(conn, "SELECT count(*) AS n FROM pg_stat_activity"
                         " WHERE application_name = 'reduce-trigger'"
                         " AND wait_event_type = 'Lock'")["n"] == 1

    trigger = threading.Thread(target=fire)
    # (the cancel's transaction holds the batch row until it commits)
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as canceller, \
            canceller.transaction():
        Queue(canceller).cancel("b")
        trigger.start()
        wait_for(trigger_waits_for_the_batch_lock, timeout=30,
                 what="the trigger, past its lock-free look, to wait for the batch")
    trigger.join(30)
    assert reduce_row(conn) is None, "a batch cancelled before its reduce was enqueued got one"
    assert fired and not fired[0].enqueued and fired[0].cancelled
    assert Queue(conn).counts("b")["done"] == 3  # the cancel found nothing left to stop


def test_cancel_after_the_reduce_was_enqueued_cancels_it(dsn, conn):
    enqueue(conn, "b", [TaskSpec("t", {})])
    conn.execute("UPDATE agent_work_queue SET status = 'done', finished_at = now()")
    conn.commit()
    assert reduce.trigger(conn, "b").task_status == "pending"
    Queue(conn).cancel("b")
    assert reduce_row(conn)["status"] == "cancelled"
    assert reduce.state(conn, "b").phase() == "cancelled"


def test_a_worker_without_drain_check_enqueues_the_reduce_in_its_maintenance_tick(
        dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec(f"t{i}", {}) for i in range(3)],
            step="tests.support.reduce_handlers:count")
    proc = start_worker(dsn, "b", "tests.support.handlers:record", *FAST,
                        log=tmp_path / "w.log")
    wait_for(lambda: batch_result(conn) == 3, timeout=60, what="the reduce's result")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_command_reduce_streams_json_lines_on_stdin(dsn, conn, tmp_path):
    script = ("import json, sys; rows = [json.loads(line) for line in sys.stdin]; "
              "print(json.dumps({'n': len(rows), 'first': rows[0]}))")
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {}) for i in range(3)],
                        reduce=ReduceSpec(command=("python3", "-c", script)).as_json())
    proc = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                        *FAST, log=tmp_path / "w.log")
    assert proc.wait(60) == 0
    assert batch_result(conn) == {"n": 3, "first": {"key": "t0", "status": "done",
                                                    "result": {"key": "t0"}, "error": None,
                                                    "attempts": 1}}


def test_a_failing_reduce_ends_dead_and_says_why(dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec("t", {})], step="tests.support.reduce_handlers:fails")
    proc = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                        *FAST, log=tmp_path / "w.log")
    assert proc.wait(60) == 0
    assert reduce_row(conn)["status"] == "dead"
    st = reduce.state(conn, "b")
    assert st.phase() == "failed" and "the reduce step refuses" in st.describe()
    status = json.loads(cli("status", "--batch", "b", "--json", dsn=dsn).stdout)
    assert status["dead"] == 0 and status["reduce"]["state"] == "failed"
    assert "the reduce step refuses" in status["top_errors"][0]["message"]
    missing = cli("results", "--batch", "b", "--reduce", dsn=dsn)
    assert missing.returncode == 1 and "has no result" in missing.stderr


def test_a_large_result_stays_in_the_database_with_a_pointer(dsn, conn, tmp_path):
    enqueue(conn, "b", [TaskSpec("t", {})], step="tests.support.reduce_handlers:big")
    proc = start_worker(dsn, "b", "tests.support.handlers:record", "--exit-when-drained",
                        *FAST, log=tmp_path / "w.log")
    assert proc.wait(60) == 0
    found, value = reduce.status_result(conn, "b")
    assert found and "too large for the status" in value and "jobrunner status --batch b" in value
    assert batch_result(conn) == "x" * 10_000
    assert cli("results", "--batch", "b", "--reduce", dsn=dsn, check=True).stdout == (
        "x" * 10_000 + "\n")  # text as it is


# -- bad input: a clear error and nothing written ------------------------------------------
def _manifest(tmp_path: Path, reduce_yaml: str) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(f"""
apiVersion: jobrunner.dev/v1alpha1
kind: BatchRun
metadata: {{name: m}}
spec:
  tenant: t
  handler: tests.support.handlers:noop
  shardRange: {{count: 3}}
  reduce: {reduce_yaml}
""")
    return path


@pytest.mark.parametrize(("reduce_yaml", "message"), [
    ("{handler: 'tests.support.nope:fn'}", "cannot import module 'tests.support.nope'"),
    ("{handler: 'tests.support.reduce_handlers:missing'}", "has no attribute 'missing'"),
    ("{handler: 'tests.support.reduce_handlers:one_argument'}",
     "must take two arguments: (task, results)"),
    ("{command: [no-such-program-here]}", "program 'no-such-program-here' not found"),
    ("{handler: 'a:b', command: [x]}", "exactly one of handler"),
    ("{handler: 'nocolon'}", "must look like 'package.module:function'"),
    ("{handler: 'a:b', onDead: maybe}", "onDead must be one of fail, skip, include"),
    ("{handler: 'a:b', when: now}", "unknown field(s) when"),
])
def test_bad_reduce_is_refused_before_anything_is_written(dsn, conn, tmp_path, reduce_yaml,
                                                          message):
    r = cli("run", str(_manifest(tmp_path, reduce_yaml)), "--batch", "m", "--dsn", dsn)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert one(conn, "SELECT count(*) AS n FROM agent_batch")["n"] == 0


def test_worker_refuses_a_batch_whose_reduce_does_not_load(dsn, conn):
    Queue(conn).enqueue("b", "acme", [TaskSpec("t", {})],
                        reduce=ReduceSpec(handler="tests.support.nope:fn").as_json())
    r = cli("worker", "--batch", "b", "--handler", "tests.support.handlers:record",
            "--exit-when-drained", dsn=dsn, timeout=60)
    assert r.returncode == 2
    assert "cannot import module 'tests.support.nope'" in r.stderr
    assert Queue(conn).counts("b")["pending"] == 1  # nothing was claimed


def test_enqueue_refuses_the_reserved_key_and_tasks_after_the_reduce(dsn, conn):
    with pytest.raises(BadInput, match="reserved for the batch's reduce step"):
        Queue(conn).enqueue("b", "acme", [TaskSpec(REDUCE_KEY, {})])
    enqueue(conn, "b", [TaskSpec("t", {})])
    conn.execute("UPDATE agent_work_queue SET status = 'done', finished_at = now()")
    conn.commit()
    reduce.trigger(conn, "b")
    with pytest.raises(BadInput, match="was reduced already"):
        Queue(conn).enqueue("b", "acme", [TaskSpec("t", {}), TaskSpec("late", {})])
    assert one(conn, "SELECT count(*) AS n FROM agent_work_queue WHERE task_key = 'late'")[
        "n"] == 0
    again = Queue(conn).enqueue("b", "acme", [TaskSpec("t", {})])  # (a re-run adds nothing)
    assert (again.new, again.existing) == (0, 1)


# -- the operator's phase -------------------------------------------------------------------
def _job(finished: str | None = None) -> dict:
    """A Job as the API returns it: finished means a True Complete/Failed condition."""
    conditions = [{"type": finished, "status": "True", "reason": finished, "message": ""}]
    return {"metadata": {"name": "j"}, "status": {"conditions": conditions if finished else []}}


def _reduce_state(**changes) -> reduce.ReduceState:
    base = {"spec": ReduceSpec(handler="m:f"), "cancelled": False, "enqueued": True,
            "task_status": "leased", "attempts": 1, "max_attempts": 8, "last_error": None,
            "reduced": False, "result_bytes": None, "due": False}
    return reduce.ReduceState(**{**base, **changes})


@pytest.mark.parametrize(("job", "counts", "state", "expected"), [
    (None, {"done": 3}, {}, ("Reducing", "Reducing")),
    (None, {"done": 3}, {"task_status": "done", "reduced": True}, ("Reducing", "Reducing")),
    (None, {"done": 2, "pending": 1}, {"enqueued": False, "task_status": None},
     ("Running", "Running")),
    ("Complete", {"done": 3}, {"task_status": "done", "reduced": True},
     ("Succeeded", "Reduced")),
    ("Complete", {"done": 2, "dead": 1}, {"task_status": "done", "reduced": True},
     ("Succeeded", "Reduced")),  # onDead skip or include
    ("Complete", {"done": 2, "dead": 1}, {"enqueued": False, "task_status": None},
     ("Failed", "DeadTasks")),  # onDead fail
    ("Complete", {"done": 3}, {"task_status": "dead", "last_error": "boom"},
     ("Failed", "ReduceFailed")),
    ("Complete", {"done": 3}, {"task_status": "pending"}, ("Failed", "WorkersExitedEarly")),
    ("Complete", {"done": 1, "cancelled": 2}, {"cancelled": True, "enqueued": False,
                                               "task_status": None}, ("Cancelled", "Cancelled")),
])
def test_operator_phase_with_a_reduce(job, counts, state, expected):
    from jobrunner.features.manifest import parse_batchrun
    from jobrunner.operator.phase import job_run_phase

    run = parse_batchrun({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
                          "metadata": {"name": "r"},
                          "spec": {"tenant": "t", "handler": "m:f", "shardRange": {"count": 3},
                                   "reduce": {"handler": "m:g"}}})
    full = {"pending": 0, "leased": 0, "done": 0, "dead": 0, "cancelled": 0, **counts}
    full["total"] = sum(full.values())
    phase, reason, message = job_run_phase(run, _job(job), full, "b", _reduce_state(**state))
    assert (phase, reason) == expected, message
    if reason == "ReduceFailed":
        assert "boom" in message
