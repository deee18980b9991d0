"""The BatchRun spec: one definition read by `jobrunner run` and by the operator.

The CRD (crds/batchrun.yaml) enforces the same rules at `kubectl apply` time; this
module applies them to a manifest file read locally, with the same messages where it
can, and turns the spec into task specs and worker settings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from jobrunner.features.generators import GeneratorSpec, parse_generator
from jobrunner.features.reduce import ReduceSpec, parse_reduce
from jobrunner.features.sources import config_map_tasks, file_tasks, parse_config_map_ref
from jobrunner.model.errors import BadInput
from jobrunner.model.validation import (
    MAX_ATTEMPTS_LIMIT,
    MAX_TOKENS,
    TaskSpec,
    check_identifier,
    check_limit_names,
    encode_payload,
)

API_VERSION = "jobrunner.dev/v1alpha1"
KIND = "BatchRun"
DEADLINE_BUFFER_SECONDS = 60
MAX_SHARD_RANGE = 1_000_000

SPEC_FIELDS = {
    "tenant", "batchId", "shards", "shardRange", "source", "workers", "concurrency",
    "batchSize", "visibilityTimeoutSeconds", "heartbeatSeconds", "maxAttempts",
    "backoffBaseSeconds", "backoffCapSeconds", "activeDeadlineSeconds", "handler",
    "command", "template", "database", "suspend", "reduce", "limits", "tokens", "budget",
    "pool", "priority", "queueName", "priorityClassName", "minWorkers",
}
BUDGET_FIELDS = {"tokens", "cost"}
# spec.budget.cost: a decimal string (Kubernetes API conventions avoid floats in specs;
# the CRD checks the same pattern), at most 12 digits before the point and 9 after.
COST_PATTERN = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,9})?$")

# spec.template: a subset of the Kubernetes PodTemplate, with Kubernetes' own names.
TEMPLATE_FIELDS = {
    "image", "imagePullPolicy", "imagePullSecrets", "serviceAccountName", "resources", "env",
    "envFrom", "volumeMounts", "containerSecurityContext", "labels", "annotations",
    "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
    "priorityClassName", "runtimeClassName", "hostNetwork", "dnsPolicy", "securityContext",
    "volumes", "containers", "initContainers", "terminationGracePeriodSeconds",
}
WORKER_CONTAINER = "worker"
# The worker's root filesystem is read-only: it always gets a writable /tmp from the
# volume of this name. A user volume of the same name replaces the default emptyDir.
TMP_VOLUME, TMP_PATH = "tmp", "/tmp"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# "None" is left out: it needs dnsConfig, which the template does not offer.
DNS_POLICIES = ("ClusterFirst", "ClusterFirstWithHostNet", "Default")
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")
AFFINITY_FIELDS = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
# The CRD's maxItems (they also bound the cost of its CEL rules).
LIST_LIMITS = {"volumes": 64, "volumeMounts": 64, "containers": 16, "initContainers": 16,
               "imagePullSecrets": 32, "topologySpreadConstraints": 16}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# The securityContext fields of core/v1, with their JSON types: the pod's and a
# container's differ, and putting one where the other belongs is a common mistake that
# the API server would only report (or silently drop) when the Job is created.
_COMMON_SECURITY = {
    "runAsNonRoot": bool, "runAsUser": int, "runAsGroup": int, "seccompProfile": Mapping,
    "seLinuxOptions": Mapping, "windowsOptions": Mapping, "appArmorProfile": Mapping,
}
POD_SECURITY_FIELDS: dict[str, type] = {
    **_COMMON_SECURITY, "fsGroup": int, "fsGroupChangePolicy": str,
    "supplementalGroups": list, "supplementalGroupsPolicy": str, "sysctls": list,
    "seLinuxChangePolicy": str,
}
CONTAINER_SECURITY_FIELDS: dict[str, type] = {
    **_COMMON_SECURITY, "allowPrivilegeEscalation": bool, "readOnlyRootFilesystem": bool,
    "privileged": bool, "capabilities": Mapping, "procMount": str,
}


@dataclass(frozen=True)
class BatchRunSpec:
    name: str
    namespace: str
    tenant: str
    batch_id: str | None
    tasks: tuple[TaskSpec, ...] | None  # None: source external, generator or configMap
    workers: int = 1
    concurrency: int = 1
    batch_size: int = 1
    visibility_timeout: int = 600
    heartbeat: float = 200.0
    max_attempts: int = 8
    backoff_base: float = 1.0
    backoff_cap: float = 3600.0
    active_deadline: int | None = None
    handler: str | None = None
    command: tuple[str, ...] | None = None
    template: Mapping[str, Any] = field(default_factory=dict)
    database: Mapping[str, Any] = field(default_factory=dict)
    suspend: bool = False
    reduce: ReduceSpec | None = None  # runs once after every task (jobrunner/features/reduce.py)
    # Flow control (docs/flow-control.md): the limits and token estimate of every task
    # enqueued from the spec, and the batch's budget (None: no budget of that kind).
    limits: tuple[str, ...] | None = None
    tokens: int | None = None
    budget_tokens: int | None = None
    budget_cost: Decimal | None = None
    # source.generator: the tasks come from user code run as a task
    # (jobrunner/features/generators.py)
    generator: GeneratorSpec | None = None
    # source.configMap (name, key): read by the controller when it enqueues
    config_map: tuple[str, str] | None = None
    # spec.pool: a WorkerPool of the run's namespace serves it (no Job); docs/pools.md
    pool: str | None = None
    priority: int = 0
    # Kueue (docs/kueue.md): the LocalQueue that admits the run's Job, its
    # WorkloadPriorityClass, and the fewest workers it may be admitted with.
    queue_name: str | None = None
    priority_class: str | None = None
    min_workers: int | None = None

    def effective_deadline(self) -> int:
        """The Job's activeDeadlineSeconds: the user's, or a safe default that outlives any
        lease by a wide margin (pods killed while holding leases only delay tasks)."""
        if self.active_deadline is not None:
            return self.active_deadline
        return max(86400, 3 * self.visibility_timeout + DEADLINE_BUFFER_SECONDS)

    def worker_args(self) -> list[str]:
        """The `jobrunner worker` options (apart from --batch and the DSN) for this run."""
        args = ["--concurrency", str(self.concurrency), "--batch-size", str(self.batch_size),
                "--visibility-timeout", f"{self.visibility_timeout:g}",
                "--heartbeat", f"{self.heartbeat:g}",
                "--backoff-base", f"{self.backoff_base:g}",
                "--backoff-cap", f"{self.backoff_cap:g}"]
        if self.handler:
            args += ["--handler", self.handler]
        if self.command:
            import shlex

            args += ["--handler-cmd", shlex.join(self.command)]
        return args


def load_manifest(path: str | Path) -> BatchRunSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadInput(f"cannot read manifest {path}: {exc.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML: {exc}") from None
    runs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(runs) != 1:
        raise BadInput(f"{path}: expected exactly one {KIND} document, found {len(runs)}")
    config_maps = {d["metadata"]["name"]: d for d in docs
                   if isinstance(d, dict) and d.get("kind") == "ConfigMap"
                   and isinstance(d.get("metadata"), dict) and d["metadata"].get("name")}
    return parse_batchrun(runs[0], source=str(path), base_dir=path.resolve().parent,
                          config_maps=config_maps)


def _int(spec: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int,
         where: str) -> int | None:
    value = spec.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{where}: spec.{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise BadInput(f"{where}: spec.{name} must be between {lo} and {hi}, got {value}")
    return value


def _number(spec: Mapping[str, Any], name: str, default: float | None, lo: float, hi: float,
            where: str) -> float | None:
    value = spec.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadInput(f"{where}: spec.{name} must be a number, got {value!r}")
    if not lo < value <= hi:
        raise BadInput(f"{where}: spec.{name} must be greater than {lo:g} and at most {hi:g}, "
                       f"got {value:g}")
    return float(value)


def parse_batchrun(obj: Mapping[str, Any], source: str = "manifest", *,
                   base_dir: Path | None = None,
                   config_maps: Mapping[str, Mapping[str, Any]] | None = None) -> BatchRunSpec:
    """A BatchRun. `base_dir` (a manifest file's folder) and `config_maps` (the
    ConfigMaps of its file) are given by `jobrunner run` only: with them, source.file and
    source.configMap become tasks here; on a cluster the controller reads the ConfigMap."""
    if obj.get("apiVersion") != API_VERSION:
        raise BadInput(f"{source}: apiVersion must be {API_VERSION}, got {obj.get('apiVersion')!r}")
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise BadInput(f"{source}: metadata.name is required")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise BadInput(f"{source}: spec is required and must be a mapping")
    unknown = set(spec) - SPEC_FIELDS
    if unknown:
        raise BadInput(f"{source}: unknown field(s) in spec: {', '.join(sorted(unknown))}")
    where = f"{source} ({KIND} {name})"

    if "tenant" not in spec:
        raise BadInput(f"{where}: spec.tenant is required")
    tenant = check_identifier(spec["tenant"], f"{where}: spec.tenant")
    batch_id = spec.get("batchId")
    if batch_id is not None:
        check_identifier(batch_id, f"{where}: spec.batchId")

    sources = [k for k in ("shards", "shardRange", "source") if k in spec]
    if len(sources) != 1:
        raise BadInput(f"{where}: exactly one of spec.shards, spec.shardRange or spec.source "
                       f"must be set (found {', '.join(sources) or 'none'})")
    max_attempts = _int(spec, "maxAttempts", 8, 1, MAX_ATTEMPTS_LIMIT, where) or 8
    generator = config_map = None
    if sources[0] == "source":
        tasks, generator, config_map = _source(spec["source"], where, max_attempts, base_dir,
                                               config_maps)
    else:
        tasks = _tasks(spec, sources[0], where)

    vis = _int(spec, "visibilityTimeoutSeconds", 600, 1, 7 * 86400, where)
    assert vis is not None
    heartbeat = _number(spec, "heartbeatSeconds", vis / 3, 0, vis, where)
    assert heartbeat is not None
    if not heartbeat < vis / 2:
        raise BadInput(f"{where}: spec.heartbeatSeconds ({heartbeat:g}) must be less than half "
                       f"of spec.visibilityTimeoutSeconds ({vis})")
    deadline = _int(spec, "activeDeadlineSeconds", None, 1, 30 * 86400, where)
    if deadline is not None and deadline <= vis + DEADLINE_BUFFER_SECONDS:
        raise BadInput(f"{where}: spec.activeDeadlineSeconds ({deadline}) must be greater than "
                       f"spec.visibilityTimeoutSeconds + {DEADLINE_BUFFER_SECONDS} "
                       f"({vis + DEADLINE_BUFFER_SECONDS}): pods killed by the deadline while "
                       "they hold leases would delay their tasks by a whole lease")
    base = _number(spec, "backoffBaseSeconds", 1.0, 0, 3600, where)
    cap = _number(spec, "backoffCapSeconds", 3600.0, 0, 7 * 86400, where)
    assert base is not None and cap is not None
    if cap < base:
        raise BadInput(f"{where}: spec.backoffCapSeconds must be at least spec.backoffBaseSeconds")

    handler = spec.get("handler")
    command = spec.get("command")
    if (handler is None) == (command is None):
        raise BadInput(f"{where}: exactly one of spec.handler (module:function) or "
                       "spec.command must be set")
    if handler is not None and (not isinstance(handler, str) or ":" not in handler):
        raise BadInput(f"{where}: spec.handler must look like 'package.module:function'")
    if command is not None:
        if isinstance(command, str):
            command = ["/bin/sh", "-c", command]
        if not isinstance(command, list) or not command or not all(
                isinstance(c, str) for c in command):
            raise BadInput(f"{where}: spec.command must be a non-empty list of strings")

    template = parse_template(spec.get("template"), where)
    database = spec.get("database") or {}
    if not isinstance(database, Mapping):
        raise BadInput(f"{where}: spec.database must be a mapping")
    suspend = spec.get("suspend", False)
    if not isinstance(suspend, bool):
        raise BadInput(f"{where}: spec.suspend must be true or false")
    limits, tokens, budget_tokens, budget_cost = _flow_control(spec, where)
    if generator is not None and (limits or tokens):
        # the generator's tasks take the run's defaults, like those of shards and files
        generator = replace(generator, limits=limits, tokens=tokens)

    pool, priority = _pool(spec, where, generator=generator, command=command,
                           suspend=suspend)
    workers = _int(spec, "workers", 1, 1, 1000, where) or 1
    queue_name, priority_class, min_workers = _kueue(spec, where, pool=pool, workers=workers)
    return BatchRunSpec(
        name=name, namespace=meta.get("namespace") or "default", tenant=tenant,
        batch_id=batch_id, tasks=tasks,
        workers=workers,
        concurrency=_int(spec, "concurrency", 1, 1, 100, where) or 1,
        batch_size=_int(spec, "batchSize", 1, 1, 1000, where) or 1,
        visibility_timeout=vis, heartbeat=heartbeat,
        max_attempts=max_attempts,
        backoff_base=base, backoff_cap=cap, active_deadline=deadline,
        handler=handler, command=tuple(command) if command else None,
        template=template, database=database, suspend=suspend,
        reduce=parse_reduce(spec.get("reduce"), where, max_attempts),
        limits=limits, tokens=tokens, budget_tokens=budget_tokens, budget_cost=budget_cost,
        generator=generator, config_map=config_map, pool=pool, priority=priority,
        queue_name=queue_name, priority_class=priority_class, min_workers=min_workers)


_POOL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _pool(spec: Mapping[str, Any], where: str, *, generator: Any, command: Any, suspend: bool
          ) -> tuple[str | None, int]:
    """spec.pool and spec.priority, with the CRD's rules: what a pool cannot serve yet is
    refused here rather than enqueued where no worker would ever claim it."""
    pool = spec.get("pool")
    priority = _int(spec, "priority", 0, -3, 3, where)
    assert priority is not None
    if pool is None:
        if "priority" in spec and priority != 0:
            raise BadInput(f"{where}: spec.priority applies to a run in a pool: set spec.pool")
        return None, 0
    if not isinstance(pool, str) or len(pool) > 253 or not _POOL_NAME.match(pool):
        raise BadInput(f"{where}: spec.pool must be the name of a WorkerPool (a DNS subdomain), "
                       f"got {pool!r}")
    if generator is not None:
        raise BadInput(f"{where}: spec.pool: a generator source cannot run in a pool yet; "
                       "docs/pools.md")
    if command is not None:
        raise BadInput(f"{where}: spec.pool: a pool runs a Python handler (its WorkerPool's "
                       "spec.handler); spec.command is not served by pools")
    if suspend:
        raise BadInput(f"{where}: spec.pool: suspend does not apply to a pool's run (its "
                       "workers serve the whole pool); scale the WorkerPool instead")
    if spec.get("template"):
        raise BadInput(f"{where}: spec.pool: the pool's workers have the WorkerPool's "
                       "spec.template; a run in a pool takes none")
    return pool, priority


# A LocalQueue's or WorkloadPriorityClass's name goes into a label value: a DNS
# subdomain that also fits a label's 63 characters.
_LABEL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")


def _kueue(spec: Mapping[str, Any], where: str, *, pool: str | None, workers: int
           ) -> tuple[str | None, str | None, int | None]:
    """spec.queueName, spec.priorityClassName and spec.minWorkers (docs/kueue.md), checked
    as the CRD and Kueue's own webhook check them, so a bad value fails the run here rather
    than as a Job the API server refuses."""
    queue, klass = spec.get("queueName"), spec.get("priorityClassName")
    for name, value in (("queueName", queue), ("priorityClassName", klass)):
        if value is not None and (not isinstance(value, str) or not _LABEL_NAME.match(value)):
            raise BadInput(f"{where}: spec.{name} must be a Kueue object's name (a DNS "
                           f"subdomain of at most 63 characters), got {value!r}")
    min_workers = _int(spec, "minWorkers", None, 1, 1000, where)
    if queue is None:
        for name in ("priorityClassName", "minWorkers"):
            if spec.get(name) is not None:
                raise BadInput(f"{where}: spec.{name} applies to a run admitted by Kueue: "
                               "set spec.queueName")
        return None, None, None
    if pool is not None:
        raise BadInput(f"{where}: spec.queueName: a run in a pool has no Job of its own; "
                       "set the WorkerPool's spec.queueName instead")
    if min_workers is not None and min_workers >= workers:
        raise BadInput(f"{where}: spec.minWorkers ({min_workers}) must be less than "
                       f"spec.workers ({workers}): it is the fewest workers Kueue may admit "
                       "the run with")
    return queue, klass, min_workers


def _flow_control(spec: Mapping[str, Any], where: str
                  ) -> tuple[tuple[str, ...] | None, int | None, int | None, Decimal | None]:
    """spec.limits, spec.tokens and spec.budget, checked as the CRD checks them."""
    limits = spec.get("limits")
    if limits is not None:
        if not isinstance(limits, list) or not limits:
            raise BadInput(f"{where}: spec.limits must be a non-empty list of limit names")
        if len(set(limits)) != len(limits):
            raise BadInput(f"{where}: spec.limits names a limit twice")
        limits = check_limit_names(limits, f"{where}: spec.limits")
    if limits is not None and _external(spec):
        raise BadInput(f"{where}: spec.limits and spec.tokens apply to the tasks the run "
                       "enqueues; with source: external, name them in the tasks you enqueue")
    tokens = _int(spec, "tokens", None, 1, MAX_TOKENS, where)
    if tokens is not None and _external(spec):
        raise BadInput(f"{where}: spec.limits and spec.tokens apply to the tasks the run "
                       "enqueues; with source: external, name them in the tasks you enqueue")
    budget = spec.get("budget")
    if budget is None:
        return limits, tokens, None, None
    if not isinstance(budget, Mapping) or not budget:
        raise BadInput(f"{where}: spec.budget must be a mapping with tokens and/or cost")
    unknown = set(budget) - BUDGET_FIELDS
    if unknown:
        raise BadInput(f"{where}: unknown field(s) in spec.budget: {', '.join(sorted(unknown))}")
    budget_tokens = budget.get("tokens")
    if budget_tokens is not None and (isinstance(budget_tokens, bool) or not isinstance(
            budget_tokens, int) or not 1 <= budget_tokens <= MAX_TOKENS):
        raise BadInput(f"{where}: spec.budget.tokens must be a whole number between 1 and "
                       f"{MAX_TOKENS}, got {budget_tokens!r}")
    cost = budget.get("cost")
    budget_cost = None
    if cost is not None:
        if not isinstance(cost, str) or not COST_PATTERN.match(cost):
            raise BadInput(f"{where}: spec.budget.cost must be a decimal number in quotes, "
                           f"such as \"12.50\", got {cost!r}")
        budget_cost = Decimal(cost)
        if budget_cost <= 0:
            raise BadInput(f"{where}: spec.budget.cost must be greater than 0, got {cost!r}")
    return limits, tokens, budget_tokens, budget_cost


SOURCE_KINDS = ("external", "generator", "configMap", "file")


def _external(spec: Mapping[str, Any]) -> bool:
    """Whether the run's tasks are enqueued by someone else (source: external)."""
    raw = spec.get("source")
    return raw == "external" or (isinstance(raw, Mapping) and "external" in raw)


