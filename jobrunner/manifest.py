"""The BatchRun spec: one definition read by `jobrunner run` and by the operator.

The CRD (crds/batchrun.yaml) enforces the same rules at `kubectl apply` time; this
module applies them to a manifest file read locally, with the same messages where it
can, and turns the spec into task specs and worker settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import BadInput
from .validation import (
    MAX_ATTEMPTS_LIMIT,
    TaskSpec,
    check_identifier,
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
    "command", "template", "database", "suspend",
}


@dataclass(frozen=True)
class BatchRunSpec:
    name: str
    namespace: str
    tenant: str
    batch_id: str | None
    tasks: tuple[TaskSpec, ...] | None  # None for source: external
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
    return parse_batchrun(runs[0], source=str(path))


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


def parse_batchrun(obj: Mapping[str, Any], source: str = "manifest") -> BatchRunSpec:
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

    template = spec.get("template") or {}
    database = spec.get("database") or {}
    if not isinstance(template, Mapping) or not isinstance(database, Mapping):
        raise BadInput(f"{where}: spec.template and spec.database must be mappings")
    suspend = spec.get("suspend", False)
    if not isinstance(suspend, bool):
        raise BadInput(f"{where}: spec.suspend must be true or false")

    return BatchRunSpec(
        name=name, namespace=meta.get("namespace") or "default", tenant=tenant,
        batch_id=batch_id, tasks=tasks,
        workers=_int(spec, "workers", 1, 1, 1000, where) or 1,
        concurrency=_int(spec, "concurrency", 1, 1, 100, where) or 1,
        batch_size=_int(spec, "batchSize", 1, 1, 1000, where) or 1,
        visibility_timeout=vis, heartbeat=heartbeat,
        max_attempts=_int(spec, "maxAttempts", 8, 1, MAX_ATTEMPTS_LIMIT, where) or 8,
        backoff_base=base, backoff_cap=cap, active_deadline=deadline,
        handler=handler, command=tuple(command) if command else None,
        template=template, database=database, suspend=suspend)


def _tasks(spec: Mapping[str, Any], kind: str, where: str) -> tuple[TaskSpec, ...] | None:
    if kind == "source":
        if spec["source"] != "external":
            raise BadInput(f"{where}: spec.source must be 'external', got {spec['source']!r}")
        return None
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
