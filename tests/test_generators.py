"""Generators and JSON-lines sources (issue 19): the generator runs as a task of the
batch (lease, retries), enqueues in chunks that workers start on before it finishes, a
kill -9 re-runs it and the keyed enqueue adds only what is missing; a generator that
fails for good leaves its tasks and the batch unsettled; source.file / configMap lines
are all checked first and an error names the line. Real PostgreSQL, real worker
processes."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg.rows import dict_row

from jobrunner.features import generators, reduce
from jobrunner.features.generators import GENERATE_KEY, GeneratorSpec
from jobrunner.features.manifest import load_manifest
from jobrunner.features.sources import config_map_tasks, parse_lines
from jobrunner.model.errors import BadInput
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.generator_handlers import PID_FILE_ENV
from tests.support.processes import REPO, child_env, cli, start_worker, wait_for

FAST = ["--visibility-timeout", "3", "--heartbeat", "1", "--backoff-base", "0.05",
        "--backoff-cap", "0.2"]
NOOP = "tests.support.handlers:noop"
COUNT = "tests.support.generator_handlers:count"


def one(conn, sql: str, *args):
    row = conn.execute(sql, args).fetchone()
    conn.rollback()
    return row


def generator_row(conn, batch: str = "b") -> dict:
    return one(conn, "SELECT status::text, attempts, result, last_error, finished_at"
                     " FROM agent_work_queue WHERE batch_id = %s AND task_key = %s",
               batch, GENERATE_KEY)


def start(conn, handler: str = COUNT, args: dict | None = None, *, chunk: int = 1000,
          attempts: int = 8, batch: str = "b", reduce_step: dict | None = None) -> None:
    spec = GeneratorSpec(handler=handler, args=args or {}, chunk_size=chunk,
                         max_attempts=attempts)
    assert generators.start(conn, batch, "acme", spec, reduce=reduce_step)


def workers(dsn: str, n: int, *extra: str, tmp_path: Path, env: dict | None = None) -> list:
    return [start_worker(dsn, "b", NOOP, "--exit-when-drained", *FAST, *extra, env=env,
                         log=tmp_path / f"w{i}.log") for i in range(n)]


def test_generated_tasks_run_while_the_generator_goes_on(dsn, conn, tmp_path):
    start(conn, args={"count": 6000, "every": 500, "pause": 0.1}, chunk=500)
    assert generators.start(conn, "b", "acme", GeneratorSpec(handler=COUNT)) is False  # once
    procs = workers(dsn, 3, "--concurrency", "2", "--batch-size", "50", tmp_path=tmp_path)
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    gen = generator_row(conn)
    assert (gen["status"], gen["attempts"]) == ("done", 1)
    assert gen["result"] == {"tasks": 6000, "new": 6000, "existing": 0, "chunks": 12}
    assert Queue(conn).counts("b") == {"pending": 0, "leased": 0, "done": 6000, "dead": 0,
                                       "cancelled": 0}
    first_done = one(conn, "SELECT min(finished_at) AS t FROM agent_work_queue"
                           " WHERE batch_id = 'b' AND task_key <> %s", GENERATE_KEY)["t"]
    print(f"\nfirst task done {(gen['finished_at'] - first_done).total_seconds():.2f}s "
          "before the generator finished")
    assert first_done < gen["finished_at"]
    state = generators.state(conn, "b")
    assert state.phase() == "Finished" and "6,000 task(s)" in state.describe()
    # Not a result, not counted: exports leave the generator out.
    exported = cli("results", "--batch", "b", dsn=dsn, check=True).stdout.splitlines()
    assert len(exported) == 6000 and all(GENERATE_KEY not in line for line in exported)


def test_kill_9_of_the_generator_reruns_it_and_adds_only_what_is_missing(dsn, conn, tmp_path):
    n = 20_000
    pids = tmp_path / "generator-pids"
    start(conn, args={"count": n, "every": 1000, "pause": 0.15}, chunk=1000)
    env = child_env(dsn, **{PID_FILE_ENV: str(pids)})
    procs = workers(dsn, 4, "--concurrency", "2", "--batch-size", "100", tmp_path=tmp_path,
                    env=env)
    wait_for(lambda: Queue(conn).counts("b")["done"] >= 3000 and pids.exists(), timeout=60,
             what="the generator half-way")
    pid, attempt = map(int, pids.read_text().split()[:2])
    enqueued_at_kill = sum(Queue(conn).counts("b").values())
    os.kill(pid, signal.SIGKILL)
    assert attempt == 1 and enqueued_at_kill < n
    # The killed worker's place is taken by a fresh one (as a Job would); the survivors
    # rescue the generator's lease and run it again from the start.
    procs += workers(dsn, 1, "--concurrency", "2", "--batch-size", "100", tmp_path=tmp_path,
                     env=env)
    for p in procs:
        assert p.wait(180) in (0, -signal.SIGKILL)
    gen = generator_row(conn)
    assert gen["status"] == "done" and gen["attempts"] == 2
    assert gen["result"]["tasks"] == n and gen["result"]["new"] == n - gen["result"]["existing"]
    distinct = one(conn, "SELECT count(DISTINCT task_key) AS n, count(*) AS rows"
                         " FROM agent_work_queue WHERE batch_id = 'b' AND task_key <> %s",
                   GENERATE_KEY)
    assert distinct == {"n": n, "rows": n}
    assert Queue(conn).counts("b")["done"] == n
    print(f"\ngenerator killed at {enqueued_at_kill:,} of {n:,} tasks enqueued; its re-run "
          f"found {gen['result']['existing']:,} there and added {gen['result']['new']:,}")
    assert gen["result"]["existing"] >= enqueued_at_kill


def test_a_generator_that_fails_for_good_keeps_its_tasks_and_the_batch_unsettled(
        dsn, conn, tmp_path):
    start(conn, "tests.support.generator_handlers:boom", {"before": 7}, chunk=3, attempts=2,
          reduce_step={"handler": "tests.support.reduce_handlers:count", "onDead": "skip"})
    procs = workers(dsn, 2, tmp_path=tmp_path)
    assert [p.wait(60) for p in procs] == [0, 0]
    gen = generator_row(conn)
    assert (gen["status"], gen["attempts"]) == ("dead", 2)
    assert gen["last_error"].startswith("RuntimeError: the ticket source is unreachable "
                                        "(attempt 2)")
    # What it enqueued before failing is kept, and ran.
    assert Queue(conn).counts("b") == {"pending": 0, "leased": 0, "done": 7, "dead": 0,
                                       "cancelled": 0}
    state = generators.state(conn, "b")
    assert state.phase() == "Failed" and "failed after 2 attempt(s)" in state.describe()
    # Even with onDead skip, no reduce over a batch whose generator did not finish.
    assert reduce.trigger(conn, "b").phase() == "waiting"


def test_the_reduce_runs_once_after_the_generator_and_all_its_tasks(dsn, conn, tmp_path):
    # Chunks of 50 with a pause: without the generator's row keeping the batch open, the
    # first chunk's tasks would all be done (the batch settled) before the second chunk.
    start(conn, args={"count": 400, "every": 50, "pause": 0.3}, chunk=50,
          reduce_step={"handler": "tests.support.reduce_handlers:count", "onDead": "fail"})
    procs = workers(dsn, 3, "--concurrency", "2", "--batch-size", "10", tmp_path=tmp_path)
    assert [p.wait(90) for p in procs] == [0, 0, 0]
    assert generator_row(conn)["status"] == "done"
    reduce_task = one(conn, "SELECT status::text, attempts, created_at FROM agent_work_queue"
                            " WHERE batch_id = 'b' AND task_key = '__reduce__'")
    assert (reduce_task["status"], reduce_task["attempts"]) == ("done", 1)
    assert reduce.batch_result(conn, "b").value() == 400  # it saw every generated task
    assert reduce_task["created_at"] >= generator_row(conn)["finished_at"]


def test_a_task_enqueued_as_the_trigger_fires_holds_the_reduce_back(dsn, conn, tmp_path):
    """The trigger's lock-free look says "due"; a task enqueued before it takes the batch's
    lock must still keep the reduce waiting: the rows are read again under the lock. A
    count would not see it here: the generator's own done row is one finished row more
    than the batch's tasks, so one pending task leaves the count at the tasks."""
    start(conn, args={"count": 2})
    assert [p.wait(60) for p in workers(dsn, 1, tmp_path=tmp_path)] == [0]
    assert generator_row(conn)["status"] == "done"
    # The reduce step comes after the run (the operator's attach), so no worker has
    # enqueued it yet: the batch is settled and the reduce due.
    reduce.attach(conn, "b", reduce.ReduceSpec(handler="tests.support.reduce_handlers:count"))
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
    # (the enqueue's transaction holds the batch row until it commits)
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as adder, \
            adder.transaction():
        Queue(adder).enqueue("b", "acme", [TaskSpec("late", {})])
        trigger.start()
        wait_for(trigger_waits_for_the_batch_lock, timeout=30,
                 what="the trigger, past its lock-free look, to wait for the batch")
    trigger.join(30)
    assert one(conn, "SELECT count(*) AS n FROM agent_work_queue WHERE task_key = '__reduce__'"
               )["n"] == 0, "the reduce was enqueued while a task of its batch was pending"
    assert fired and not fired[0].enqueued
    assert [p.wait(60) for p in workers(dsn, 1, tmp_path=tmp_path)] == [0]
    assert reduce.batch_result(conn, "b").value() == 3  # "late" included


