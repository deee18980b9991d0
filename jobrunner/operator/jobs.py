"""The Kubernetes Job a BatchRun runs on: built from the spec, named deterministically.
The worker pod itself (worker_pod_template) is shared with a WorkerPool's Deployment."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from jobrunner.features.manifest import TMP_PATH, TMP_VOLUME, WORKER_CONTAINER, BatchRunSpec
from jobrunner.operator import kueue
from jobrunner.operator.config import CONFIG
from jobrunner.operator.kube import ApiError

# The pod's default termination grace; the worker gets two thirds of it to finish running
# tasks, the rest is for releasing the unfinished ones and exiting before SIGKILL.
POD_GRACE_SECONDS = 45


def worker_grace(pod_grace: int) -> int:
    return max(1, pod_grace * 2 // 3)

# Hardened by default; spec.template.securityContext / containerSecurityContext are merged
# over these (merge_over), so a run can change one key (runAsUser, a seccomp profile, an
# added capability) without silently losing the others.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
WORKER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]}}
# Pod-level fields copied from spec.template as they are (when set).
POD_PASSTHROUGH = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                   "priorityClassName", "runtimeClassName", "imagePullSecrets")


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


def merge_over(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` applied to ``defaults`` like a JSON merge patch (RFC 7386): mappings
    merge key by key, recursively; lists and scalars replace; null removes the key."""
    merged = copy.deepcopy(dict(defaults))
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_over(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def build_job(run: BatchRunSpec, *, name: str, namespace: str, batch_id: str,
              secret_name: str, secret_key: str) -> dict[str, Any]:
    pod_grace = pod_grace_seconds(run.template)
    labels = {"app.kubernetes.io/name": "jobrunner-worker",
              "app.kubernetes.io/managed-by": "jobrunner",
              "jobrunner.dev/batchrun": run.name[:63].rstrip("-.")}
    template = worker_pod_template(
        run.template,
        command=["jobrunner", "worker", "--batch", batch_id, "--exit-when-drained",
                 "--log-format", "json", "--grace-period", str(worker_grace(pod_grace)),
                 *run.worker_args()],
        env=[{"name": "JOBRUNNER_BATCH_ID", "value": batch_id}],
        secret_name=secret_name, secret_key=secret_key, labels=labels,
        restart_policy="Never")
    metadata: dict[str, Any] = {"name": name, "namespace": namespace,
                                "labels": {**labels, **kueue.job_labels(run)}}
    if annotations := kueue.job_annotations(run):
        metadata["annotations"] = annotations
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "parallelism": run.workers,
            # No completions: the work-queue pattern. Pods exit 0 once the batch is drained.
            "activeDeadlineSeconds": run.effective_deadline(),
            "backoffLimit": backoff_limit(run.workers),
            # A Job Kueue admits is created suspended: Kueue unsuspends it on admission
            # (its webhook would suspend it anyway).
            "suspend": run.suspend or run.queue_name is not None,
            "template": template,
        },
    }


def pod_grace_seconds(template: Mapping[str, Any]) -> int:
    return int(template.get("terminationGracePeriodSeconds") or POD_GRACE_SECONDS)


def worker_pod_template(spec_template: Mapping[str, Any], *, command: list[str],
                        env: list[dict[str, Any]], secret_name: str, secret_key: str,
                        labels: Mapping[str, str], restart_policy: str) -> dict[str, Any]:
    """The worker pod of a Job (a BatchRun's) or a Deployment (a WorkerPool's): the
    jobrunner container, /tmp, hardened defaults, with spec.template applied over them.
    One function, so that both kinds of workers get the same defaults and the same
    template semantics (docs/operator.md, "Worker pods")."""
    # A copy: the pod must not share nested objects with the parsed spec.
    template = copy.deepcopy(dict(spec_template))
    pod_grace = pod_grace_seconds(template)
    container_env = [
        {"name": "JOBRUNNER_DATABASE_URL",
         "valueFrom": {"secretKeyRef": {"name": secret_name, "key": secret_key}}},
        {"name": "JOBRUNNER_WORKER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *env,
        # (before the template's: a run's own JOBRUNNER_METRICS_PORT wins)
        *([{"name": "JOBRUNNER_METRICS_PORT", "value": str(CONFIG.worker_metrics_port)}]
          if CONFIG.worker_metrics_port else []),
        *template.get("env", []),
    ]
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": template.get("image") or CONFIG.worker_image,
        "imagePullPolicy": template.get("imagePullPolicy") or CONFIG.image_pull_policy,
        "command": command,
        "env": container_env,
        "securityContext": merge_over(WORKER_SECURITY_CONTEXT,
                                      template.get("containerSecurityContext") or {}),
        # The root filesystem is read-only; command handlers and Python get a scratch /tmp.
        "volumeMounts": [{"name": TMP_VOLUME, "mountPath": TMP_PATH},
                         *template.get("volumeMounts", [])],
    }
    for key in ("envFrom", "resources"):
        if template.get(key):
            container[key] = template[key]
    if CONFIG.worker_metrics_port:
        # (a PodMonitor finds the port by its name; docs/observability.md)
        container["ports"] = [{"name": "metrics", "containerPort": CONFIG.worker_metrics_port,
                               "protocol": "TCP"}]
    # A user volume named tmp replaces the default emptyDir (a size limit, a memory
    # medium, an ephemeral PVC); the worker's mount on /tmp stays either way.
    volumes = template.get("volumes", [])
    if not any(v.get("name") == TMP_VOLUME for v in volumes):
        volumes = [{"name": TMP_VOLUME, "emptyDir": {}}, *volumes]
    pod_spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "containers": [container, *template.get("containers", [])],
        # Workers talk to PostgreSQL only: no Kubernetes API token in their pods.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": pod_grace,
        "volumes": volumes,
        "securityContext": merge_over(POD_SECURITY_CONTEXT, template.get("securityContext") or {}),
    }
    if template.get("initContainers"):
        pod_spec["initContainers"] = template["initContainers"]
    service_account = template.get("serviceAccountName") or CONFIG.worker_service_account
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    for key in POD_PASSTHROUGH:
        if template.get(key):
            pod_spec[key] = template[key]
    host_network = template.get("hostNetwork")
    if host_network is None:
        host_network = CONFIG.worker_host_network
    if host_network:
        pod_spec["hostNetwork"] = True
        # With the host's network the default ClusterFirst would silently fall back to the
        # node's resolver: cluster Service names (the database's) would not resolve.
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if template.get("dnsPolicy"):
        pod_spec["dnsPolicy"] = template["dnsPolicy"]
    return {"metadata": {"labels": {**labels, **template.get("labels", {})},
                         "annotations": dict(template.get("annotations", {}))},
            "spec": pod_spec}


def api_error_detail(exc: ApiError) -> str:
    """The API server's own message (the Status object in its reply), e.g. which field of
    the Job's pod template it refused; else the HTTP reason."""
    return exc.message or exc.reason or ""
