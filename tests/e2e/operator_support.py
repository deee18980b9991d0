"""Helpers for the operator's end-to-end tests: the controller as a real process, the
database Secret, BatchRun manifests and waiting on their status."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRDS = [REPO / "crds" / "batchrun.yaml", REPO / "crds" / "kopf-peering.yaml"]


def apply_crds(k8s) -> None:
    for crd in CRDS:
        k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    k8s.kubectl("wait", "--for=condition=Established", "crd/batchruns.jobrunner.dev",
                "--timeout=60s")


def create_db_secret(k8s, namespace: str, dsn: str, name: str = "jobrunner-db") -> None:
    manifest = {"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace},
                "data": {"dsn": base64.b64encode(dsn.encode()).decode()}}
    k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest))


class Controller:
    """`python -m controller` watching one namespace, with the admin kubeconfig."""

    def __init__(self, k8s, namespace: str, log: Path, metrics_port: int = 0, **env: str) -> None:
        self.k8s, self.namespace, self.log = k8s, namespace, log
        self.metrics_port = metrics_port
        self.env = {**k8s.env, "JOBRUNNER_REFRESH_SECONDS": "1",
                    "JOBRUNNER_WORKER_IMAGE": k8s.image,
                    "JOBRUNNER_WORKER_IMAGE_PULL_POLICY": "Never",
                    "JOBRUNNER_WORKER_HOST_NETWORK": "true", "PYTHONPATH": str(REPO),
                    **env}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Controller:
        handle = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller", "--namespace", self.namespace, "--standalone",
             "--metrics-port", str(self.metrics_port), "--health-port", "0",
             "--log-format", "text"],
            env=self.env, cwd=REPO, stdout=handle, stderr=handle, start_new_session=True)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


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