def _source(raw: Any, where: str, max_attempts: int, base_dir: Path | None,
            config_maps: Mapping[str, Mapping[str, Any]] | None
            ) -> tuple[tuple[TaskSpec, ...] | None, GeneratorSpec | None, tuple[str, str] | None]:
    """spec.source: exactly one of external, generator, configMap, file. Returns (tasks,
    generator, configMap reference); `source: external` (a string) is the older form."""
    if raw == "external":
        return None, None, None
    if not isinstance(raw, Mapping):
        raise BadInput(f"{where}: spec.source must be a mapping with one of "
                       f"{', '.join(SOURCE_KINDS)}, got {_json_type(raw)}")
    kinds = [k for k in raw if k in SOURCE_KINDS]
    unknown = set(raw) - set(SOURCE_KINDS)
    if unknown:
        raise BadInput(f"{where}: spec.source: unknown field(s) "
                       f"{', '.join(sorted(map(str, unknown)))} ({', '.join(SOURCE_KINDS)})")
    if len(kinds) != 1:
        raise BadInput(f"{where}: spec.source must set exactly one of "
                       f"{', '.join(SOURCE_KINDS)} (found {', '.join(kinds) or 'none'})")
    kind, value = kinds[0], raw[kinds[0]]
    if kind == "external":
        if value not in (None, {}) and value is not True:
            raise BadInput(f"{where}: spec.source.external takes no fields: write "
                           "`external: {}`")
        return None, None, None
    if kind == "generator":
        return None, parse_generator(value, where, max_attempts), None
    if kind == "file":
        return file_tasks(value, where, base_dir), None, None
    name, key = parse_config_map_ref(value, where)
    if config_maps is None:
        return None, None, (name, key)  # the controller reads it
    found = config_maps.get(name)
    if found is None:
        raise BadInput(f"{where}: spec.source.configMap: no ConfigMap {name!r} in the "
                       "manifest's file (`jobrunner run` reads it from there; or use "
                       "source.file)")
    return config_map_tasks(found, name, key, where), None, None


