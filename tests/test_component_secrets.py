"""One Secret per component (issue 29): a worker pod's environment holds only the worker
DSN. The controller reads its own Secret (database.operatorSecretName); the Job and the
pool Deployment it writes reference the worker Secret (database.workerSecretName), unless
the run names its own spec.database; with neither, today's single Secret for all."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from jobrunner.features.manifest import parse_batchrun
from jobrunner.operator import config
from jobrunner.operator.config import worker_secret
from jobrunner.operator.jobs import build_job

RUN = {"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
       "metadata": {"name": "demo", "namespace": "ns"},
       "spec": {"tenant": "acme", "handler": "mod:fn", "shardRange": {"count": 3}}}


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setattr(config, "CONFIG", dataclasses.replace(
        config.CONFIG, default_secret_name="jr-operator", worker_secret_name="jr-worker"))


def secret_refs(obj) -> list[tuple[str, str]]:
    """Every (Secret, key) the pod spec reads, wherever it is (env, envFrom, volumes)."""
    found: list[tuple[str, str]] = []
    if isinstance(obj, dict):
        ref = obj.get("secretKeyRef")
        if ref:
            found.append((ref["name"], ref["key"]))
        for name in ("secretRef", "secret"):
            if isinstance(obj.get(name), dict):
                found.append((obj[name].get("name") or obj[name].get("secretName"), "*"))
        for value in obj.values():
            found += secret_refs(value)
    elif isinstance(obj, list):
        for value in obj:
            found += secret_refs(value)
    return found


def test_worker_pod_holds_only_the_worker_dsn(split):
    run = parse_batchrun(copy.deepcopy(RUN))
    secret, key = worker_secret(run.database, config.CONFIG.default_secret_name, "dsn")
    job = build_job(run, name="demo-1", namespace="ns", batch_id="b", secret_name=secret,
                    secret_key=key)
    assert secret_refs(job["spec"]["template"]) == [("jr-worker", "dsn")]


def test_a_run_naming_its_database_keeps_it(split):
    obj = copy.deepcopy(RUN)
    obj["spec"]["database"] = {"secretName": "team-db"}
    run = parse_batchrun(obj)
    assert worker_secret(run.database, "team-db", "dsn") == ("team-db", "dsn")


def test_single_secret_still_accepted():
    assert config.CONFIG.worker_secret_name is None
    assert worker_secret({}, "jobrunner-db", "dsn") == ("jobrunner-db", "dsn")
