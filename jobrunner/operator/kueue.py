"""Kueue (docs/kueue.md): a BatchRun's Job admitted by the cluster's quotas.

A run that names ``spec.queueName`` gets Kueue's queue label on its Job, which is created
suspended: from then on Kueue alone suspends and unsuspends it (admission, preemption,
a quota change), sets its parallelism when it admits fewer workers than asked (partial
admission, ``spec.minWorkers``) and injects its flavors' node selectors into the pod
template. The controller never writes ``spec.suspend`` or the pod template of such a Job;
to stop its workers (``spec.suspend``, or pods that can never start) it deactivates the
Job's Workload (``spec.active: false``), Kueue's own way to stop a job.

What the controller reads back is the Workload's conditions, turned here into one
`Admission`: the run's phase while it waits or is preempted, its ``Admitted`` condition
and ``status.admission``. Pure functions, apart from the two API calls at the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from jobrunner.features.manifest import BatchRunSpec
from jobrunner.operator import kube
from jobrunner.operator.kube import ApiError

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
MIN_PARALLELISM_ANNOTATION = "kueue.x-k8s.io/job-min-parallelism"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
GROUP, VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"


_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
# The scheduling gate Kueue's pod webhook puts on a pod it manages until it is admitted.
ADMISSION_GATE = "kueue.x-k8s.io/admission"


def valid_name(value: object) -> bool:
    """A LocalQueue's or WorkloadPriorityClass's name that also fits a label value."""
    return isinstance(value, str) and bool(_NAME.match(value))


def gated(pod: Mapping[str, Any]) -> bool:
    """The pod waits for Kueue's admission."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == ADMISSION_GATE for g in gates)


def with_default_queue(run: BatchRunSpec, namespace: str,
                       defaults: Mapping[str, str]) -> BatchRunSpec:
    """The run with its namespace's default LocalQueue (chart value
    kueue.defaultQueueNames) when it names none and has a Job of its own."""
    queue = defaults.get(namespace)
    if run.queue_name or run.pool is not None or not queue:
        return run
    return replace(run, queue_name=queue)


def job_labels(run: BatchRunSpec) -> dict[str, str]:
    labels: dict[str, str] = {}
    if run.queue_name:
        labels[QUEUE_LABEL] = run.queue_name
        if run.priority_class:
            labels[PRIORITY_CLASS_LABEL] = run.priority_class
    return labels


def job_annotations(run: BatchRunSpec) -> dict[str, str]:
    if run.queue_name and run.min_workers is not None:
        return {MIN_PARALLELISM_ANNOTATION: str(run.min_workers)}
    return {}


def managed(job: Mapping[str, Any]) -> bool:
    """Kueue admits this Job: it carries the queue label (set at creation, immutable)."""
    return QUEUE_LABEL in ((job.get("metadata") or {}).get("labels") or {})


class KueueAbsent(Exception):
    """The cluster serves no Workload API: Kueue is not installed."""


@dataclass(frozen=True)
class Admission:
    """Where Kueue has the run's Workload. `state` is one of Pending (waiting for quota),
    QuotaReserved (admission checks pending), Admitted, Evicted (preempted, deactivated,
    ...: the Job is suspended until re-admitted), Finished, or NoWorkload (Kueue has not
    made it yet)."""

    state: str
    reason: str  # CamelCase: Kueue's own reason where it gives one
    message: str
    workload: str | None = None
    cluster_queue: str | None = None
    admitted_workers: int = 0
    asked_workers: int = 0

    @property
    def admitted(self) -> bool:
        return self.state == "Admitted"

    def condition_status(self) -> bool | None:
        if self.state == "Admitted":
            return True
        return None if self.state in ("NoWorkload", "Finished") else False

    def as_status(self, queue_name: str) -> dict[str, Any]:
        """status.admission of the BatchRun."""
        return {k: v for k, v in {
            "queueName": queue_name, "workload": self.workload,
            "clusterQueue": self.cluster_queue, "state": self.state, "reason": self.reason,
            "message": self.message, "askedWorkers": self.asked_workers,
            "admittedWorkers": self.admitted_workers}.items() if v is not None}


