"""kopf handlers for WorkerPool: a Deployment of `jobrunner worker --pool` pods, scaled on
the pool's queue depth by the controller (docs/pools.md, "On Kubernetes").

- The queue pool is `<namespace>/<name>`: two namespaces never share a pool by accident.
- The Deployment `<name>-workers` (owned by the WorkerPool, so deleting the pool deletes
  it) runs the pod `controller/jobs.worker_pod_template` builds for a BatchRun's Job:
  same template subset, same hardened defaults, the DSN from the same Secret reference.
- A change of the pod (spec, or the controller's worker image) replaces the Deployment's
  template: a rolling update, whose stopped workers release their leases on SIGTERM.
- A timer reads the pool's work (pending and due + leased) and sets the replicas
  (jobrunner/operator/scaling.py): up at once, down after the stabilization window, to zero.
  Not an HPA: the cluster needs no metrics adapter, and an HPA cannot scale to zero
  without the HPAScaleToZero alpha feature gate.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from jobrunner.features.manifest import parse_template
from jobrunner.model.errors import BadInput
from jobrunner.operator import kube, kueue, metrics, scaling
from jobrunner.operator.config import CONFIG, GROUP, POOL_PLURAL, VERSION, worker_secret
from jobrunner.operator.database import DatabaseProblem, queue_for, read_dsn
from jobrunner.operator.jobs import (
    api_error_detail,
    pod_grace_seconds,
    worker_grace,
    worker_pod_template,
)
from jobrunner.operator.kube import ApiError, plain
from jobrunner.operator.status import apply_status, event, now_iso, safe, set_condition
from jobrunner.store import workerpools as pools

log = logging.getLogger("jobrunner.controller")
HASH_ANNOTATION = "jobrunner.dev/pod-template-hash"
POOL_LABEL = "jobrunner.dev/workerpool"
# The work counts stop here (status.pending/running say "at least" beyond it): the
# scaling timer's scan of a deep backlog stays bounded.
WORK_COUNT_CAP = 100_000


@dataclass(frozen=True)
class WorkerPoolSpec:
    name: str
    namespace: str
    handlers: tuple[str, ...]
    max_replicas: int
    min_replicas: int = 0
    concurrency: int = 1
    batch_size: int = 1
    visibility_timeout: int = 600
    heartbeat: float = 200.0
    backoff_base: float = 1.0
    backoff_cap: float = 3600.0
    target_per_replica: int = 1
    window: int = 300
    template: dict[str, Any] = field(default_factory=dict)
    database: dict[str, Any] = field(default_factory=dict)
    # Kueue's Deployment integration (docs/kueue.md)
    queue_name: str | None = None
    priority_class: str | None = None

    def kueue_labels(self) -> dict[str, str]:
        labels: dict[str, str] = {}
        if self.queue_name:
            labels[kueue.QUEUE_LABEL] = self.queue_name
            if self.priority_class:
                labels[kueue.PRIORITY_CLASS_LABEL] = self.priority_class
        return labels

    @property
    def queue_pool(self) -> str:
        return queue_pool(self.namespace, self.name)

    def worker_args(self) -> list[str]:
        return ["--concurrency", str(self.concurrency), "--batch-size", str(self.batch_size),
                "--visibility-timeout", f"{self.visibility_timeout:g}",
                "--heartbeat", f"{self.heartbeat:g}",
                "--backoff-base", f"{self.backoff_base:g}",
                "--backoff-cap", f"{self.backoff_cap:g}",
                *(arg for h in self.handlers for arg in ("--handler", h))]

    def db_secret(self) -> tuple[str, str]:
        return (self.database.get("secretName") or CONFIG.default_secret_name,
                self.database.get("key") or CONFIG.default_secret_key)


def queue_pool(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def deployment_name(name: str) -> str:
    return f"{name}-workers"


def parse_workerpool(obj: dict[str, Any]) -> WorkerPoolSpec:
    """A WorkerPool's spec, with the CRD's rules again (a controller may meet objects
    written before a CRD upgrade, or by a test without the CRD's defaults)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    name, ns = meta.get("name"), meta.get("namespace") or "default"
    where = f"WorkerPool {ns}/{name}"

    def integer(key: str, default: int | None, lo: int, hi: int) -> int:
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise BadInput(f"{where}: spec.{key} must be an integer between {lo} and {hi}, "
                           f"got {value!r}")
        return value

    def number(key: str, default: float, hi: float) -> float:
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= hi:
            raise BadInput(f"{where}: spec.{key} must be a number above 0 and at most {hi:g}, "
                           f"got {value!r}")
        return float(value)

    handlers = spec.get("handlers")
    if not isinstance(handlers, list) or not handlers or len(handlers) > 32:
        raise BadInput(f"{where}: spec.handlers must be a list of 1 to 32 handlers "
                       "(package.module:function)")
    for i, handler in enumerate(handlers):
        if not isinstance(handler, str) or ":" not in handler:
            raise BadInput(f"{where}: spec.handlers[{i}] must look like "
                           f"'package.module:function', got {handler!r}")
    if len(set(handlers)) != len(handlers):
        raise BadInput(f"{where}: spec.handlers names a handler twice")
    max_replicas = integer("maxReplicas", None, 1, 1000)
    min_replicas = integer("minReplicas", 0, 0, 1000)
    if min_replicas > max_replicas:
        raise BadInput(f"{where}: spec.minReplicas must be at most spec.maxReplicas")
    concurrency = integer("concurrency", 1, 1, 100)
    vis = integer("visibilityTimeoutSeconds", 600, 1, 7 * 86400)
    heartbeat = number("heartbeatSeconds", vis / 3, vis)
    if not heartbeat < vis / 2:
        raise BadInput(f"{where}: spec.heartbeatSeconds must be less than half of "
                       "spec.visibilityTimeoutSeconds")
    base, cap = number("backoffBaseSeconds", 1.0, 3600), number("backoffCapSeconds", 3600.0,
                                                                7 * 86400)
    if cap < base:
        raise BadInput(f"{where}: spec.backoffCapSeconds must be at least "
                       "spec.backoffBaseSeconds")
    database = dict(spec.get("database") or {})
    queue, klass = spec.get("queueName"), spec.get("priorityClassName")
    for key, value in (("queueName", queue), ("priorityClassName", klass)):
        if value is not None and not kueue.valid_name(value):
            raise BadInput(f"{where}: spec.{key} must be a Kueue object's name (a DNS "
                           f"subdomain of at most 63 characters), got {value!r}")
    if klass is not None and queue is None:
        raise BadInput(f"{where}: spec.priorityClassName applies to a pool admitted by "
                       "Kueue; set spec.queueName")
    return WorkerPoolSpec(
        name=name, namespace=ns, handlers=tuple(handlers), max_replicas=max_replicas,
        min_replicas=min_replicas, concurrency=concurrency,
        batch_size=integer("batchSize", 1, 1, 1000), visibility_timeout=vis,
        heartbeat=heartbeat, backoff_base=base, backoff_cap=cap,
        target_per_replica=integer("targetTasksPerReplica", concurrency, 1, 100_000),
        window=integer("scaleDownStabilizationWindowSeconds", 300, 0, 86400),
        template=parse_template(spec.get("template"), where), database=database,
        queue_name=queue, priority_class=klass)


def build_deployment(pool: WorkerPoolSpec, replicas: int) -> dict[str, Any]:
    secret, key = worker_secret(pool.database, *pool.db_secret())
    grace = pod_grace_seconds(pool.template)
    labels = {"app.kubernetes.io/name": "jobrunner-worker",
              "app.kubernetes.io/managed-by": "jobrunner", POOL_LABEL: pool.name,
              # Kueue's Deployment integration reads the Deployment's label and its pod
              # webhook the pods' (where it would copy it to): both carry it.
              **pool.kueue_labels()}
    template = worker_pod_template(
        pool.template,
        # No --exit-when-drained: resident workers wait for the pool's next batch; the
        # controller scales them away when there is none.
        command=["jobrunner", "worker", "--pool", pool.queue_pool, "--log-format", "json",
                 "--grace-period", str(worker_grace(grace)), *pool.worker_args()],
        env=[{"name": "JOBRUNNER_POOL", "value": pool.queue_pool}],
        secret_name=secret, secret_key=key, labels=labels, restart_policy="Always")
    # (the selector's label wins over a template label of the same name)
    template["metadata"]["labels"][POOL_LABEL] = pool.name
    digest = pod_template_hash(template)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": deployment_name(pool.name), "namespace": pool.namespace,
                     "labels": labels, "annotations": {HASH_ANNOTATION: digest}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {POOL_LABEL: pool.name}},
            # New workers start before old ones stop: a rollout never leaves the pool
            # with fewer workers than it wants; the old ones release their leases.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": "25%"}},
            "revisionHistoryLimit": 3,
            "template": template,
        },
    }


