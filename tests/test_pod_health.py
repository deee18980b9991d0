"""The controller's verdict on worker pods that cannot start (controller/pods.py)."""

from __future__ import annotations

import datetime as dt

from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodStatus,
)

from controller.pods import classify, stuck_for

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def pod(name: str, *states: V1ContainerState, last: V1ContainerState | None = None,
        age: int = 0) -> V1Pod:
    statuses = [V1ContainerStatus(name="worker", image="i", image_id="", ready=False,
                                  restart_count=0, state=s, last_state=last) for s in states]
    return V1Pod(metadata=V1ObjectMeta(name=name, creation_timestamp=T0 - dt.timedelta(
        seconds=age)), status=V1PodStatus(container_statuses=statuses))


def waiting(reason: str, message: str = "") -> V1ContainerState:
    return V1ContainerState(waiting=V1ContainerStateWaiting(reason=reason, message=message))


RUNNING = V1ContainerState(running=V1ContainerStateRunning())


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
    oom = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=137,
                                                                 reason="OOMKilled"))
    health = classify([pod("old", oom), pod("new", waiting("ImagePullBackOff"))])
    assert health.problem.reason == "ImagePullBackOff" and health.any_started


def test_a_container_that_could_not_start_never_ran():
    bad = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=128,
                                                                 reason="StartError"))
    assert not classify([pod("a", bad)]).any_started


def test_stuck_for_counts_from_the_conditions_transition():
    cond = {"status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    assert stuck_for(cond, T0 + dt.timedelta(seconds=42)) == 42
    assert stuck_for({**cond, "status": "True"}, T0) == 0
    assert stuck_for(None, T0) == 0
