"""Helpers for the operator's end-to-end tests: the controller as a real process, the
database Secret, BatchRun manifests and waiting on their status."""

from __future__ import annotations

import base64
import json
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from .harness.procs import free_port

REPO = Path(__file__).resolve().parents[2]
CRDS = [REPO / "crds" / "batchrun.yaml", REPO / "crds" / "kopf-peering.yaml",
        REPO / "crds" / "batchrunschedule.yaml", REPO / "crds" / "workerpool.yaml"]


# A CPU request for containers that name none, in every namespace the tests create. A
# pod without requests is BestEffort: the kubelet gives all of them together cpu.shares 2
# beside the Burstable controller pods' 51 each, so under CI load (the rest of the suite
# on both cores) a worker's Python took 16 s from container start to its first log line.
# Namespaces of real clusters carry such a LimitRange for the same reason.
LIMIT_RANGE = {
    "apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "default-cpu"},
    "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "100m"}}]}}


def create_namespace(k8s, name: str) -> str:
    """Create `name` with the tests' LimitRange and wait for its default ServiceAccount
    (the service-account controller creates it asynchronously; pods need it)."""
    k8s.kubectl("create", "namespace", name)
    k8s.kubectl("apply", "-n", name, "-f", "-", input=json.dumps(LIMIT_RANGE))
    k8s.kubectl("wait", "--for=create", "serviceaccount/default", "-n", name, "--timeout=60s")
    return name


def apply_crds(k8s) -> None:
    for crd in CRDS:
        k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    k8s.kubectl("wait", "--for=condition=Established", "crd/batchruns.jobrunner.dev",
                "crd/workerpools.jobrunner.dev", "--timeout=60s")


def release_rbac_guard(k8s, namespace: str) -> None:
    """What the chart's pre-delete hook does: drop the finalizer of the controller's
    RoleBindings in `namespace`, for a test that stopped its controller (nothing would
    drop it then, and the namespace would stay Terminating after the test)."""
    names = k8s.kubectl("get", "rolebindings", "-n", namespace, "-o", "name",
                        check=False).stdout.split()
    for name in names:
        k8s.kubectl("patch", name, "-n", namespace, "--type=merge", "-p",
                    '{"metadata":{"finalizers":null}}', check=False)


def create_db_secret(k8s, namespace: str, dsn: str, name: str = "jobrunner-db") -> None:
    manifest = {"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace},
                "data": {"dsn": base64.b64encode(dsn.encode()).decode()}}
    k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest))


CHART = REPO / "charts" / "jobrunner"
CONTROLLER_NAMESPACE = "jobrunner-e2e-system"


