"""A BatchRun's source.configMap, read by the controller when it enqueues the run.

Read once, at the first enqueue: later edits of the ConfigMap change nothing (the batch's
tasks are in the database by then; the enqueue is keyed, so reading it again would add
only new keys, which is not what re-applying a run should do)."""

from __future__ import annotations

from jobrunner.features.manifest import BatchRunSpec
from jobrunner.features.sources import config_map_tasks
from jobrunner.model.validation import TaskSpec
from jobrunner.operator.kube import ApiError, read_config_map


class SourceUnavailable(Exception):
    """The ConfigMap cannot be read now (not there yet, forbidden): wait and retry.
    `reason` is CamelCase for a condition."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def config_map_source(namespace: str, run: BatchRunSpec, where: str) -> tuple[TaskSpec, ...]:
    """The run's tasks from its ConfigMap; BadInput (with the line) if any line is bad."""
    assert run.config_map is not None
    name, key = run.config_map
    try:
        obj = read_config_map(namespace, name)
    except ApiError as exc:
        if exc.status == 404:
            raise SourceUnavailable("ConfigMapNotFound", f"ConfigMap {namespace}/{name} "
                                    "(spec.source.configMap) does not exist yet") from None
        if exc.status == 403:
            raise SourceUnavailable("ConfigMapForbidden", f"the controller may not read "
                                    f"ConfigMap {namespace}/{name}: grant it configmaps get "
                                    "(the chart's RBAC does)") from None
        raise SourceUnavailable("ConfigMapUnreadable", f"reading ConfigMap {namespace}/{name}: "
                                f"HTTP {exc.status}") from None
    plain = {"data": dict(obj.get("data") or {}), "binaryData": dict(obj.get("binaryData") or {})}
    return config_map_tasks(plain, f"{namespace}/{name}", key, where)