def _tasks(spec: Mapping[str, Any], kind: str, where: str) -> tuple[TaskSpec, ...]:
    if kind == "shards":
        shards = spec["shards"]
        if not isinstance(shards, list) or not shards:
            raise BadInput(f"{where}: spec.shards must be a non-empty list")
        tasks: list[TaskSpec] = []
        seen: set[str] = set()
        for i, item in enumerate(shards):
            at = f"{where}: spec.shards[{i}]"
            if not isinstance(item, Mapping):
                raise BadInput(f"{at} must be a mapping with key, shardKey and payload")
            extra = set(item) - {"key", "shardKey", "payload", "maxAttempts"}
            if extra:
                raise BadInput(f"{at}: unknown field(s) {', '.join(sorted(extra))}")
            key = check_identifier(item.get("key"), f"{at}.key", max_chars=512)
            if key in seen:
                raise BadInput(f"{at}.key {key!r} is used twice")
            seen.add(key)
            shard = item.get("shardKey")
            if shard is not None:
                shard = check_identifier(shard, f"{at}.shardKey", allow_empty=True) or None
            payload = item.get("payload", {})
            encode_payload(payload, f"{at}.payload")
            attempts = item.get("maxAttempts")
            tasks.append(TaskSpec(key=key, payload=payload, shard_key=shard,
                                  max_attempts=attempts))
        return tuple(tasks)
    shard_range = spec["shardRange"]
    if not isinstance(shard_range, Mapping):
        raise BadInput(f"{where}: spec.shardRange must be a mapping with count")
    count = _int(shard_range, "count", None, 1, MAX_SHARD_RANGE, f"{where}: shardRange")
    if count is None:
        raise BadInput(f"{where}: spec.shardRange.count is required")
    prefix = shard_range.get("keyPrefix", "shard-")
    check_identifier(prefix, f"{where}: spec.shardRange.keyPrefix", allow_empty=True)
    base_payload = shard_range.get("payload", {})
    encode_payload(base_payload, f"{where}: spec.shardRange.payload")
    width = len(str(count - 1))
    return tuple(TaskSpec(key=f"{prefix}{i:0{width}d}", payload={**base_payload, "index": i})
                 for i in range(count))


