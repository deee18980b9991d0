"""Task sources on the real cluster (issue 19): a generator of 50,000 tasks whose pod is
killed with SIGKILL mid-way (workers start before it finishes; its re-run adds only the
missing tasks), a generator that fails (condition Generated False with its error, an
Event, the run Failed), source.configMap (and a malformed line refused with its line
number, nothing enqueued), and the ticket-grading example twice."""

from __future__ import annotations

import json
import time

import psycopg
from psycopg.rows import dict_row

from jobrunner.features.generators import GENERATE_KEY
from jobrunner.queue.client import Queue

from .operator_support import REPO, apply, batchrun, events_of, get, wait_phase

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}
COUNT = "tests.support.generator_handlers:count"


def generator_row(dsn: str, batch_id: str) -> dict | None:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute("SELECT status::text, attempts, lease_owner, finished_at, result,"
                            " last_error FROM agent_work_queue WHERE batch_id = %s"
                            " AND task_key = %s", (batch_id, GENERATE_KEY)).fetchone()


def enqueued(dsn: str, batch_id: str) -> int:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return sum(Queue(conn).counts(batch_id).values())


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions") or [] if c["type"] == type_)


def events(k8s, namespace: str, reason: str) -> list[dict]:
    return [e for e in events_of(k8s, namespace) if e.get("reason") == reason]


def batch_id_of(k8s, name: str, namespace: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ((get(k8s, "batchrun", name, namespace) or {}).get("status") or {}).get("batchId")
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"BatchRun {name} has no batchId after {timeout}s")


def test_generator_of_50k_tasks_killed_mid_way_reruns_and_enqueues_each_task_once(
        k8s, namespace, dsn, operator):
    n = 50_000
    apply(k8s, namespace, batchrun("gen-50k", {
        "tenant": "t", "workers": 3, "concurrency": 4, "batchSize": 250,
        "handler": "tests.support.handlers:noop",
        "source": {"generator": {"handler": COUNT, "chunkSize": 2000,
                                 "args": {"count": n, "every": 2000, "pause": 0.25}}},
        **FAST}))
    batch = batch_id_of(k8s, "gen-50k", namespace)
    # Mid-way: a fifth of the tasks enqueued, the generator still holding its lease.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        row = generator_row(dsn, batch)
        if row and row["status"] == "leased" and enqueued(dsn, batch) >= n // 5:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the generator never got a fifth of the way: {row}")
    at_kill = enqueued(dsn, batch)
    pod = row["lease_owner"].rsplit("-", 1)[0]  # (worker id: the pod's name + a suffix)
    assert k8s.node.kill_pod(namespace, pod) >= 1
    killed_at = time.monotonic()
    br = wait_phase(k8s, "gen-50k", namespace, ("Succeeded", "Failed"), timeout=420,
                    controller=operator)
    status = br["status"]
    assert status["phase"] == "Succeeded", status
    row = generator_row(dsn, batch)
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        tasks = conn.execute(
            "SELECT count(DISTINCT task_key) AS distinct_keys, count(*) AS rows,"
            " count(*) FILTER (WHERE status = 'done') AS done, min(finished_at) AS first_done"
            " FROM agent_work_queue WHERE batch_id = %s AND task_key <> %s",
            (batch, GENERATE_KEY)).fetchone()
    print(f"\ngenerator pod {pod} killed with {at_kill:,} of {n:,} tasks enqueued; attempts "
          f"{row['attempts']}; its re-run found {row['result']['existing']:,} and added "
          f"{row['result']['new']:,}; first task done "
          f"{(row['finished_at'] - tasks['first_done']).total_seconds():.1f}s before the "
          f"generator finished; Succeeded {time.monotonic() - killed_at:.0f}s after the kill")
    assert row["status"] == "done" and row["attempts"] >= 2
    assert tasks["distinct_keys"] == tasks["rows"] == tasks["done"] == n
    assert tasks["first_done"] < row["finished_at"]  # workers started before it finished
    assert row["result"]["existing"] >= at_kill  # the re-run added only what was missing
    assert status["counts"]["total"] == n and status["counts"]["done"] == n
    assert status["generator"]["state"] == "Finished" and status["generator"]["enqueued"] == n
    generated = condition(status, "Generated")
    assert (generated["status"], generated["reason"]) == ("True", "Finished")
    assert events(k8s, namespace, "Generated")