class Controller:
    """The controller as the chart runs it: a container of the built image, with the pod
    spec, ServiceAccount and RBAC that `helm template` renders for a release watching
    `namespace` (chart value watch.namespaces), in a namespace of its own (as a real
    install: deleting the watched namespace must not take the controller with it).

    A bare Pod with restartPolicy Never rather than the Deployment, so that `kill()` is a
    crash that stays down until `start()` creates the next controller pod."""

    def __init__(self, k8s, namespace: str, log: Path, metrics_port: int = 0,
                 cluster_rbac: bool = False, values: tuple[str, ...] = (), **env: str) -> None:
        self.k8s, self.namespace, self.log = k8s, namespace, log
        # The chart's namespaced RBAC: a RoleBinding in the watched namespace to a
        # ClusterRole, guarded by a finalizer the controller drops when nothing there is
        # left to finalize (operator/rbacguard.py). cluster_rbac renders the
        # ClusterRoleBinding instead.
        self.cluster_rbac = cluster_rbac
        self.metrics_port = metrics_port or free_port()
        self.extra_env = env
        self.values = values  # more `--set` values of the chart (kueue.enabled=true, ...)
        self.release = f"c-{namespace}"[:40]
        self.pod = f"{self.release}-controller"
        self.generation = 0
        self._objects_applied = False

    def _render(self) -> list[dict[str, Any]]:
        scope = (["--set", "watch.clusterWide=true"] if self.cluster_rbac
                 else ["--set", f"watch.namespaces={{{self.namespace}}}"])
        sets = [*scope,
                "--set", "peering.enabled=false",
                "--set", "image.repository=jobrunner", "--set", "image.tag=e2e",
                "--set", "image.pullPolicy=Never",
                "--set", "controller.hostNetwork=true", "--set", "worker.hostNetwork=true",
                "--set", "controller.refreshSeconds=1", "--set", "controller.logFormat=text",
                "--set", f"controller.metricsPort={self.metrics_port}",
                "--set", f"controller.healthPort={free_port()}",
                "--set", "metrics.service.enabled=false",
                *(arg for value in self.values for arg in ("--set", value))]
        envs = [*self.k8s.in_cluster_env(),
                *({"name": k, "value": v} for k, v in self.extra_env.items())]
        for i, e in enumerate(envs):
            sets += ["--set", f"controller.extraEnv[{i}].name={e['name']}",
                     "--set-string", f"controller.extraEnv[{i}].value={e['value']}"]
        out = self.k8s.helm("template", self.release, str(CHART), "-n", CONTROLLER_NAMESPACE,
                            *sets).stdout
        # Helm's hooks (the pre-delete Job of an uninstall) are not part of a running
        # release: a plain apply would run them at once.
        return [d for d in yaml.safe_load_all(out) if d and "helm.sh/hook" not in (
            d["metadata"].get("annotations") or {})]

    def start(self) -> Controller:
        docs = self._render()
        if not self._objects_applied:
            self.k8s.kubectl("create", "namespace", CONTROLLER_NAMESPACE, check=False)
            rest = [d for d in docs if d["kind"] != "Deployment"]
            self.k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rest))
            self._objects_applied = True
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        template = deploy["spec"]["template"]
        self.generation += 1
        for c in template["spec"]["containers"]:  # still watch only the test's namespace
            c["args"] = [f"--namespace={self.namespace}" if a == "--all-namespaces" else a
                         for a in c.get("args", [])]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{self.pod}-{self.generation}",
                            "namespace": CONTROLLER_NAMESPACE,
                            "labels": template["metadata"].get("labels", {})},
               "spec": {**template["spec"], "restartPolicy": "Never"}}
        self.k8s.kubectl("apply", "-f", "-", input=json.dumps(pod))
        return self

    @property
    def pod_name(self) -> str:
        return f"{self.pod}-{self.generation}"

    def _pod(self) -> dict[str, Any] | None:
        return get(self.k8s, "pod", self.pod_name, CONTROLLER_NAMESPACE)

    def alive(self) -> bool:
        """The controller's container has not ended (it may still be starting)."""
        pod = self._pod()
        return bool(pod) and pod["status"].get("phase") in ("Pending", "Running", None)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.k8s.node.kill_pod(CONTROLLER_NAMESPACE, self.pod_name, sig)
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._save_log()

    def stop(self) -> None:
        self._save_log()
        self.k8s.kubectl("delete", "pod", self.pod_name, "-n", CONTROLLER_NAMESPACE,
                         "--wait=false", "--ignore-not-found", check=False)

    def _save_log(self) -> None:
        r = self.k8s.kubectl("logs", self.pod_name, "-n", CONTROLLER_NAMESPACE, check=False)
        if r.returncode == 0:
            with open(self.log, "a") as f:
                f.write(f"===== {self.pod_name} =====\n{r.stdout}")

    def output(self) -> str:
        saved = self.log.read_text(errors="replace") if self.log.exists() else ""
        r = self.k8s.kubectl("logs", self.pod_name, "-n", CONTROLLER_NAMESPACE, check=False)
        return saved + (r.stdout if r.returncode == 0 else "")


# The tests' handlers (tests/support/handlers.py) are not in the image: worker pods get the
# repository's tests/ read-only at /app/tests (PYTHONPATH=/app), so `tests.support.handlers`
# imports in the container exactly as in a local process.
TEST_HANDLERS_VOLUME = {"name": "test-handlers",
                        "hostPath": {"path": str(REPO / "tests"), "type": "Directory"}}
TEST_HANDLERS_MOUNT = {"name": "test-handlers", "mountPath": "/app/tests", "readOnly": True}


def with_test_handlers(spec: dict[str, Any]) -> dict[str, Any]:
    template = dict(spec.get("template") or {})
    template["volumes"] = [*template.get("volumes", []), TEST_HANDLERS_VOLUME]
    template["volumeMounts"] = [*template.get("volumeMounts", []), TEST_HANDLERS_MOUNT]
    return {**spec, "template": template}


def batchrun(name: str, spec: dict[str, Any], test_handlers: bool = True) -> str:
    if test_handlers and str(spec.get("handler") or "").startswith("tests."):
        spec = with_test_handlers(spec)
    return yaml.safe_dump({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
                           "metadata": {"name": name}, "spec": spec})


def get(k8s, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    r = k8s.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def wait_phase(k8s, name: str, namespace: str, phases: tuple[str, ...], timeout: float = 180,
               controller: Controller | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        last = get(k8s, "batchrun", name, namespace)
        if last and (last.get("status") or {}).get("phase") in phases:
            return last
        time.sleep(0.5)
    tail = controller.output()[-4000:] if controller else ""
    raise AssertionError(f"BatchRun {name} did not reach {phases} in {timeout}s; last status "
                         f"{json.dumps((last or {}).get('status'), indent=1)}\n{tail}")


def jobs_of(k8s, namespace: str) -> list[dict[str, Any]]:
    return json.loads(k8s.kubectl("get", "jobs", "-n", namespace, "-o", "json").stdout)["items"]


def pods_of(k8s, namespace: str) -> list[dict[str, Any]]:
    return json.loads(k8s.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]


def events_of(k8s, namespace: str) -> list[dict[str, Any]]:
    return json.loads(k8s.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]


def apply(k8s, namespace: str, text: str, check: bool = True):
    return k8s.kubectl("apply", "-n", namespace, "-f", "-", input=text, check=check)