def test_a_bad_item_fails_the_generator_at_once_with_its_position(dsn, conn, tmp_path):
    start(conn, "tests.support.generator_handlers:bad_item")
    assert [p.wait(60) for p in workers(dsn, 1, tmp_path=tmp_path)] == [0]
    gen = generator_row(conn)
    assert (gen["status"], gen["attempts"]) == ("dead", 1)
    assert ("generator tests.support.generator_handlers:bad_item item 2: payload must be a "
            "JSON object") in gen["last_error"]


def test_a_command_generator_streams_its_stdout_lines(dsn, conn, tmp_path):
    script = ("import json, sys\n"
              "args = json.load(sys.stdin)\n"
              "for i in range(args['n']):\n"
              "    print(json.dumps({'key': f'c{i}', 'shard_key': 's', 'payload': {'i': i}}),"
              " flush=True)\n")
    spec = GeneratorSpec(command=("python3", "-c", script), args={"n": 25}, chunk_size=10)
    assert generators.start(conn, "b", "acme", spec)
    assert [p.wait(60) for p in workers(dsn, 1, tmp_path=tmp_path)] == [0]
    assert generator_row(conn)["result"] == {"tasks": 25, "new": 25, "existing": 0,
                                             "chunks": 3}
    row = one(conn, "SELECT shard_key, payload FROM agent_work_queue WHERE task_key = 'c7'")
    assert row == {"shard_key": "s", "payload": {"i": 7}}