def pod_template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def pool_work(queue: Any, pool: str) -> tuple[int, int]:
    """(pending and due, leased) of the pool's batches, each counted up to the cap."""
    return pools.work(queue.conn, pool, WORK_COUNT_CAP)


@kopf.on.create(GROUP, VERSION, POOL_PLURAL, backoff=5)
@kopf.on.resume(GROUP, VERSION, POOL_PLURAL, backoff=5)
@kopf.on.update(GROUP, VERSION, POOL_PLURAL, field="spec", backoff=5)
def pool_changed(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
    converge(body, plain(dict(status)), patch)


@kopf.timer(GROUP, VERSION, POOL_PLURAL, interval=CONFIG.pool_scale_seconds, initial_delay=1,
            backoff=CONFIG.pool_scale_seconds)
def pool_scale(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
    converge(body, plain(dict(status)), patch)


@kopf.on.delete(GROUP, VERSION, POOL_PLURAL, optional=True)
def pool_deleted(body: kopf.Body, **_: Any) -> None:
    # optional: no finalizer; the Deployment goes by garbage collection (owner reference).
    metrics.forget_pool(body.metadata.namespace, body.metadata.name)


def converge(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch) -> None:
    """Idempotent: the Deployment exists with the current pod template, its replicas are
    what the pool's work asks for, and status says so."""
    meta = body.metadata
    generation = meta.get("generation")
    conditions: list[dict[str, Any]] = list(st.get("conditions") or [])
    try:
        pool = parse_workerpool(plain({"metadata": dict(meta), "spec": dict(body.spec)}))
    except BadInput as exc:
        conditions = set_condition(conditions, "Ready", False, "InvalidSpec", str(exc),
                                   generation)
        conditions = set_condition(conditions, "Stalled", True, "InvalidSpec", str(exc),
                                   generation)
        apply_status(patch, st, {"conditions": conditions, "observedGeneration": generation})
        event(body, "Warning", "InvalidSpec", str(exc))
        raise kopf.PermanentError(str(exc)) from None

    new: dict[str, Any] = {"pool": pool.queue_pool,
                           "deploymentName": deployment_name(pool.name)}
    deploy = _read_deployment(pool)
    current = _replicas(deploy) if deploy is not None else 0
    now = time.time()
    try:
        secret, key = pool.db_secret()
        with queue_for(read_dsn(pool.namespace, secret, key)) as queue:
            pending, leased = pool_work(queue, pool.queue_pool)
    except DatabaseProblem as problem:
        message = safe(str(problem))
        conditions = set_condition(conditions, "Sized", None, problem.reason, message,
                                   generation)
        if deploy is None:
            _create_deployment(body, pool, pool.min_replicas)
            new["lastScaleTime"] = now_iso()
        new.update(conditions=conditions, observedGeneration=generation,
                   desiredReplicas=current if deploy is not None else pool.min_replicas)
        apply_status(patch, st, new)
        metrics.RECONCILE_ERRORS.labels(problem.reason).inc()
        raise kopf.TemporaryError(message, delay=min(30, CONFIG.pool_scale_seconds * 2)
                                  ) from None

    decision = scaling.decide(
        current=current if deploy is not None else 0, work=pending + leased,
        per_replica=pool.target_per_replica, min_replicas=pool.min_replicas,
        max_replicas=pool.max_replicas, window=pool.window,
        pending_down=_scale_down_state(st), now=now)
    if deploy is None:
        deploy = _create_deployment(body, pool, decision.desired)
        new["lastScaleTime"] = now_iso()
    else:
        changed = _update_deployment(body, pool, deploy, decision.desired)
        if changed:
            new["lastScaleTime"] = now_iso()
            if decision.desired != current:
                event(body, "Normal", "Scaled",
                       f"{deployment_name(pool.name)}: {current} -> {decision.desired} "
                       f"replica(s): {decision.message}")
    ready = (deploy.get("status") or {}).get("readyReplicas") or 0
    have = (deploy.get("status") or {}).get("replicas") or 0
    if pool.queue_name:
        conditions = _kueue_admission(body, pool, conditions, new, have, generation)
    new.update(replicas=have, readyReplicas=ready, desiredReplicas=decision.desired,
               pending=pending, running=leased, observedGeneration=generation,
               scaleDown=({"since": _iso(decision.pending_down.since),
                           "replicas": decision.pending_down.most}
                          if decision.pending_down else None))
    conditions = set_condition(conditions, "Sized", True, decision.reason, decision.message,
                               generation)
    all_ready = ready >= decision.desired and have <= decision.desired
    conditions = set_condition(
        conditions, "Ready", all_ready, "ReplicasReady" if all_ready else "ReplicasNotReady",
        f"{ready}/{decision.desired} worker(s) ready, {have} pod(s)", generation)
    conditions = set_condition(conditions, "Reconciling", not all_ready,
                               "Scaling" if not all_ready else "Stable",
                               f"{have} -> {decision.desired} replica(s)", generation)
    conditions = set_condition(conditions, "Stalled", False, "Running", "", generation)
    new["conditions"] = conditions
    apply_status(patch, st, new)
    metrics.record_pool(pool.namespace, pool.name, pending, leased, decision.desired, ready)


def _kueue_admission(body: kopf.Body, pool: WorkerPoolSpec, conditions: list[dict[str, Any]],
                     new: dict[str, Any], have: int, generation: int | None
                     ) -> list[dict[str, Any]]:
    """status.queuedReplicas and the Admitted condition: how many worker pods Kueue keeps
    gated for want of quota (each pod of the Deployment is a Workload of its own); an
    Event when pods start or stop waiting."""
    try:
        found = kube.list_pods(pool.namespace, f"{POOL_LABEL}={pool.name}")
    except ApiError:
        return conditions  # (no verdict this time)
    queued = sum(1 for p in found if kueue.gated(p))
    before = next((c for c in conditions if c.get("type") == "Admitted"), None)
    new["queuedReplicas"] = queued
    if queued:
        message = (f"{queued} of {len(found)} worker pod(s) wait for Kueue's admission in "
                   f"LocalQueue {pool.queue_name} (the ClusterQueue's quota is used up)")
        conditions = set_condition(conditions, "Admitted", False, "WaitingForAdmission",
                                   message, generation)
    else:
        message = f"every worker pod ({len(found)}) admitted by LocalQueue {pool.queue_name}"
        conditions = set_condition(conditions, "Admitted", True, "Admitted", message,
                                   generation)
    if not before or before.get("status") != ("False" if queued else "True"):
        event(body, "Normal", "WaitingForAdmission" if queued else "Admitted", message)
    return conditions


def _scale_down_state(st: dict[str, Any]) -> scaling.ScaleDown | None:
    raw = st.get("scaleDown")
    if not raw or not raw.get("since"):
        return None
    try:
        since = dt.datetime.fromisoformat(raw["since"].replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    return scaling.ScaleDown(since, int(raw.get("replicas") or 0))


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _replicas(deploy: dict[str, Any]) -> int:
    return (deploy.get("spec") or {}).get("replicas") or 0


def _read_deployment(pool: WorkerPoolSpec) -> dict[str, Any] | None:
    try:
        return kube.read_deployment(pool.namespace, deployment_name(pool.name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise kopf.TemporaryError(f"reading Deployment {deployment_name(pool.name)}: HTTP "
                                  f"{exc.status}", delay=5) from None


def _create_deployment(body: kopf.Body, pool: WorkerPoolSpec, replicas: int
                       ) -> dict[str, Any]:
    manifest = build_deployment(pool, replicas)
    kopf.adopt(manifest, owner=body)
    name = manifest["metadata"]["name"]
    try:
        deploy = kube.create_deployment(pool.namespace, manifest)
    except ApiError as exc:
        if exc.status == 409:
            return kube.read_deployment(pool.namespace, name)
        message = safe(f"Deployment {name} rejected: HTTP {exc.status} "
                        f"{api_error_detail(exc)}")
        event(body, "Warning", "DeploymentRejected", message)
        raise kopf.TemporaryError(message, delay=30) from None
    event(body, "Normal", "DeploymentCreated",
           f"Deployment {name}: {replicas} replica(s), pool {pool.queue_pool}, handler(s) "
           f"{', '.join(pool.handlers)}")
    return deploy


def _update_deployment(body: kopf.Body, pool: WorkerPoolSpec, deploy: dict[str, Any],
                       replicas: int) -> bool:
    """Replicas and, if the pod changed, the pod template (a JSON patch: lists replaced,
    not merged, so a removed env var or volume goes). Returns whether replicas changed."""
    wanted = build_deployment(pool, replicas)
    digest = wanted["metadata"]["annotations"][HASH_ANNOTATION]
    ops: list[dict[str, Any]] = []
    name = deploy["metadata"]["name"]
    annotations = deploy["metadata"].get("annotations") or {}
    if _replicas(deploy) != replicas:
        ops.append({"op": "replace", "path": "/spec/replicas", "value": replicas})
    rolled = annotations.get(HASH_ANNOTATION) != digest
    if rolled:
        ops.append({"op": "replace", "path": "/spec/template", "value": wanted["spec"]["template"]})
        ops.append({"op": "add", "path": "/metadata/annotations",
                    "value": {**annotations, HASH_ANNOTATION: digest}})
    if not ops:
        return False
    try:
        kube.json_patch_deployment(pool.namespace, name, ops)
    except ApiError as exc:
        message = safe(f"updating Deployment {name}: HTTP {exc.status} "
                        f"{api_error_detail(exc)}")
        if exc.status == 422:
            event(body, "Warning", "DeploymentRejected", message)
        raise kopf.TemporaryError(message, delay=10) from None
    if rolled:
        event(body, "Normal", "RollingUpdate",
               f"Deployment {name}: the worker pod changed; rolling out")
    return _replicas(deploy) != replicas


def find_pool(namespace: str, name: str) -> WorkerPoolSpec | None:
    """The WorkerPool a BatchRun names, or None if it does not exist (yet)."""
    try:
        obj = kube.get_custom(GROUP, VERSION, namespace, POOL_PLURAL, name)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise kopf.TemporaryError(f"reading WorkerPool {namespace}/{name}: HTTP {exc.status}",
                                  delay=5) from None
    return parse_workerpool(obj)