# ------------------------------------------------------------------------------ template
def parse_template(raw: Any, where: str) -> dict[str, Any]:
    """spec.template, checked field by field; null fields are dropped (as the API server
    drops them). What jobrunner relies on, and the mistakes that would otherwise surface
    only as a Job the API server refuses, are checked here; the rest of each nested
    Kubernetes object (a volume's source, an affinity term, a sidecar's probes) passes
    through for the API server to validate."""
    if raw is None:
        return {}
    at = f"{where}: spec.template"
    if not isinstance(raw, Mapping):
        raise BadInput(f"{at} must be a mapping, got {_json_type(raw)}")
    template = {k: v for k, v in raw.items() if v is not None}
    unknown = set(template) - TEMPLATE_FIELDS
    if unknown:
        raise BadInput(f"{at}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")

    for name in ("image", "serviceAccountName"):  # "" means the controller's default
        _typed(template, name, str, at)
    for name in ("priorityClassName", "runtimeClassName"):
        if name in template:
            _non_empty(template[name], f"{at}.{name}", 253)
    _choice(template, "imagePullPolicy", PULL_POLICIES, at)
    _choice(template, "dnsPolicy", DNS_POLICIES, at)
    _typed(template, "hostNetwork", bool, at)
    grace = template.get("terminationGracePeriodSeconds")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int)
                              or not 1 <= grace <= 86400):
        raise BadInput(f"{at}.terminationGracePeriodSeconds must be an integer from 1 to "
                       f"86400, got {grace!r}")
    _typed(template, "resources", Mapping, at)
    for name in ("nodeSelector", "labels", "annotations"):
        _string_map(template, name, at)
    for i, item in enumerate(_objects(template, "env", at, ("name",))):
        _non_empty(item["name"], f"{at}.env[{i}].name")
    _objects(template, "envFrom", at)
    _objects(template, "tolerations", at)
    for i, item in enumerate(_objects(template, "imagePullSecrets", at, ("name",))):
        _non_empty(item["name"], f"{at}.imagePullSecrets[{i}].name", 253)
    spread = _objects(template, "topologySpreadConstraints", at,
                      ("maxSkew", "topologyKey", "whenUnsatisfiable"))
    for i, item in enumerate(spread):
        item_at = f"{at}.topologySpreadConstraints[{i}]"
        skew = item["maxSkew"]
        if isinstance(skew, bool) or not isinstance(skew, int) or skew < 1:
            raise BadInput(f"{item_at}.maxSkew must be an integer of at least 1, "
                           f"got {_json_type(skew)}")
        _non_empty(item["topologyKey"], f"{item_at}.topologyKey")
        _choice(item, "whenUnsatisfiable", WHEN_UNSATISFIABLE, item_at)
    _affinity(template, at)

    volumes = _objects(template, "volumes", at, ("name",))
    volume_names = _unique_names(volumes, f"{at}.volumes") | {TMP_VOLUME}
    _mounts(template.get("volumeMounts"), f"{at}.volumeMounts", volume_names, worker=True)
    if "securityContext" in template:
        _security(template["securityContext"], f"{at}.securityContext", POD_SECURITY_FIELDS,
                  CONTAINER_SECURITY_FIELDS,
                  "a container field: for the worker set it in spec.template."
                  "containerSecurityContext")
    if "containerSecurityContext" in template:
        _security(template["containerSecurityContext"], f"{at}.containerSecurityContext",
                  CONTAINER_SECURITY_FIELDS, POD_SECURITY_FIELDS,
                  "a pod-level field: set it in spec.template.securityContext")

    seen = {WORKER_CONTAINER}
    for list_name in ("initContainers", "containers"):
        for i, item in enumerate(_objects(template, list_name, at, ("name", "image"))):
            _container(item, f"{at}.{list_name}[{i}]", seen, volume_names,
                       init=list_name == "initContainers")
    return template