def test_a_generator_that_raises_fails_the_run_with_its_error(k8s, namespace, dsn, operator):
    apply(k8s, namespace, batchrun("gen-boom", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:noop",
        "source": {"generator": {"handler": "tests.support.generator_handlers:boom",
                                 "args": {"before": 5}, "maxAttempts": 2}},
        **FAST}))
    status = wait_phase(k8s, "gen-boom", namespace, ("Succeeded", "Failed"), timeout=240,
                        controller=operator)["status"]
    assert status["phase"] == "Failed", status
    error = "RuntimeError: the ticket source is unreachable (attempt 2)"
    generated = condition(status, "Generated")
    assert (generated["status"], generated["reason"]) == ("False", "Failed")
    assert error in generated["message"] and "the 5 task(s) it enqueued" in generated["message"]
    failed = condition(status, "Failed")
    assert failed["reason"] == "GeneratorFailed" and error in failed["message"]
    assert status["generator"]["state"] == "Failed" and error in status["generator"]["error"]
    assert status["counts"]["done"] == 5  # what it enqueued before failing is kept (and ran)
    (event,) = events(k8s, namespace, "GeneratorFailed")
    assert event["type"] == "Warning" and error in event["message"]
    described = k8s.kubectl("describe", "br", "gen-boom", "-n", namespace).stdout
    print(described)
    assert "GeneratorFailed" in described


def config_map(name: str, lines: list[str]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                       "data": {"tasks.jsonl": "\n".join(lines) + "\n"}})


def test_config_map_source_runs_and_a_malformed_line_is_refused_with_its_number(
        k8s, namespace, dsn, operator):
    lines = [json.dumps({"key": f"k{i:02d}", "shard_key": f"s{i % 3}", "payload": {"i": i}})
             for i in range(12)]
    apply(k8s, namespace, config_map("tonight", lines))
    apply(k8s, namespace, batchrun("from-cm", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:noop",
        "source": {"configMap": {"name": "tonight", "key": "tasks.jsonl"}}, **FAST}))
    broken = [*lines[:2], '{"key": "k02", "payload": {"i": 2}', *lines[3:]]
    apply(k8s, namespace, config_map("broken", broken))
    apply(k8s, namespace, batchrun("from-broken-cm", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:noop",
        "source": {"configMap": {"name": "broken", "key": "tasks.jsonl"}}, **FAST}))
    ok = wait_phase(k8s, "from-cm", namespace, ("Succeeded", "Failed"), timeout=180,
                    controller=operator)["status"]
    assert ok["phase"] == "Succeeded" and ok["counts"]["done"] == 12, ok
    bad = wait_phase(k8s, "from-broken-cm", namespace, ("Failed",), timeout=60,
                     controller=operator)["status"]
    failed = condition(bad, "Failed")
    assert failed["reason"] == "InvalidSource"
    assert f"ConfigMap {namespace}/broken key tasks.jsonl line 3: malformed JSON" in (
        failed["message"]) and "nothing was enqueued" in failed["message"]
    (event,) = events(k8s, namespace, "InvalidSource")
    assert event["type"] == "Warning" and "line 3" in event["message"]
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM agent_batch WHERE batch_id = %s",
                            (bad["batchId"],)).fetchone()[0] == 0  # nothing enqueued
    # Refused at apply time: a local file, no source at all.
    r = apply(k8s, namespace, batchrun("from-file", {
        "tenant": "t", "handler": "m:f", "source": {"file": "tasks.jsonl"}}), check=False)
    assert r.returncode != 0 and "spec.source.file is read by `jobrunner run` only" in r.stderr
    r = apply(k8s, namespace, batchrun("from-nothing", {
        "tenant": "t", "handler": "m:f", "source": {}}), check=False)
    assert r.returncode != 0 and "exactly one of external, generator, configMap or file" in (
        r.stderr)


def test_ticket_grading_example_twice_grades_nothing_twice(k8s, namespace, dsn, operator):
    example = (REPO / "examples" / "tickets.yaml").read_text()
    apply(k8s, namespace, example)
    first = wait_phase(k8s, "nightly-ticket-grading", namespace, ("Succeeded", "Failed"),
                       timeout=240, controller=operator)["status"]
    assert first["phase"] == "Succeeded" and first["counts"]["done"] == 60, first
    apply(k8s, namespace, example.replace("name: nightly-ticket-grading",
                                          "name: nightly-ticket-grading-2"))
    second = wait_phase(k8s, "nightly-ticket-grading-2", namespace,
                        ("Succeeded", "Failed"), timeout=240, controller=operator)["status"]
    assert second["phase"] == "Succeeded", second
    assert second["counts"]["total"] == 0 and second["generator"]["state"] == "Finished"
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        grades = conn.execute("SELECT count(*) AS n, count(DISTINCT ticket_id) AS tickets"
                              " FROM ticket_grades").fetchone()
        effects = conn.execute("SELECT batch_id, count(*) AS n FROM agent_task_effect"
                               " WHERE effect_key = 'store-grade' GROUP BY batch_id").fetchall()
    print(f"\ntickets on the cluster: {grades['n']} grades for {grades['tickets']} tickets; "
          f"effects by batch {[(e['batch_id'], e['n']) for e in effects]}")
    assert grades == {"n": 60, "tickets": 60}
    assert [e["n"] for e in effects] == [60]  # the second night wrote nothing
