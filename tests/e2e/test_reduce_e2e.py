"""Reduce on the real cluster (issue 17): the map-reduce example runs to Succeeded through
the phase Reducing with its digest in status.result; a failed run says why in
`kubectl describe br` (status.topErrors)."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.features.reduce import REDUCE_KEY
from jobrunner.queue.client import Queue

from .operator_support import REPO, apply, batchrun, events_of, get, wait_phase

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


def phases_until(k8s, name: str, namespace: str, final: tuple[str, ...],
                 timeout: float = 300) -> tuple[list[str], dict]:
    """Every phase the BatchRun showed (polled every 0.2 s), until one of `final`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        br = get(k8s, "batchrun", name, namespace)
        phase = ((br or {}).get("status") or {}).get("phase")
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        if phase in final:
            return seen, br
        time.sleep(0.2)
    raise AssertionError(f"BatchRun {name} did not reach {final} in {timeout}s: {seen}")


def test_map_reduce_example_reduces_once_with_the_digest_in_status(k8s, namespace, dsn,
                                                                     operator):
    example = REPO / "examples" / "summarise.yaml"
    k8s.kubectl("apply", "-n", namespace, "-f", str(example))
    seen, br = phases_until(k8s, "summarise-stdlib-docs", namespace, ("Succeeded", "Failed"))
    status = br["status"]
    assert status["phase"] == "Succeeded", (seen, status)
    assert seen[-2:] == ["Reducing", "Succeeded"], seen  # never back to Running
    assert status["counts"]["done"] == 48 and status["counts"]["total"] == 48
    assert status["reduce"]["state"] == "done"
    assert status["reduce"]["step"] == "examples.summarise.handler:digest"
    digest = status["result"]
    assert isinstance(digest, str) and digest.startswith("# Digest of 14 documents (48 chunks)")
    assert "- configparser (8 chunks): " in digest
    complete = next(c for c in status["conditions"] if c["type"] == "Complete")
    assert complete["status"] == "True" and complete["reason"] == "Reduced"
    reasons = {e["reason"] for e in events_of(k8s, namespace)
               if e["involvedObject"]["kind"] == "BatchRun"}
    assert {"Enqueued", "Reducing", "Succeeded"} <= reasons
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        rows = conn.execute("SELECT status::text, attempts FROM agent_work_queue"
                            " WHERE task_key = %s", (REDUCE_KEY,)).fetchall()
        stored = conn.execute("SELECT result FROM agent_batch WHERE batch_id = %s",
                              (status["batchId"],)).fetchone()["result"]
        digests = conn.execute("SELECT count(*) AS n FROM demo_digest").fetchone()["n"]
        counts = Queue(conn).counts(status["batchId"])
    assert rows == [{"status": "done", "attempts": 1}]  # one reduce task, run once
    assert stored == digest and digests == 14
    assert counts["done"] == 48
    described = k8s.kubectl("describe", "br", "summarise-stdlib-docs", "-n", namespace).stdout
    print(described)  # issue 17: Succeeded with the digest
    assert "Digest of 14 documents" in described and "Reducing" in described


def test_failed_run_shows_its_top_errors_in_kubectl_describe(k8s, namespace, dsn, operator):
    shards = [{"key": f"ok-{i}", "payload": {}} for i in range(6)]
    shards += [{"key": f"poison-{i}", "payload": {"poison": True}} for i in range(3)]
    apply(k8s, namespace, batchrun("poisoned-reduce", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:poison_or_record",
        "reduce": {"handler": "tests.support.reduce_handlers:count", "onDead": "fail"},
        "shards": shards, **FAST}))
    status = wait_phase(k8s, "poisoned-reduce", namespace, ("Succeeded", "Failed"),
                        timeout=240, controller=operator)["status"]
    assert status["phase"] == "Failed", status
    assert status["counts"]["dead"] == 3 and status["counts"]["done"] == 6
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadTasks" and "the reduce did not run" in failed["message"]
    assert status["reduce"]["state"] == "skipped" and "result" not in status
    (top,) = status["topErrors"]  # three poison tasks, one distinct error
    assert top["count"] == 3 and top["exampleKey"] == "poison-0"
    assert top["message"].startswith("PermanentError: poison task poison-0")
    described = k8s.kubectl("describe", "br", "poisoned-reduce", "-n", namespace).stdout
    print(described)  # the "must show" of issue 17: a failed run's top errors
    assert "Top Errors:" in described
    assert "PermanentError: poison task poison-0" in described
    assert "Example Key:" in described and "poison-0" in described
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM agent_work_queue WHERE task_key = %s",
                            (REDUCE_KEY,)).fetchone()[0] == 0  # onDead fail: never ran


@pytest.mark.parametrize(("reduce", "message"), [
    ({"handler": "m:g", "command": ["x"]}, "exactly one of spec.reduce.handler"),
    ({"onDead": "skip"}, "exactly one of spec.reduce.handler"),
    ({"handler": "m:g", "onDead": "maybe"}, "spec.reduce.onDead"),
    ({"handler": "not a handler"}, "spec.reduce.handler"),
])
def test_invalid_reduce_is_refused_at_apply(k8s, namespace, operator, reduce, message):
    spec = {"tenant": "t", "handler": "m:f", "shardRange": {"count": 2}, "reduce": reduce}
    r = apply(k8s, namespace, batchrun("bad-reduce", spec), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert get(k8s, "batchrun", "bad-reduce", namespace) is None


def test_reduce_cannot_change_after_creation(k8s, namespace, operator):
    spec = {"tenant": "t", "handler": "tests.support.handlers:noop", "suspend": True,
            "shardRange": {"count": 2}, "reduce": {"handler": "m:g"}}
    apply(k8s, namespace, batchrun("fixed-reduce", spec))
    changed = {**spec, "reduce": {"handler": "m:other"}}
    r = apply(k8s, namespace, batchrun("fixed-reduce", changed), check=False)
    assert r.returncode != 0 and "spec.reduce is immutable" in r.stderr
    without = {k: v for k, v in spec.items() if k != "reduce"}
    r = apply(k8s, namespace, batchrun("fixed-reduce", without), check=False)
    assert r.returncode != 0 and "spec.reduce cannot be added or removed" in r.stderr