def _container(item: Mapping[str, Any], at: str, seen: set[str], volume_names: set[str],
               *, init: bool) -> None:
    name = _dns_label(item["name"], f"{at}.name")
    if name == WORKER_CONTAINER:
        raise BadInput(f"{at}.name: {WORKER_CONTAINER!r} is the name of jobrunner's own "
                       "container; give this one another name")
    if name in seen:
        raise BadInput(f"{at}.name {name!r} is used twice (container names must be unique "
                       "across spec.template.containers and spec.template.initContainers)")
    seen.add(name)
    _non_empty(item["image"], f"{at}.image")
    if init:
        # Kubernetes allows only Always here: a native sidecar (1.29+).
        _choice(item, "restartPolicy", ("Always",), at)
    for key in ("env", "envFrom", "ports", "args", "command"):
        if item.get(key) is not None and not isinstance(item[key], list):
            raise BadInput(f"{at}.{key} must be a list, got {_json_type(item[key])}")
    _mounts(item.get("volumeMounts"), f"{at}.volumeMounts", volume_names, worker=False)
    if item.get("securityContext") is not None:
        _security(item["securityContext"], f"{at}.securityContext", CONTAINER_SECURITY_FIELDS,
                  POD_SECURITY_FIELDS,
                  "a pod-level field: set it in spec.template.securityContext")


