"""Kueue on the BatchRun (docs/kueue.md): the spec fields, the Job they make, and the
admission read from a Workload. The real Kueue runs in tests/e2e/test_kueue_e2e.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobrunner.features.manifest import SPEC_FIELDS, parse_batchrun
from jobrunner.model.errors import BadInput
from jobrunner.operator import kueue
from jobrunner.operator.jobs import build_job

REPO = Path(__file__).resolve().parents[1]


def run_of(**spec: Any):
    return parse_batchrun({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
                           "metadata": {"name": "r", "namespace": "ns"},
                           "spec": {"tenant": "t", "shardRange": {"count": 3},
                                    "handler": "m:f", **spec}})


def job_of(run) -> dict[str, Any]:
    return build_job(run, name="r-abc", namespace="ns", batch_id="b", secret_name="s",
                     secret_key="k")


def test_a_queue_name_labels_the_job_and_creates_it_suspended():
    job = job_of(run_of(queueName="team-a", priorityClassName="high", workers=4,
                        minWorkers=2))
    labels = job["metadata"]["labels"]
    assert labels[kueue.QUEUE_LABEL] == "team-a"
    assert labels[kueue.PRIORITY_CLASS_LABEL] == "high"
    assert job["metadata"]["annotations"] == {kueue.MIN_PARALLELISM_ANNOTATION: "2"}
    assert job["spec"]["suspend"] is True and job["spec"]["parallelism"] == 4
    assert kueue.managed(job)
    # the pods are not labelled: Kueue's Job integration reads the Job's label
    assert kueue.QUEUE_LABEL not in job["spec"]["template"]["metadata"]["labels"]


def test_without_a_queue_nothing_of_kueue_is_on_the_job():
    job = job_of(run_of(workers=2))
    assert not kueue.managed(job)
    assert not any(k.startswith("kueue.x-k8s.io/") for k in job["metadata"]["labels"])
    assert "annotations" not in job["metadata"] and job["spec"]["suspend"] is False


@pytest.mark.parametrize(("spec", "error"), [
    ({"priorityClassName": "high"}, "spec.priorityClassName applies to a run admitted by Kueue"),
    ({"minWorkers": 1, "workers": 3}, "spec.minWorkers applies to a run admitted by Kueue"),
    ({"queueName": "q", "minWorkers": 3, "workers": 3}, "must be less than spec.workers (3)"),
    ({"queueName": "q", "minWorkers": 0, "workers": 3}, "spec.minWorkers must be between 1"),
    ({"queueName": "Team_A"}, "spec.queueName must be a Kueue object's name"),
    ({"queueName": "q" * 64}, "spec.queueName must be a Kueue object's name"),
    ({"queueName": "q", "priorityClassName": 5}, "spec.priorityClassName must be a Kueue"),
])
def test_bad_kueue_fields_are_refused_with_the_reason(spec, error):
    with pytest.raises(BadInput, match=re.escape(error)):
        run_of(**spec)


def test_a_run_in_a_pool_takes_no_queue_name():
    with pytest.raises(BadInput, match=re.escape("set the WorkerPool's spec.queueName")):
        parse_batchrun({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
                        "metadata": {"name": "r"},
                        "spec": {"tenant": "t", "shardRange": {"count": 3},
                                 "handler": "m:f", "pool": "p", "queueName": "q"}})


def test_crd_declares_and_describes_the_kueue_fields():
    crd = yaml.safe_load((REPO / "crds" / "batchrun.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]
    assert {"queueName", "priorityClassName", "minWorkers"} <= SPEC_FIELDS <= set(spec)
    for name in ("queueName", "priorityClassName", "minWorkers"):
        assert spec[name]["description"]
    admission = schema["properties"]["status"]["properties"]["admission"]
    assert admission["description"]
    for name, prop in admission["properties"].items():
        assert prop.get("description"), f"status.admission.{name} has no description"
    assert set(admission["properties"]["state"]["enum"]) == {
        "NoWorkload", "Pending", "QuotaReserved", "Admitted", "Evicted", "Finished"}


# ------------------------------------------------------------------ the Workload's state
def workload(*conditions: tuple[str, str, str, str], admission: dict | None = None,
             active: bool | None = None) -> dict[str, Any]:
    wl: dict[str, Any] = {"metadata": {"name": "job-r-abc-1234"}, "spec": {},
                          "status": {"conditions": [
                              {"type": t, "status": s, "reason": r, "message": m}
                              for t, s, r, m in conditions]}}
    if admission is not None:
        wl["status"]["admission"] = admission
    if active is not None:
        wl["spec"]["active"] = active
    return wl


ASSIGNED = {"clusterQueue": "cq", "podSetAssignments": [{"name": "main", "count": 2}]}


def test_no_workload_yet():
    a = kueue.admission(None, 3)
    assert (a.state, a.condition_status(), a.asked_workers) == ("NoWorkload", None, 3)


def test_pending_for_quota_says_what_kueue_says():
    a = kueue.admission(workload(("QuotaReserved", "False", "Pending",
                                  "couldn't assign flavors to pod set main: insufficient "
                                  "unused quota for cpu in flavor f, 1 more needed")), 3)
    assert a.state == "Pending" and a.condition_status() is False
    assert a.message.startswith("Pending: couldn't assign flavors")
    assert a.as_status("q") == {
        "queueName": "q", "workload": "job-r-abc-1234", "state": "Pending",
        "reason": "Pending", "message": a.message, "askedWorkers": 3, "admittedWorkers": 0}


def test_partially_admitted_counts_the_admitted_workers():
    a = kueue.admission(workload(("QuotaReserved", "True", "QuotaReserved", ""),
                                 ("Admitted", "True", "Admitted", ""), admission=ASSIGNED), 3)
    assert a.admitted and a.condition_status() is True
    assert (a.admitted_workers, a.asked_workers, a.cluster_queue) == (2, 3, "cq")
    assert a.message == "Admitted by ClusterQueue cq: 2 of 3 worker(s) (partial admission)"


def test_preempted_is_evicted_with_kueues_reason():
    a = kueue.admission(workload(("QuotaReserved", "False", "Pending", "waiting"),
                                 ("Evicted", "True", "Preempted", "Preempted to accommodate"),
                                 ("Preempted", "True", "InClusterQueue",
                                  "Preempted to accommodate a workload (UID: x) due to "
                                  "prioritization in the ClusterQueue")), 2)
    assert (a.state, a.reason, a.condition_status()) == ("Evicted", "Preempted", False)
    assert a.message.startswith("Preempted: Preempted to accommodate a workload")
    assert a.admitted_workers == 0


def test_readmitted_after_preemption_is_admitted_again():
    # Kueue sets Evicted and Preempted False when it reserves quota again
    a = kueue.admission(workload(("Evicted", "False", "QuotaReserved", ""),
                                 ("Preempted", "False", "QuotaReserved", ""),
                                 ("QuotaReserved", "True", "QuotaReserved", ""),
                                 ("Admitted", "True", "Admitted", ""), admission=ASSIGNED), 2)
    assert a.state == "Admitted" and a.message == "Admitted by ClusterQueue cq: 2 worker(s)"


def test_deactivated_and_finished():
    a = kueue.admission(workload(("QuotaReserved", "False", "Pending", ""), active=False), 1)
    assert (a.state, a.reason) == ("Evicted", "Deactivated")
    a = kueue.admission(workload(("Finished", "True", "Succeeded", "Job finished successfully"),
                                 ("Admitted", "True", "Admitted", ""), admission=ASSIGNED), 2)
    assert a.state == "Finished" and a.condition_status() is None


def test_a_namespace_default_queue_applies_to_runs_that_name_none():
    defaults = {"ns": "team-a"}
    assert kueue.with_default_queue(run_of(), "ns", defaults).queue_name == "team-a"
    assert kueue.with_default_queue(run_of(), "other", defaults).queue_name is None
    assert kueue.with_default_queue(run_of(queueName="mine"), "ns", defaults).queue_name == "mine"
    pooled = parse_batchrun({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
                             "metadata": {"name": "r", "namespace": "ns"},
                             "spec": {"tenant": "t", "shardRange": {"count": 3},
                                      "handler": "m:f", "pool": "p"}})
    assert kueue.with_default_queue(pooled, "ns", defaults).queue_name is None


def test_the_default_queues_come_from_the_charts_json():
    from jobrunner.operator.config import _queues

    assert _queues('{"a": "team-a"}') == {"a": "team-a"} and _queues("") == {}
    with pytest.raises(ValueError, match="JSON object of namespace: LocalQueue name"):
        _queues('["team-a"]')


def test_a_pool_in_a_queue_labels_its_deployment_and_pods():
    from jobrunner.operator.workerpool import build_deployment, parse_workerpool

    pool = parse_workerpool({"metadata": {"name": "p", "namespace": "ns"},
                             "spec": {"handlers": ["m:f"], "maxReplicas": 3,
                                      "queueName": "team-a", "priorityClassName": "low"}})
    deploy = build_deployment(pool, 2)
    for labels in (deploy["metadata"]["labels"],
                   deploy["spec"]["template"]["metadata"]["labels"]):
        assert labels[kueue.QUEUE_LABEL] == "team-a"
        assert labels[kueue.PRIORITY_CLASS_LABEL] == "low"
    plain = build_deployment(parse_workerpool({"metadata": {"name": "p", "namespace": "ns"},
                                               "spec": {"handlers": ["m:f"],
                                                        "maxReplicas": 3}}), 2)
    assert kueue.QUEUE_LABEL not in plain["spec"]["template"]["metadata"]["labels"]
    with pytest.raises(BadInput, match="applies to a pool admitted by Kueue"):
        parse_workerpool({"metadata": {"name": "p"},
                          "spec": {"handlers": ["m:f"], "maxReplicas": 3,
                                   "priorityClassName": "low"}})


def test_a_gated_pod_waits_for_admission():
    assert kueue.gated({"spec": {"schedulingGates": [{"name": kueue.ADMISSION_GATE}]}})
    assert not kueue.gated({"spec": {"schedulingGates": [{"name": "other"}]}})
    assert not kueue.gated({"spec": {}})
