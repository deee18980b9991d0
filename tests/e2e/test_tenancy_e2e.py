"""Tenants bound to namespaces on the real cluster (issue 29, item 3): the chart's
ValidatingAdmissionPolicy refuses at `kubectl apply` a BatchRun or BatchRunSchedule naming
a tenant its namespace is not allowed, nothing reaches the queue; the allowed cases (the
namespace's own name, its jobrunner.dev/tenants annotation, the chart value) run; and
without the policy the controller refuses the run itself (reason TenantNotAllowed)."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
import yaml

from .operator_support import (
    Controller,
    apply,
    apply_crds,
    batchrun,
    create_db_secret,
    events_of,
    get,
    jobs_of,
    wait_phase,
)

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


def spec(tenant: str) -> dict:
    return {"tenant": tenant, "workers": 1, "handler": "tests.support.handlers:noop",
            "shards": [{"key": f"k{i}", "payload": {}} for i in range(3)], **FAST}


def queued_tenants(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT DISTINCT tenant_id FROM agent_work_queue "
                            "ORDER BY 1").fetchall()
    return [r[0] for r in rows]


def policy_objects(controller: Controller) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in controller._render()
            if d["kind"].startswith("ValidatingAdmissionPolicy")]


@pytest.fixture
def bound(k8s, namespace, dsn, tmp_path):
    """The controller watching `namespace` with tenancy.bindToNamespaces (the policy and
    its binding applied as the chart renders them), tenant "granted" allowed by the chart
    value and tenant "annotated" by the namespace's annotation."""
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    k8s.kubectl("annotate", "namespace", namespace, "jobrunner.dev/tenants=annotated, other")
    controller = Controller(k8s, namespace, tmp_path / "controller.log", values=(
        "tenancy.bindToNamespaces=true", f"tenancy.allowedTenants.{namespace}={{granted}}"))
    controller.start()
    policies = policy_objects(controller)
    assert [k for k, _ in policies] == ["ValidatingAdmissionPolicy",
                                       "ValidatingAdmissionPolicyBinding"], policies
    yield controller
    controller.stop()
    for kind, name in policies:
        k8s.kubectl("delete", kind, name, "--ignore-not-found", check=False)


def refused_apply(k8s, namespace: str, text: str, timeout: float = 30) -> str:
    """`kubectl apply` that the policy refuses; its message. The API server's policy
    informer may take a moment after the binding was created: retry until refused."""
    deadline = time.monotonic() + timeout
    while True:
        r = apply(k8s, namespace, text, check=False)
        if r.returncode != 0:
            return r.stderr
        # Accepted before the policy was loaded: undo and try again.
        doc = yaml.safe_load(text)
        k8s.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "-n", namespace,
                    "--wait=true", check=False)
        assert time.monotonic() < deadline, "the admission policy never refused the apply"
        time.sleep(1)


def test_foreign_tenant_refused_at_apply_nothing_enqueued(k8s, namespace, dsn, bound):
    message = refused_apply(k8s, namespace, batchrun("foreign", spec("b")))
    print(f"$ kubectl apply -n {namespace} -f foreign.yaml   # spec.tenant: b\n{message}")
    assert "ValidatingAdmissionPolicy" in message and "denied request" in message, message
    assert (f"tenant b is not allowed in namespace {namespace} (allowed: {namespace}, "
            "annotated, other, granted)") in message, message
    assert get(k8s, "batchrun", "foreign", namespace) is None
    time.sleep(3)  # what the controller could have done with it, had it existed
    assert queued_tenants(dsn) == [] and jobs_of(k8s, namespace) == []

    schedule = yaml.safe_dump({
        "apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRunSchedule",
        "metadata": {"name": "nightly"},
        "spec": {"schedule": "0 3 * * *", "batchRunTemplate": {"spec": spec("b")}}})
    message = refused_apply(k8s, namespace, schedule)
    assert f"tenant b is not allowed in namespace {namespace}" in message, message


@pytest.mark.parametrize("tenant", ["own", "annotated", "granted"])
def test_allowed_tenants_run(k8s, namespace, dsn, bound, tenant):
    name = {"own": namespace}.get(tenant, tenant)
    apply(k8s, namespace, batchrun("allowed", spec(name)))
    br = wait_phase(k8s, "allowed", namespace, ("Succeeded", "Failed"), controller=bound)
    assert br["status"]["phase"] == "Succeeded", br["status"]
    assert queued_tenants(dsn) == [name]


def test_controller_refuses_without_the_policy(k8s, namespace, dsn, tmp_path):
    """A cluster without the policy (tenancy.admissionPolicy=false): the apply passes, the
    controller fails the run before anything is enqueued, with a condition and an Event."""
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    controller = Controller(k8s, namespace, tmp_path / "controller.log", values=(
        "tenancy.bindToNamespaces=true", "tenancy.admissionPolicy=false"))
    assert policy_objects(controller) == []
    controller.start()
    try:
        apply(k8s, namespace, batchrun("foreign", spec("b")))
        br = wait_phase(k8s, "foreign", namespace, ("Succeeded", "Failed"),
                        controller=controller)
        status = br["status"]
        assert status["phase"] == "Failed", status
        (failed,) = [c for c in status["conditions"] if c["type"] == "Failed"]
        assert failed["reason"] == "TenantNotAllowed", failed
        assert f"tenant 'b' is not allowed in namespace '{namespace}'" in failed["message"]
        assert any(e["reason"] == "TenantNotAllowed" for e in events_of(k8s, namespace))
        assert queued_tenants(dsn) == [] and jobs_of(k8s, namespace) == []
        assert "batchId" not in status or not (status.get("milestones") or {}).get("enqueued")
    finally:
        controller.stop()
    print(json.dumps(status, indent=1))


def test_worker_pod_holds_only_the_worker_dsn(k8s, namespace, dsn, tmp_path):
    """database.workerSecretName: the controller reads jobrunner-db, the worker pods only
    jr-worker (the run succeeds through it, so the workers really used it)."""
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    create_db_secret(k8s, namespace, dsn, name="jr-worker")
    controller = Controller(k8s, namespace, tmp_path / "controller.log",
                            values=("database.workerSecretName=jr-worker",)).start()
    try:
        apply(k8s, namespace, batchrun("split", spec("t")))
        br = wait_phase(k8s, "split", namespace, ("Succeeded", "Failed"), controller=controller)
        assert br["status"]["phase"] == "Succeeded", br["status"]
        pods = json.loads(k8s.kubectl("get", "pods", "-n", namespace, "-o", "json",
                                      "-l", "jobrunner.dev/batchrun=split").stdout)["items"]
        assert pods
        for pod in pods:
            text = json.dumps(pod["spec"])
            assert '"jr-worker"' in text and '"jobrunner-db"' not in text, pod["spec"]
    finally:
        controller.stop()
