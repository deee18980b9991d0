"""The Kubernetes side of worker pools without a cluster: the WorkerPool's spec, its
Deployment (the same worker pod as a BatchRun's Job), the CRDs' shared schemas, and a
BatchRun's spec.pool rules. On a real cluster: tests/e2e/test_worker_pool_e2e.py."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobrunner.features.manifest import parse_batchrun
from jobrunner.model.errors import BadInput
from jobrunner.operator.jobs import build_job
from jobrunner.operator.workerpool import (
    HASH_ANNOTATION,
    build_deployment,
    deployment_name,
    parse_workerpool,
)

REPO = Path(__file__).resolve().parent.parent
POOL = {"apiVersion": "jobrunner.dev/v1alpha1", "kind": "WorkerPool",
        "metadata": {"name": "graders", "namespace": "team-a"},
        "spec": {"handlers": ["mod:fn"], "maxReplicas": 3}}
RUN = {"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
       "metadata": {"name": "nightly", "namespace": "team-a"},
       "spec": {"tenant": "acme", "handler": "mod:fn", "shardRange": {"count": 3},
                "pool": "graders"}}


def pool_with(**spec: Any) -> Any:
    obj = copy.deepcopy(POOL)
    obj["spec"].update(spec)
    return parse_workerpool(obj)


def test_defaults_and_the_queue_pool_is_namespace_qualified():
    pool = pool_with()
    assert pool.queue_pool == "team-a/graders"
    assert (pool.min_replicas, pool.max_replicas, pool.window) == (0, 3, 300)
    assert pool.target_per_replica == pool.concurrency == 1
    assert pool_with(concurrency=4).target_per_replica == 4
    assert pool_with(concurrency=4, targetTasksPerReplica=10).target_per_replica == 10


@pytest.mark.parametrize(("spec", "message"), [
    ({"handlers": ["mod:fn", "no-colon"]}, "spec.handlers[1] must look like"),
    ({"handlers": []}, "spec.handlers must be a list of 1 to 32"),
    ({"handlers": ["mod:fn", "mod:fn"]}, "names a handler twice"),
    ({"maxReplicas": 0}, "spec.maxReplicas must be an integer between 1 and 1000"),
    ({"minReplicas": 4}, "spec.minReplicas must be at most spec.maxReplicas"),
    ({"visibilityTimeoutSeconds": 10, "heartbeatSeconds": 5}, "less than half"),
    ({"backoffBaseSeconds": 5, "backoffCapSeconds": 1}, "at least spec.backoffBaseSeconds"),
    ({"template": {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}}, "is not a volume"),
])
def test_bad_pool_specs_are_refused_with_the_field(spec, message):
    with pytest.raises(BadInput, match=re.escape(message)):
        pool_with(**spec)


def test_the_deployment_runs_the_jobs_worker_pod_with_pool_arguments():
    template = {"securityContext": {"runAsUser": 1000}, "env": [{"name": "A", "value": "1"}],
                "labels": {"team": "a", "jobrunner.dev/workerpool": "hijack"}}
    pool = pool_with(template=template, concurrency=2, batchSize=5,
                     handlers=["mod:fn", "other.mod:g"])
    deploy = build_deployment(pool, replicas=2)
    assert deploy["metadata"]["name"] == deployment_name("graders") == "graders-workers"
    assert deploy["spec"]["replicas"] == 2
    pod_meta, pod = deploy["spec"]["template"]["metadata"], deploy["spec"]["template"]["spec"]
    assert deploy["spec"]["selector"] == {"matchLabels": {"jobrunner.dev/workerpool": "graders"}}
    assert pod_meta["labels"]["jobrunner.dev/workerpool"] == "graders"  # selector wins
    assert pod_meta["labels"]["team"] == "a"
    assert pod["restartPolicy"] == "Always"  # a Deployment's pods
    (worker,) = pod["containers"]
    cmd = worker["command"]
    assert cmd[:4] == ["jobrunner", "worker", "--pool", "team-a/graders"]
    assert "--exit-when-drained" not in cmd and "--batch" not in cmd
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--handler"] == [
        "mod:fn", "other.mod:g"]
    assert cmd[cmd.index("--concurrency") + 1] == "2"
    assert cmd[cmd.index("--batch-size") + 1] == "5"
    # SIGTERM: the worker's grace fits in the pod's, so leases are released before SIGKILL
    grace = float(cmd[cmd.index("--grace-period") + 1])
    assert grace < pod["terminationGracePeriodSeconds"]
    # the same pod as a BatchRun's Job with the same template: defaults, env, secret ref
    run = copy.deepcopy(RUN)
    del run["spec"]["pool"]
    run["spec"]["template"] = template
    job_pod = build_job(parse_batchrun(run), name="j", namespace="team-a", batch_id="b",
                        secret_name="jobrunner-db", secret_key="dsn")["spec"]["template"]["spec"]
    for key in ("securityContext", "volumes", "automountServiceAccountToken",
                "terminationGracePeriodSeconds"):
        assert pod[key] == job_pod[key], key
    (job_worker,) = job_pod["containers"]
    for key in ("securityContext", "volumeMounts", "image"):
        assert worker[key] == job_worker[key], key
    assert worker["env"][0] == job_worker["env"][0] == {
        "name": "JOBRUNNER_DATABASE_URL",
        "valueFrom": {"secretKeyRef": {"name": "jobrunner-db", "key": "dsn"}}}
    assert worker["env"][-1] == {"name": "A", "value": "1"}


def test_a_pod_change_changes_the_rollout_hash_and_replicas_do_not():
    a = build_deployment(pool_with(), replicas=1)["metadata"]["annotations"][HASH_ANNOTATION]
    assert a == build_deployment(pool_with(), replicas=3)["metadata"]["annotations"][
        HASH_ANNOTATION]
    b = build_deployment(pool_with(template={"env": [{"name": "X", "value": "y"}]}),
                         replicas=1)["metadata"]["annotations"][HASH_ANNOTATION]
    assert a != b


def _schema(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((REPO / "crds" / name).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]


def test_workerpool_template_schema_is_the_batchruns():
    pool, run = _schema("workerpool.yaml"), _schema("batchrun.yaml")
    for key in ("template", "database", "concurrency", "batchSize"):
        a, b = dict(pool[key]), dict(run[key])
        a.pop("description", None)
        b.pop("description", None)
        assert a == b, f"crds/workerpool.yaml spec.{key} differs from the BatchRun's"


def test_every_workerpool_field_has_a_description():
    crd = yaml.safe_load((REPO / "crds" / "workerpool.yaml").read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    for part in ("spec", "status"):
        for key, value in root[part]["properties"].items():
            assert value.get("description"), f"{part}.{key} has no description"


def run_with(**spec: Any) -> Any:
    obj = copy.deepcopy(RUN)
    obj["spec"].update(spec)
    return parse_batchrun(obj)


def test_batchrun_pool_and_priority():
    run = run_with(priority=2)
    assert (run.pool, run.priority) == ("graders", 2)
    assert run_with().priority == 0


@pytest.mark.parametrize(("spec", "message"), [
    ({"priority": 4}, "spec.priority must be between -3 and 3"),
    ({"pool": "Not_A_Name"}, "spec.pool must be the name of a WorkerPool"),
    ({"handler": None, "command": ["cat"]}, "spec.command is not served by pools"),
    ({"suspend": True}, "suspend does not apply"),
    ({"template": {"image": "x"}}, "a run in a pool takes none"),
    ({"shardRange": None, "source": {"generator": {"handler": "m:g"}}},
     "a generator source cannot run in a pool"),
])
def test_batchrun_in_a_pool_refuses_what_a_pool_cannot_serve(spec, message):
    obj = copy.deepcopy(RUN)
    for key, value in spec.items():
        if value is None:
            obj["spec"].pop(key)
        else:
            obj["spec"][key] = value
    with pytest.raises(BadInput, match=message):
        parse_batchrun(obj)


def test_batchrun_in_a_pool_takes_limits_tokens_and_a_budget():
    # (the pool's claim applies them: docs/pools.md, "Flow control")
    run = run_with(limits=["openai"], tokens=10, budget={"tokens": 1000, "cost": "2.5"})
    assert (run.pool, run.limits, run.tokens, run.budget_tokens, str(run.budget_cost)) == (
        "graders", ("openai",), 10, 1000, "2.5")


def test_priority_without_a_pool_is_refused():
    obj = copy.deepcopy(RUN)
    del obj["spec"]["pool"]
    obj["spec"]["priority"] = 1
    with pytest.raises(BadInput, match=r"spec\.priority applies to a run in a pool"):
        parse_batchrun(obj)


def _counts(**kw: int) -> dict[str, int]:
    counts = {"pending": 0, "leased": 0, "done": 0, "dead": 0, "cancelled": 0, **kw}
    counts["total"] = sum(counts.values())
    return counts


def test_a_pool_runs_phase_comes_from_the_queue_alone():
    from jobrunner.operator.phase import pool_run_phase

    run = run_with()

    def of(counts: dict[str, int], deadline_hit: bool = False) -> tuple[str, str, str]:
        return pool_run_phase(run, counts, "b", None, deadline_hit, "team-a/graders")

    p, reason, message = of(_counts(pending=2, leased=1, done=3))
    assert (p, reason) == ("Running", "Running") and message.endswith("in pool team-a/graders")
    assert of(_counts(done=6))[:2] == ("Succeeded", "AllTasksDone")
    assert of(_counts(done=5, dead=1))[:2] == ("Failed", "DeadTasks")
    assert of(_counts(done=2, cancelled=4))[:2] == ("Cancelled", "Cancelled")
    p, reason, message = of(_counts(done=2, cancelled=4), deadline_hit=True)
    assert (p, reason) == ("Failed", "DeadlineExceeded") and "pending tasks cancelled" in message