def test_a_command_generator_printing_a_bad_line_names_it(dsn, conn, tmp_path):
    spec = GeneratorSpec(command=("sh", "-c", 'echo \'{"key": "a"}\'; echo "{oops"'))
    assert generators.start(conn, "b", "acme", spec)
    assert [p.wait(60) for p in workers(dsn, 1, tmp_path=tmp_path)] == [0]
    gen = generator_row(conn)
    assert gen["status"] == "dead" and "stdout line 2: malformed JSON" in gen["last_error"]


def test_generator_keys_are_reserved_and_refused_loudly(conn):
    with pytest.raises(BadInput, match="reserved for the batch's generator"):
        Queue(conn).enqueue("b", "acme", [TaskSpec(GENERATE_KEY)])
    with pytest.raises(BadInput, match="must take two arguments"):
        generators.check_loadable(GeneratorSpec(handler="tests.support.generator_handlers:"
                                                        "one_arg"))
    with pytest.raises(BadInput, match="cannot import module"):
        generators.check_loadable(GeneratorSpec(handler="no_such_module:f"))


# -- JSON-lines sources -----------------------------------------------------------------
def test_jsonl_source_errors_name_the_line_and_nothing_is_half_parsed():
    good = '{"key": "a", "payload": {}}\n\n{"key": "b", "shard_key": "s", "tokens": 5}\n'
    assert [t.key for t in parse_lines(good, "x")] == ["a", "b"]
    with pytest.raises(BadInput, match=r"^ConfigMap ns/t key tasks line 3: malformed JSON"):
        config_map_tasks({"data": {"tasks": '{"key": "a"}\n{"key": "b"}\n{"key": "c"\n'}},
                         "ns/t", "tasks", "BatchRun ns/r")
    with pytest.raises(BadInput, match=r"line 2: duplicate key 'a' \(first seen on line 1\)"):
        parse_lines('{"key": "a"}\n{"key": "a"}\n', "x")
    with pytest.raises(BadInput, match="line 1: payload must be a JSON object"):
        parse_lines('{"key": "a", "payload": 3}\n', "x")
    with pytest.raises(BadInput, match="no tasks"):
        parse_lines("\n\n", "x")
    with pytest.raises(BadInput, match=r"has no key 'tasks' in data \(its keys: other\)"):
        config_map_tasks({"data": {"other": ""}}, "ns/t", "tasks", "w")