def _condition(workload: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def _true(cond: Mapping[str, Any] | None) -> bool:
    return bool(cond) and cond.get("status") == "True"


def admission(workload: Mapping[str, Any] | None, asked: int) -> Admission:
    """The run's admission from its Workload (None: not created yet)."""
    if workload is None:
        return Admission("NoWorkload", "WorkloadPending",
                         "waiting for Kueue to create the Job's Workload", asked_workers=asked)
    name = (workload.get("metadata") or {}).get("name")
    status = workload.get("status") or {}
    assigned = (status.get("admission") or {})
    cluster_queue = assigned.get("clusterQueue")
    admitted_count = sum(int(p.get("count") or 0)
                         for p in assigned.get("podSetAssignments") or [])
    common = {"workload": name, "cluster_queue": cluster_queue, "asked_workers": asked}
    finished = _condition(workload, "Finished")
    if _true(finished):
        return Admission("Finished", "Finished", _message(finished, "finished"), **common)
    admitted = _condition(workload, "Admitted")
    if _true(admitted):
        partial = (f": {admitted_count} of {asked} worker(s) (partial admission)"
                   if admitted_count < asked else f": {admitted_count} worker(s)")
        return Admission("Admitted", "Admitted",
                         f"Admitted by ClusterQueue {cluster_queue}{partial}",
                         admitted_workers=admitted_count, **common)
    evicted = _condition(workload, "Evicted")
    if _true(evicted):
        # Preempted, Deactivated, PodsReadyTimeout, ClusterQueueStopped, ...: the Job is
        # suspended (its pods release their tasks) until Kueue admits it again.
        reason = evicted.get("reason") or "Evicted"
        preempted = _condition(workload, "Preempted")
        detail = _message(preempted if _true(preempted) else evicted, reason)
        return Admission("Evicted", reason, f"{reason}: {detail}", **common)
    if (workload.get("spec") or {}).get("active") is False:
        return Admission("Evicted", "Deactivated",
                         "Deactivated: the Workload is inactive (spec.active: false)", **common)
    reserved = _condition(workload, "QuotaReserved")
    if _true(reserved):
        return Admission("QuotaReserved", "AdmissionChecksPending",
                         f"quota reserved in ClusterQueue {cluster_queue}; waiting for its "
                         "admission checks", **common)
    reason = (reserved or {}).get("reason") or "Pending"
    return Admission("Pending", reason,
                     f"Pending: {_message(reserved, 'waiting for quota')}", **common)


def _message(cond: Mapping[str, Any] | None, default: str) -> str:
    text = ((cond or {}).get("message") or "").strip()
    return text[:1000] or default


# ------------------------------------------------------------------ the API
def read_workload(namespace: str, job_uid: str) -> dict[str, Any] | None:
    """The Workload Kueue made for the Job (None: none yet). KueueAbsent without the API."""
    try:
        found = kube.list_custom(GROUP, VERSION, namespace, WORKLOADS,
                                 label_selector=f"{JOB_UID_LABEL}={job_uid}")
    except ApiError as exc:
        if exc.status == 404:
            raise KueueAbsent(f"the cluster serves no {GROUP}/{VERSION} Workloads: is Kueue "
                              "installed?") from None
        raise
    items = found.get("items") or []
    # (one per Job; a stale one left by a re-created Job has another uid label)
    return max(items, key=lambda w: w["metadata"].get("creationTimestamp") or "") if items \
        else None


def set_active(namespace: str, name: str, active: bool) -> None:
    """Activate or deactivate a Workload: Kueue suspends a deactivated one's Job and frees
    its quota; activating it queues it again."""
    kube.patch_custom(GROUP, VERSION, namespace, WORKLOADS, name, {"spec": {"active": active}})