def _mounts(value: Any, at: str, volume_names: set[str], *, worker: bool) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise BadInput(f"{at} must be a list, got {_json_type(value)}")
    if len(value) > LIST_LIMITS["volumeMounts"]:
        raise BadInput(f"{at} has {len(value)} items; the limit is {LIST_LIMITS['volumeMounts']}")
    paths: set[str] = set()
    for i, mount in enumerate(value):
        item_at = f"{at}[{i}]"
        if not isinstance(mount, Mapping):
            raise BadInput(f"{item_at} must be a mapping with name and mountPath, "
                           f"got {_json_type(mount)}")
        for key in ("name", "mountPath"):
            if key not in mount:
                raise BadInput(f"{item_at}.{key} is required")
        name = _non_empty(mount["name"], f"{item_at}.name")
        path = _non_empty(mount["mountPath"], f"{item_at}.mountPath", 1024)
        if name not in volume_names:
            raise BadInput(f"{item_at}.name {name!r} is not a volume: define it in "
                           "spec.template.volumes")
        if not path.startswith("/"):
            raise BadInput(f"{item_at}.mountPath must be an absolute path, got {path!r}")
        normal = path.rstrip("/") or "/"
        if worker and normal == TMP_PATH:
            raise BadInput(f"{item_at}.mountPath: {TMP_PATH} is the worker's scratch "
                           f"directory (volume {TMP_VOLUME!r}, always mounted); to change what "
                           f"backs it, define a volume named {TMP_VOLUME!r} in "
                           "spec.template.volumes")
        if normal in paths:
            raise BadInput(f"{item_at}.mountPath {path!r} is mounted twice")
        paths.add(normal)


