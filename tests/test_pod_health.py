"""The controller's verdict on worker pods that cannot start (jobrunner/operator/pods.py)."""

from __future__ import annotations

import datetime as dt

from jobrunner.operator.pods import classify, stuck_for

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def pod(name: str, *states: dict, last: dict | None = None, age: int = 0) -> dict:
    """A pod as the API returns it (JSON, camelCase, RFC 3339 timestamps)."""
    created = (T0 - dt.timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ")
    statuses = [{"name": "worker", "image": "i", "imageID": "", "ready": False,
                 "restartCount": 0, "state": s, **({"lastState": last} if last else {})}
                for s in states]
    return {"metadata": {"name": name, "creationTimestamp": created},
            "status": {"containerStatuses": statuses}}


def waiting(reason: str, message: str = "") -> dict:
    return {"waiting": {"reason": reason, "message": message}}


RUNNING = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}


def test_a_stuck_container_is_the_problem_and_nothing_started():
    health = classify([pod("a", waiting("ContainerCreating")),
                       pod("b", waiting("ErrImageNeverPull", "image x not present"), age=5)])
    assert health.problem and health.problem.pod == "b"
    assert health.problem.reason == "ErrImageNeverPull"
    assert "image x not present" in health.problem.describe()
    assert not health.any_started


def test_transient_waiting_is_no_problem_and_a_running_worker_counts_as_started():
    health = classify([pod("a", waiting("ContainerCreating")), pod("b", RUNNING)])
    assert health.problem is None and health.any_started


def test_a_replacement_stuck_after_workers_ran_is_reported_but_they_started():
    oom = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    health = classify([pod("old", oom), pod("new", waiting("ImagePullBackOff"))])
    assert health.problem.reason == "ImagePullBackOff" and health.any_started


def test_a_container_that_could_not_start_never_ran():
    bad = {"terminated": {"exitCode": 128, "reason": "StartError"}}
    assert not classify([pod("a", bad)]).any_started


def test_stuck_for_counts_from_the_conditions_transition():
    cond = {"status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    assert stuck_for(cond, T0 + dt.timedelta(seconds=42)) == 42
    assert stuck_for({**cond, "status": "True"}, T0) == 0
    assert stuck_for(None, T0) == 0


def test_the_oldest_pod_is_reported_first_and_a_restarted_container_started():
    health = classify([pod("young", waiting("ErrImagePull"), age=1),
                       pod("old", waiting("ImagePullBackOff"), age=60),
                       pod("restarted", waiting("CrashLoopBackOff"),
                           last={"terminated": {"exitCode": 1, "reason": "Error"}})])
    assert health.problem.pod == "old" and health.any_started
    # An empty running state ({}) is still running.
    assert classify([pod("a", {"running": {}})]).any_started