def _manifest(tmp_path: Path, source: dict, extra_docs: tuple = ()) -> Path:
    run = {"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
           "metadata": {"name": "lines"},
           "spec": {"tenant": "t", "workers": 2, "handler": NOOP, "source": source}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump_all([run, *extra_docs]))
    return path


def test_run_a_file_source_and_refuse_a_bad_line_writing_nothing(dsn, conn, tmp_path):
    lines = [json.dumps({"key": f"k{i}", "payload": {"i": i}}) for i in range(30)]
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    manifest = _manifest(tmp_path, {"file": "tasks.jsonl"})
    assert len(load_manifest(manifest).tasks) == 30
    r = cli("run", str(manifest), "--dsn", dsn, "--batch", "f1", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert Queue(conn).counts("f1")["done"] == 30
    broken = [*lines[:4], '{"key": "k4", "payload": }', *lines[5:]]
    (tmp_path / "tasks.jsonl").write_text("\n".join(broken) + "\n")
    r = cli("run", str(manifest), "--dsn", dsn, "--batch", "f2", timeout=60)
    assert r.returncode == 2
    assert "tasks.jsonl line 5: malformed JSON" in r.stderr
    assert one(conn, "SELECT count(*) AS n FROM agent_batch WHERE batch_id = 'f2'")["n"] == 0


def test_run_reads_a_config_map_of_the_manifest_file(tmp_path):
    data = "\n".join(json.dumps({"key": f"k{i}"}) for i in range(5))
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tonight"},
                  "data": {"tasks.jsonl": data}}
    manifest = _manifest(tmp_path, {"configMap": {"name": "tonight", "key": "tasks.jsonl"}},
                         (config_map,))
    run = load_manifest(manifest)
    assert [t.key for t in run.tasks] == [f"k{i}" for i in range(5)] and run.config_map is None
    missing = _manifest(tmp_path, {"configMap": {"name": "other", "key": "tasks.jsonl"}})
    with pytest.raises(BadInput, match="no ConfigMap 'other' in the manifest's file"):
        load_manifest(missing)


# -- the ticket-grading example ---------------------------------------------------------
def test_ticket_grading_example_twice_grades_nothing_twice(dsn, conn):
    example = REPO / "examples" / "tickets.yaml"
    first = cli("run", str(example), "--dsn", dsn, "--batch", "night-1", timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "finished: 60 task(s) yielded" in first.stdout
    second = cli("run", str(example), "--dsn", dsn, "--batch", "night-2", timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "finished: 0 task(s) yielded" in second.stdout
    grades = one(conn, "SELECT count(*) AS n, count(DISTINCT ticket_id) AS tickets,"
                       " count(*) FILTER (WHERE batch_id = 'night-1') AS first"
                       " FROM ticket_grades")
    effects = one(conn, "SELECT count(*) FILTER (WHERE batch_id = 'night-1') AS first,"
                        " count(*) FILTER (WHERE batch_id = 'night-2') AS second"
                        " FROM agent_task_effect WHERE effect_key = 'store-grade'")
    print(f"\nticket grading: night 1 graded {grades['first']}, night 2 "
          f"{effects['second']}; {grades['n']} grade rows for {grades['tickets']} tickets")
    assert grades == {"n": 60, "tickets": 60, "first": 60}
    assert effects == {"first": 60, "second": 0}
    assert Queue(conn).counts("night-2") == {"pending": 0, "leased": 0, "done": 0, "dead": 0,
                                             "cancelled": 0}
    # The local grader's rules: a question P4, a lock-out P1, slowness P3, a feature request
    # P4, a double charge P2.
    by_ticket = {r["ticket_id"]: r["priority"] for r in conn.execute(
        "SELECT ticket_id, priority FROM ticket_grades WHERE ticket_id <= 5").fetchall()}
    conn.rollback()
    assert by_ticket == {1: "P4", 2: "P1", 3: "P3", 4: "P4", 5: "P2"}
