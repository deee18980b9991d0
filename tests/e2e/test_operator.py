"""The BatchRun operator on a real API server, controller-manager and process kubelet,
with its queue on a real PostgreSQL."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
import yaml
from psycopg.rows import dict_row

from jobrunner.queue.client import Queue

from .operator_support import (
    REPO,
    Controller,
    apply,
    apply_crds,
    batchrun,
    create_db_secret,
    create_namespace,
    events_of,
    get,
    jobs_of,
    pods_of,
    wait_phase,
)

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


def db_counts(dsn: str, batch_id: str) -> dict[str, int]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return Queue(conn).counts(batch_id)



def test_example_manifest_runs_to_success(k8s, namespace, dsn, operator):
    example = REPO / "examples" / "summarise.yaml"
    k8s.kubectl("apply", "-n", namespace, "-f", str(example))
    spec = yaml.safe_load(example.read_text().split("\n", 6)[-1])["spec"]
    br = wait_phase(k8s, "summarise-stdlib-docs", namespace, ("Succeeded", "Failed"),
                    timeout=300, controller=operator)
    status = br["status"]
    assert status["phase"] == "Succeeded", status
    (job,) = jobs_of(k8s, namespace)
    assert job["metadata"]["name"] == status["jobName"]
    assert job["spec"]["parallelism"] == spec["workers"]
    assert "completions" not in job["spec"] or job["spec"]["completions"] is None
    assert job["spec"]["activeDeadlineSeconds"] > spec["visibilityTimeoutSeconds"] + 60
    assert job["metadata"]["ownerReferences"][0]["uid"] == br["metadata"]["uid"]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["jobrunner", "worker"] and "--exit-when-drained" in command
    counts = db_counts(dsn, status["batchId"])
    assert counts["done"] == 48
    assert status["counts"]["done"] == 48 and status["counts"]["total"] == 48
    assert status["observedGeneration"] == br["metadata"]["generation"]
    types = {c["type"]: c["status"] for c in status["conditions"]}
    assert types["Enqueued"] == "True" and types["Complete"] == "True"
    assert types["Progressing"] == "False" and types["Failed"] == "False"
    reasons = {e["reason"] for e in events_of(k8s, namespace)
               if e["involvedObject"]["kind"] == "BatchRun"}
    assert {"Enqueued", "JobCreated", "FirstTaskDone", "Succeeded"} <= reasons
    printed = k8s.kubectl("get", "br", "-n", namespace).stdout
    assert "Succeeded" in printed and "48" in printed


def test_poison_shard_fails_the_run_with_one_dead(k8s, namespace, dsn, operator):
    shards = [{"key": f"ok-{i}", "payload": {}} for i in range(5)]
    shards.append({"key": "poison", "payload": {"poison": True}})
    apply(k8s, namespace, batchrun("poisoned", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:poison_or_record",
        "shards": shards, **FAST}))
    status = wait_phase(k8s, "poisoned", namespace, ("Succeeded", "Failed"),
                        controller=operator)["status"]
    assert status["phase"] == "Failed"
    assert status["counts"]["dead"] == 1 and status["counts"]["done"] == 5
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "DeadTasks"
    assert "1 task(s) dead" in failed["message"]
    reasons = {e["reason"] for e in events_of(k8s, namespace)}
    assert "DeadTasks" in reasons


def test_kill_9_of_a_worker_pod_reruns_its_task(k8s, namespace, dsn, operator):
    apply(k8s, namespace, batchrun("crashy", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 6, "payload": {"sleep": 3}}, **FAST}))

    def running_pods():
        return [p for p in pods_of(k8s, namespace) if p["status"].get("phase") == "Running"]

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with psycopg.connect(dsn) as conn:
            started = conn.execute("SELECT count(*) FROM exec_log").fetchone()[0]
        if started and running_pods():
            break
        time.sleep(0.3)
    victim = running_pods()[0]["metadata"]["name"]
    assert k8s.node.kill_pod(namespace, victim) >= 1
    status = wait_phase(k8s, "crashy", namespace, ("Succeeded", "Failed"), timeout=240,
                        controller=operator)["status"]
    assert status["phase"] == "Succeeded", status
    with psycopg.connect(dsn) as conn:
        rerun = conn.execute("SELECT count(*) FROM agent_work_queue WHERE attempts > 1"
                             " AND last_error LIKE 'lease expired%%'").fetchone()[0]
        done = conn.execute("SELECT count(*) FROM agent_work_queue WHERE status = 'done'"
                            ).fetchone()[0]
    assert done == 6 and rerun >= 1
    names = {p["metadata"]["name"] for p in pods_of(k8s, namespace)}
    assert len(names) >= 3, "the Job did not replace the killed pod"


@pytest.mark.parametrize(("spec", "message"), [
    ({"visibilityTimeoutSeconds": 600, "activeDeadlineSeconds": 600},
     "spec.activeDeadlineSeconds must be greater than spec.visibilityTimeoutSeconds + 60"),
    ({"shards": [{"key": "a"}]},
     "exactly one of spec.shards, spec.shardRange or spec.source must be set"),
    ({"workers": 0}, "spec.workers"),
    ({"visibilityTimeoutSeconds": 60, "heartbeatSeconds": 30},
     "spec.heartbeatSeconds must be less than half"),
    ({"handler": None, "command": None}, "exactly one of spec.handler"),
])
def test_invalid_manifests_are_refused_at_apply(k8s, namespace, operator, spec, message):
    base = {"tenant": "t", "handler": "m:f", "shardRange": {"count": 2}}
    merged = {k: v for k, v in {**base, **spec}.items() if v is not None}
    r = apply(k8s, namespace, batchrun("bad", merged), check=False)
    assert r.returncode != 0
    assert message in r.stderr
    assert get(k8s, "batchrun", "bad", namespace) is None


def test_shards_cannot_change_after_creation(k8s, namespace, operator):
    spec = {"tenant": "t", "handler": "tests.support.handlers:noop", "suspend": True,
            "shards": [{"key": "a", "payload": {}}]}
    apply(k8s, namespace, batchrun("fixed", spec))
    changed = {**spec, "shards": [{"key": "b", "payload": {}}]}
    r = apply(k8s, namespace, batchrun("fixed", changed), check=False)
    assert r.returncode != 0 and "spec.shards is immutable" in r.stderr
    r = apply(k8s, namespace, batchrun("fixed", {**spec, "tenant": "other"}), check=False)
    assert r.returncode != 0 and "spec.tenant is immutable" in r.stderr


def test_delete_mid_run_cancels_pending_and_removes_job(k8s, namespace, dsn, operator):
    apply(k8s, namespace, batchrun("doomed", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 40, "payload": {"sleep": 1}}, **FAST}))
    br = wait_phase(k8s, "doomed", namespace, ("Running",), controller=operator)
    batch_id = br["status"]["batchId"]
    k8s.kubectl("delete", "batchrun", "doomed", "-n", namespace, "--timeout=90s")
    assert get(k8s, "batchrun", "doomed", namespace) is None  # no stuck finalizer
    deadline = time.monotonic() + 90
    while jobs_of(k8s, namespace) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert jobs_of(k8s, namespace) == [], "the Job was not garbage-collected"
    counts = db_counts(dsn, batch_id)
    assert counts["cancelled"] > 0 and counts["pending"] == 0


def test_controller_restart_mid_run_converges_without_duplicates(k8s, namespace, dsn,
                                                                 operator):
    apply(k8s, namespace, batchrun("restarted", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 30, "payload": {"sleep": 0.3}}, **FAST}))
    wait_phase(k8s, "restarted", namespace, ("Running",), controller=operator)
    operator.kill()
    time.sleep(2)
    operator.start()
    status = wait_phase(k8s, "restarted", namespace, ("Succeeded", "Failed"),
                        controller=operator)["status"]
    assert status["phase"] == "Succeeded"
    with psycopg.connect(dsn) as conn:
        total = conn.execute("SELECT count(*) FROM agent_work_queue").fetchone()[0]
    assert total == 30 and status["counts"]["total"] == 30
    assert len(jobs_of(k8s, namespace)) == 1


def test_reapplying_the_same_manifest_is_a_no_op(k8s, namespace, dsn, operator):
    text = batchrun("same", {"tenant": "t", "workers": 1,
                             "handler": "tests.support.handlers:noop",
                             "shardRange": {"count": 5}, **FAST})
    apply(k8s, namespace, text)
    first = wait_phase(k8s, "same", namespace, ("Succeeded",), controller=operator)
    r = apply(k8s, namespace, text)
    assert "unchanged" in r.stdout
    time.sleep(4)  # a few refresh periods
    again = get(k8s, "batchrun", "same", namespace)
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert len(jobs_of(k8s, namespace)) == 1
    assert db_counts(dsn, first["status"]["batchId"])["done"] == 5


def test_workers_change_patches_parallelism_and_suspend_pauses(k8s, namespace, dsn, operator):
    spec = {"tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
            "shardRange": {"count": 200, "payload": {"sleep": 0.2}}, **FAST}
    apply(k8s, namespace, batchrun("elastic", spec))
    wait_phase(k8s, "elastic", namespace, ("Running",), controller=operator)
    apply(k8s, namespace, batchrun("elastic", {**spec, "workers": 3}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (job,) = jobs_of(k8s, namespace)
        if job["spec"]["parallelism"] == 3:
            break
        time.sleep(0.5)
    assert job["spec"]["parallelism"] == 3
    apply(k8s, namespace, batchrun("elastic", {**spec, "workers": 3, "suspend": True}))
    br = wait_phase(k8s, "elastic", namespace, ("Suspended",), controller=operator)
    (job,) = jobs_of(k8s, namespace)
    assert job["spec"]["suspend"] is True
    assert br["status"]["phase"] == "Suspended"
    k8s.kubectl("delete", "batchrun", "elastic", "-n", namespace, "--timeout=90s")


def test_missing_secret_gives_a_condition_not_a_crash(k8s, namespace, dsn, operator):
    apply(k8s, namespace, batchrun("nosecret", {
        "tenant": "t", "handler": "tests.support.handlers:noop", "shardRange": {"count": 2},
        "database": {"secretName": "does-not-exist"}}))
    deadline = time.monotonic() + 60
    cond = None
    while time.monotonic() < deadline:
        br = get(k8s, "batchrun", "nosecret", namespace)
        conds = (br.get("status") or {}).get("conditions") or []
        cond = next((c for c in conds if c["type"] == "Enqueued"), None)
        if cond:
            break
        time.sleep(0.5)
    assert cond and cond["status"] == "False" and cond["reason"] == "SecretNotFound", cond
    assert br["status"].get("phase") in (None, "Pending")
    assert operator.alive(), "the controller died"
    reasons = {e["reason"] for e in events_of(k8s, namespace)}
    assert "SecretNotFound" in reasons
    # once the Secret appears, the run proceeds
    create_db_secret(k8s, namespace, dsn, name="does-not-exist")
    status = wait_phase(k8s, "nosecret", namespace, ("Succeeded",), timeout=180,
                        controller=operator)["status"]
    assert status["counts"]["done"] == 2
    assert json.dumps(status).find("password") == -1


def test_namespace_deletion_with_a_running_batchrun_completes(k8s, dsn, tmp_path):
    """The finalizer must not hold a namespace forever, even when its Secret goes first."""
    ns = "gone-" + str(int(time.time()))[-6:]
    create_namespace(k8s, ns)
    apply_crds(k8s)
    create_db_secret(k8s, ns, dsn)
    controller = Controller(k8s, ns, tmp_path / "controller.log", cluster_rbac=True,
                            JOBRUNNER_DELETE_RETRIES="2").start()
    try:
        apply(k8s, ns, batchrun("running", {
            "tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
            "shardRange": {"count": 50, "payload": {"sleep": 1}}, **FAST}))
        wait_phase(k8s, "running", ns, ("Running",), controller=controller)
        k8s.kubectl("delete", "namespace", ns, "--timeout=150s", timeout=180)
        r = k8s.kubectl("get", "namespace", ns, check=False)
        assert r.returncode != 0 and "NotFound" in r.stderr
    finally:
        controller.stop()


def test_controller_metrics(k8s, namespace, dsn, tmp_path):
    import socket
    import urllib.request

    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    controller = Controller(k8s, namespace, tmp_path / "controller.log",
                            metrics_port=port).start()
    try:
        apply(k8s, namespace, batchrun("measured", {
            "tenant": "t", "handler": "tests.support.handlers:noop",
            "shardRange": {"count": 4}, **FAST}))
        wait_phase(k8s, "measured", namespace, ("Succeeded",), controller=controller)
        time.sleep(1.5)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        text = body.decode()
        assert (f'jobrunner_batchrun_tasks{{batchrun="measured",namespace="{namespace}",'
                f'status="done"}} 4.0') in text
        assert (f'jobrunner_batchrun_phase{{batchrun="measured",namespace="{namespace}",'
                'phase="Succeeded"} 1.0') in text
        assert "jobrunner_reconcile_errors_total" in text
    finally:
        controller.stop()
