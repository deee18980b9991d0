"""The Kubernetes Job a BatchRun runs on: built from the spec, named deterministically."""

from __future__ import annotations

import hashlib
from typing import Any

from jobrunner.manifest import BatchRunSpec

from .config import CONFIG

WORKER_GRACE_SECONDS = 30


def job_name(name: str, uid: str) -> str:
    """Deterministic and unique per BatchRun object: a restart never makes a second Job."""
    suffix = hashlib.sha256(uid.encode()).hexdigest()[:6]
    return f"{name[:50].rstrip('-.')}-{suffix}"


def default_batch_id(namespace: str, name: str, uid: str) -> str:
    return f"{namespace}/{name}/{uid[:8]}"


def backoff_limit(workers: int) -> int:
    # Crashed pods (OOM, node loss, kill -9) are replaced; only a crash loop of every
    # worker, several times over, fails the Job.
    return max(6, 3 * workers)


def build_job(run: BatchRunSpec, *, name: str, namespace: str, batch_id: str,
              secret_name: str, secret_key: str) -> dict[str, Any]:
    template = dict(run.template)
    env = [
        {"name": "JOBRUNNER_DATABASE_URL",
         "valueFrom": {"secretKeyRef": {"name": secret_name, "key": secret_key}}},
        {"name": "JOBRUNNER_WORKER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "JOBRUNNER_BATCH_ID", "value": batch_id},
        *template.get("env", []),
    ]
    container: dict[str, Any] = {
        "name": "worker",
        "image": template.get("image") or CONFIG.worker_image,
        "imagePullPolicy": template.get("imagePullPolicy") or CONFIG.image_pull_policy,
        "command": ["jobrunner", "worker", "--batch", batch_id, "--exit-when-drained",
                    "--log-format", "json", "--grace-period", str(WORKER_GRACE_SECONDS),
                    *run.worker_args()],
        "env": env,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        # The root filesystem is read-only; command handlers and Python get a scratch /tmp.
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    for key in ("envFrom", "resources"):
        if template.get(key):
            container[key] = template[key]
    labels = {"app.kubernetes.io/name": "jobrunner-worker",
              "app.kubernetes.io/managed-by": "jobrunner",
              "jobrunner.dev/batchrun": run.name[:63].rstrip("-.")}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        # Workers talk to PostgreSQL only: no Kubernetes API token in their pods.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS + 15,
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    service_account = template.get("serviceAccountName") or CONFIG.worker_service_account
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    for key in ("nodeSelector", "tolerations"):
        if template.get(key):
            pod_spec[key] = template[key]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "parallelism": run.workers,
            # No completions: the work-queue pattern. Pods exit 0 once the batch is drained.
            "activeDeadlineSeconds": run.effective_deadline(),
            "backoffLimit": backoff_limit(run.workers),
            "suspend": run.suspend,
            "template": {
                "metadata": {"labels": {**labels, **template.get("labels", {})},
                             "annotations": dict(template.get("annotations", {}))},
                "spec": pod_spec,
            },
        },
    }
