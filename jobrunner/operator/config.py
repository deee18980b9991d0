"""Controller settings, from the environment (the Helm chart sets these)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

GROUP, VERSION, PLURAL = "jobrunner.dev", "v1alpha1", "batchruns"
POOL_PLURAL = "workerpools"
SCHEDULE_PLURAL = "batchrunschedules"
# kopf's finalizer on every BatchRun, WorkerPool and BatchRunSchedule it handles.
FINALIZER = "jobrunner.dev/cancel-pending-tasks"


@dataclass(frozen=True)
class Config:
    worker_image: str
    image_pull_policy: str
    default_secret_name: str
    default_secret_key: str
    refresh_seconds: float
    delete_retries: int
    worker_service_account: str | None
    worker_host_network: bool = False
    # How often each WorkerPool's queue depth is read and its Deployment scaled.
    pool_scale_seconds: float = 10.0
    # Kueue (chart value kueue.defaultQueueNames): the LocalQueue of each namespace's runs
    # that name none.
    kueue_default_queues: dict[str, str] = field(default_factory=dict)
    # Tenants bound to namespaces (chart value tenancy.bindToNamespaces): a run may name
    # only its namespace's tenants (operator/tenancy.py); allowed_tenants adds others.
    bind_tenants: bool = False
    # The Secret the worker pods of runs and pools that name no spec.database read
    # (chart value database.workerSecretName): a DSN of the worker role, not the
    # controller's. None: the controller's own (one Secret for all: not least privilege).
    worker_secret_name: str | None = None
    allowed_tenants: dict[str, list[str]] = field(default_factory=dict)
    # Worker pods serve their Prometheus metrics on this port (chart value
    # worker.metricsPort; 0: not at all): docs/observability.md.
    worker_metrics_port: int = 0
    # Namespaced RBAC: the controller's RoleBinding (this name) in each of these namespaces
    # carries the finalizer the controller drops once nothing there needs it
    # (operator/rbacguard.py). None: no guarded binding (cluster-wide, or one namespace).
    rbac_guard: str | None = None
    rbac_guard_namespaces: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> Config:
        env = os.environ
        return cls(
            worker_image=env.get("JOBRUNNER_WORKER_IMAGE", "ghcr.io/jobrunner/jobrunner:0.1.0"),
            image_pull_policy=env.get("JOBRUNNER_WORKER_IMAGE_PULL_POLICY", "IfNotPresent"),
            default_secret_name=env.get("JOBRUNNER_DB_SECRET_NAME", "jobrunner-db"),
            default_secret_key=env.get("JOBRUNNER_DB_SECRET_KEY", "dsn"),
            refresh_seconds=float(env.get("JOBRUNNER_REFRESH_SECONDS", "5")),
            delete_retries=int(env.get("JOBRUNNER_DELETE_RETRIES", "5")),
            worker_service_account=env.get("JOBRUNNER_WORKER_SERVICE_ACCOUNT") or None,
            worker_host_network=env.get("JOBRUNNER_WORKER_HOST_NETWORK", "").lower()
            in ("1", "true", "yes"),
            pool_scale_seconds=float(env.get("JOBRUNNER_POOL_SCALE_SECONDS", "10")),
            kueue_default_queues=_queues(env.get("JOBRUNNER_KUEUE_DEFAULT_QUEUES", "")),
            worker_secret_name=env.get("JOBRUNNER_WORKER_DB_SECRET_NAME") or None,
            bind_tenants=env.get("JOBRUNNER_BIND_TENANTS", "").lower() in ("1", "true", "yes"),
            allowed_tenants=_tenants(env.get("JOBRUNNER_ALLOWED_TENANTS", "")),
            worker_metrics_port=int(env.get("JOBRUNNER_WORKER_METRICS_PORT") or 0),
            rbac_guard=env.get("JOBRUNNER_RBAC_GUARD") or None,
            rbac_guard_namespaces=tuple(
                n.strip() for n in env.get("JOBRUNNER_RBAC_GUARD_NAMESPACES", "").split(",")
                if n.strip()),
        )


def _queues(text: str) -> dict[str, str]:
    """{namespace: LocalQueue} from JSON; the chart's schema checked the names."""
    if not text.strip():
        return {}
    value = json.loads(text)
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("JOBRUNNER_KUEUE_DEFAULT_QUEUES must be a JSON object of "
                         "namespace: LocalQueue name")
    return value


def worker_secret(database: dict, secret: str, key: str) -> tuple[str, str]:
    """The Secret the workers read: the one the resource names, else the chart's worker
    Secret (same key), else the controller's (`secret`)."""
    if database.get("secretName") or not CONFIG.worker_secret_name:
        return secret, key
    return CONFIG.worker_secret_name, key


def _tenants(text: str) -> dict[str, list[str]]:
    """{namespace: [tenant, ...]} from JSON; the chart's schema checked the shape."""
    if not text.strip():
        return {}
    value = json.loads(text)
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v)
            for k, v in value.items()):
        raise ValueError("JOBRUNNER_ALLOWED_TENANTS must be a JSON object of "
                         "namespace: [tenant, ...]")
    return value


CONFIG = Config.from_env()
