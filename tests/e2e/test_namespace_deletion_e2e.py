"""Deleting a watched namespace with the chart's namespaced RBAC (issue 29, item 4): the
controller's RoleBinding lives in that namespace and the namespace controller deletes it
with everything else, possibly before the BatchRuns' finalizers ran. Its finalizer
(operator/rbacguard.py) keeps it until they did. Nothing may stay stuck: the namespace
goes, no BatchRun stays Terminating, no Job or pod is left, the batch's pending tasks are
cancelled in the queue."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.queue.client import Queue

from .operator_support import (
    Controller,
    apply,
    apply_crds,
    batchrun,
    create_db_secret,
    create_namespace,
    release_rbac_guard,
    wait_phase,
)

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


GUARD = "jobrunner.dev/controller-access"


def guarded_binding(k8s, ns: str) -> dict:
    (binding,) = [b for b in json.loads(k8s.kubectl(
        "get", "rolebindings", "-n", ns, "-o", "json").stdout)["items"]
        if GUARD in (b["metadata"].get("finalizers") or [])]
    return binding


# The orders: `rbac-first` deletes the controller's RoleBinding before the namespace (the
# worst order the namespace controller may pick: without the binding's finalizer it
# always left the namespace Terminating); `namespace` leaves the order to the namespace
# controller; `controller-down` deletes the namespace while no controller runs and starts
# one once the namespace controller marked the BatchRun and the binding (which must still
# grant then).
@pytest.mark.parametrize("order", ["rbac-first", "namespace", "controller-down"])
def test_namespace_deletion_with_namespaced_rbac(k8s, dsn, tmp_path, order):
    ns = "gone-ns-" + str(int(time.time() * 1000))[-7:]
    create_namespace(k8s, ns)
    apply_crds(k8s)
    create_db_secret(k8s, ns, dsn)
    controller = Controller(k8s, ns, tmp_path / "controller.log").start()
    try:
        binding = guarded_binding(k8s, ns)
        assert binding["roleRef"]["kind"] == "ClusterRole", binding
        apply(k8s, ns, batchrun("running", {
            "tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
            "shardRange": {"count": 200, "payload": {"sleep": 1}}, **FAST}))
        br = wait_phase(k8s, "running", ns, ("Running",), controller=controller)
        batch_id = br["status"]["batchId"]
        started = time.monotonic()
        if order == "rbac-first":
            k8s.kubectl("delete", "rolebinding", "--all", "-n", ns, "--wait=false")
            time.sleep(3)  # the controller looks at it: kept, the BatchRun still needs it
            kept = guarded_binding(k8s, ns)
            assert kept["metadata"].get("deletionTimestamp"), kept
        if order == "controller-down":
            controller.kill()
            k8s.kubectl("delete", "namespace", ns, "--wait=false")
            # The namespace controller deletes the pods first and the rest once they are
            # gone (OrderedNamespaceDeletion): wait until it marked both, then 5 s more.
            # Nothing finalizes meanwhile; the binding is marked but still there.
            deadline = time.monotonic() + 90
            while True:
                left = json.loads(k8s.kubectl("get", "batchruns,rolebindings", "-n", ns,
                                              "-o", "json").stdout)["items"]
                if all(i["metadata"].get("deletionTimestamp") for i in left) or (
                        time.monotonic() > deadline):
                    break
                time.sleep(1)
            time.sleep(5)
            left = json.loads(k8s.kubectl("get", "batchruns,rolebindings", "-n", ns, "-o",
                                          "json").stdout)["items"]
            assert {i["kind"] for i in left} == {"BatchRun", "RoleBinding"}, left
            assert all(i["metadata"].get("deletionTimestamp") for i in left), left
            controller.start()
            r = k8s.kubectl("wait", "--for=delete", f"namespace/{ns}", "--timeout=120s",
                            timeout=150, check=False)
        else:
            r = k8s.kubectl("delete", "namespace", ns, "--timeout=120s", timeout=150,
                            check=False)
        gone = k8s.kubectl("get", "namespace", ns, check=False)
        left = k8s.kubectl("get", "batchruns,jobs,pods,rolebindings", "-n", ns, "-o",
                           "json", check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr, (
            f"namespace {ns} still there ({order}, rc={r.returncode} {r.stderr}): "
            f"{gone.stdout}\n{left.stdout[:3000]}\n{controller.output()[-4000:]}")
        elapsed = time.monotonic() - started
        # no Job or worker pod of the run left anywhere (they lived in the namespace)
        for kind in ("jobs", "pods"):
            items = json.loads(k8s.kubectl("get", kind, "-A", "-o", "json").stdout)["items"]
            assert not [i for i in items if i["metadata"]["namespace"] == ns], kind
        with psycopg.connect(dsn, row_factory=dict_row) as conn:
            counts = Queue(conn).counts(batch_id)
        if order != "controller-down":
            assert counts.get("pending", 0) == 0, counts
            assert counts.get("cancelled", 0) > 0, counts
        # else the namespace controller took the database Secret before a controller was
        # back to read it: the run's finalizer gave up on cancelling (docs/operator.md)
        assert elapsed < 140, elapsed
        log = controller.output()
        assert f"RoleBinding {ns}/" in log and "released" in log, log[-3000:]
    finally:
        controller.stop()
        # let the namespace go: the finalizers no controller dropped
        if k8s.kubectl("get", "namespace", ns, check=False).returncode == 0:
            k8s.kubectl("patch", "batchrun", "running", "-n", ns, "--type=merge", "-p",
                        '{"metadata":{"finalizers":null}}', check=False)
            release_rbac_guard(k8s, ns)