def _security(value: Any, at: str, fields: Mapping[str, type], other: Mapping[str, type],
              other_hint: str) -> None:
    if not isinstance(value, Mapping):
        raise BadInput(f"{at} must be a mapping, got {_json_type(value)}")
    for key, item in value.items():
        if key not in fields:
            if key in other:
                raise BadInput(f"{at}.{key} is {other_hint}")
            raise BadInput(f"{at}: unknown field {key!r} (Kubernetes' fields here: "
                           f"{', '.join(sorted(fields))})")
        if item is not None:  # null drops one of the defaults
            _check_type(item, fields[key], f"{at}.{key}")
    capabilities = value.get("capabilities")
    if isinstance(capabilities, Mapping):
        for key, item in capabilities.items():
            if key not in ("add", "drop"):
                raise BadInput(f"{at}.capabilities: unknown field {key!r} (add, drop)")
            if item is not None and not (isinstance(item, list)
                                         and all(isinstance(c, str) for c in item)):
                raise BadInput(f"{at}.capabilities.{key} must be a list of capability names, "
                               f"got {_json_type(item)}")
    seccomp = value.get("seccompProfile")
    if isinstance(seccomp, Mapping) and not isinstance(seccomp.get("type"), str | None):
        raise BadInput(f"{at}.seccompProfile.type must be a string, "
                       f"got {_json_type(seccomp['type'])}")


