"""Worker pods that cannot start: say so at once, and fail the run if it lasts.

A Job whose pods can never start (an image that is not there, a template the kubelet
refuses, such as a root UID under runAsNonRoot) stays active until its deadline: the Job
controller only counts pods that ran and failed. So the BatchRun would say Running for a
day. Here the controller reads its Job's pods on every refresh; a container waiting for a
reason that does not heal by itself sets the ``WorkersHealthy`` condition to False (with
the kubelet's own reason and message) and posts a Warning Event right away; when no
worker has run for ``JOBRUNNER_POD_START_TIMEOUT_SECONDS`` (default 30) while it lasts,
the run fails with that reason. Its unfinished tasks stay in the queue.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any

from jobrunner.operator.kube import ApiError, list_pods

# Waiting reasons of the kubelet that retrying the same pod does not cure.
STUCK_REASONS = frozenset({
    "ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})
NEVER_RAN = frozenset({"StartError", "ContainerCannotRun"})
START_TIMEOUT = float(os.environ.get("JOBRUNNER_POD_START_TIMEOUT_SECONDS", "30"))


@dataclass(frozen=True)
class PodProblem:
    pod: str
    container: str
    reason: str
    message: str

    def describe(self) -> str:
        text = f"worker pod {self.pod} cannot start container {self.container}: {self.reason}"
        return f"{text}: {self.message}" if self.message else text


@dataclass(frozen=True)
class PodHealth:
    problem: PodProblem | None
    any_started: bool  # a worker container is running or has run


def classify(pods: list[dict[str, Any]]) -> PodHealth:
    """The first stuck container of the Job's pods (oldest pod first), and whether any
    worker got as far as running. Pods are the API's JSON."""
    problem: PodProblem | None = None
    started = False
    for pod in sorted(pods, key=_created):
        status = pod.get("status") or {}
        statuses = [*(status.get("initContainerStatuses") or []),
                    *(status.get("containerStatuses") or [])]
        for cs in statuses:
            state = cs.get("state") or {}
            if _ran(state) or _ran(cs.get("lastState")):
                started = True
            waiting = state.get("waiting")
            if waiting and waiting.get("reason") in STUCK_REASONS and problem is None:
                problem = PodProblem(pod["metadata"]["name"], cs.get("name", ""),
                                     waiting["reason"],
                                     (waiting.get("message") or "").strip()[:400])
    return PodHealth(problem, started)


_EPOCH = dt.datetime.min.replace(tzinfo=dt.UTC)


def _created(pod: dict[str, Any]) -> dt.datetime:
    stamp = (pod.get("metadata") or {}).get("creationTimestamp")
    return parse_time(stamp) if stamp else _EPOCH


def parse_time(stamp: str) -> dt.datetime:
    """An RFC 3339 timestamp of the API (``2026-01-01T00:00:00Z``), timezone-aware."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _ran(state: dict[str, Any] | None) -> bool:
    if not state:
        return False
    if state.get("running") is not None:
        return True
    # A container the runtime could not even start (bad command) never ran.
    terminated = state.get("terminated")
    return terminated is not None and terminated.get("reason") not in NEVER_RAN


def job_pods(namespace: str, job_name: str) -> list[dict[str, Any]] | None:
    """The Job's pods, or None when they cannot be read (no verdict this time)."""
    try:
        return list_pods(namespace, f"job-name={job_name}")
    except ApiError:
        return None


def stuck_for(condition: dict[str, Any] | None, now: dt.datetime) -> float:
    """Seconds the WorkersHealthy condition has been False (0 when it is not)."""
    if not condition or condition.get("status") != "False":
        return 0.0
    since = parse_time(condition["lastTransitionTime"])
    return (now - since).total_seconds()