def _affinity(template: Mapping[str, Any], at: str) -> None:
    affinity = template.get("affinity")
    if affinity is None:
        return
    if not isinstance(affinity, Mapping):
        raise BadInput(f"{at}.affinity must be a mapping, got {_json_type(affinity)}")
    unknown = set(affinity) - AFFINITY_FIELDS
    if unknown:
        raise BadInput(f"{at}.affinity: unknown field(s) {', '.join(sorted(map(str, unknown)))} "
                       f"(Kubernetes' fields here: {', '.join(sorted(AFFINITY_FIELDS))})")
    for key, item in affinity.items():
        if item is not None and not isinstance(item, Mapping):
            raise BadInput(f"{at}.affinity.{key} must be a mapping, got {_json_type(item)}")


def _objects(template: Mapping[str, Any], name: str, at: str,
             required: tuple[str, ...] = ()) -> list[Mapping[str, Any]]:
    """A list of mappings, each with the required keys."""
    value = template.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadInput(f"{at}.{name} must be a list, got {_json_type(value)}")
    limit = LIST_LIMITS.get(name)
    if limit is not None and len(value) > limit:
        raise BadInput(f"{at}.{name} has {len(value)} items; the limit is {limit}")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise BadInput(f"{at}.{name}[{i}] must be a mapping, got {_json_type(item)}")
        for key in required:
            if item.get(key) is None:
                raise BadInput(f"{at}.{name}[{i}].{key} is required")
    return value


def _unique_names(items: list[Mapping[str, Any]], at: str) -> set[str]:
    names: set[str] = set()
    for i, item in enumerate(items):
        name = _dns_label(item["name"], f"{at}[{i}].name")
        if name in names:
            raise BadInput(f"{at}[{i}].name {name!r} is used twice")
        names.add(name)
    return names


def _dns_label(value: Any, at: str) -> str:
    value = _non_empty(value, at, 63)
    if not _DNS_LABEL.fullmatch(value):
        raise BadInput(f"{at} {value!r} must be a DNS label: lower-case letters, digits and "
                       "'-', starting and ending with a letter or digit")
    return value


def _non_empty(value: Any, at: str, max_chars: int = 4096) -> str:
    if not isinstance(value, str) or not value:
        raise BadInput(f"{at} must be a non-empty string, got {_json_type(value)}")
    if len(value) > max_chars:
        raise BadInput(f"{at} is {len(value)} characters long; the limit is {max_chars}")
    return value


def _typed(template: Mapping[str, Any], name: str, kind: type, at: str) -> None:
    if name in template:
        _check_type(template[name], kind, f"{at}.{name}")


def _check_type(value: Any, kind: type, at: str) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, int) if kind is int
          else isinstance(value, kind))
    if not ok:
        raise BadInput(f"{at} must be {_EXPECTED[kind]}, got {_json_type(value)}")


def _choice(obj: Mapping[str, Any], name: str, choices: tuple[str, ...], at: str) -> None:
    if obj.get(name) is not None and obj[name] not in choices:
        raise BadInput(f"{at}.{name} must be one of {', '.join(choices)}, "
                       f"got {_json_type(obj[name])}")


def _string_map(template: Mapping[str, Any], name: str, at: str) -> None:
    value = template.get(name)
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise BadInput(f"{at}.{name} must be a mapping of strings, got {_json_type(value)}")
    for key, item in value.items():
        if not isinstance(key, str):
            raise BadInput(f"{at}.{name}: key {key!r} must be a string (quote it in YAML)")
        if not isinstance(item, str):
            # Typically an unquoted YAML number or boolean: `version: 1.0`, `enabled: true`.
            raise BadInput(f"{at}.{name}.{key} must be a string (quote it in YAML), "
                           f"got {_json_type(item)}")


_EXPECTED = {bool: "true or false", int: "an integer", str: "a string", list: "a list",
             Mapping: "a mapping"}


def _json_type(value: Any) -> str:
    """What a YAML/JSON value is, as a user reads it in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:80]!r}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__
