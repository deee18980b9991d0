"""Property tests: parsing of enqueue input and of BatchRun manifests either accepts the
input or rejects it with BadInput, never anything else; accepted input round-trips."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobrunner.features.manifest import TEMPLATE_FIELDS, parse_batchrun
from jobrunner.model.errors import BadInput
from jobrunner.model.validation import parse_jsonl
from jobrunner.operator.jobs import build_job

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=80) | json_values.map(json.dumps), max_size=6))
def test_jsonl_parser_accepts_or_rejects_cleanly(lines):
    try:
        tasks = parse_jsonl(lines, "fuzz")
    except BadInput as exc:
        assert str(exc).startswith("fuzz line ")
        return
    for task in tasks:
        assert isinstance(task.payload, dict) and task.key and "\x00" not in task.key


@settings(max_examples=300)
@given(st.dictionaries(
    st.sampled_from(["key", "shard_key", "payload", "max_attempts", "extra"]),
    json_values, max_size=5))
def test_task_objects_accept_or_reject_cleanly(obj):
    try:
        (task,) = parse_jsonl([json.dumps(obj)], "fuzz")
    except BadInput:
        return
    assert task.key == obj["key"] and task.payload == obj.get("payload", {})


spec_fields = st.fixed_dictionaries({}, optional={
    "tenant": json_values, "workers": json_values, "shards": json_values,
    "shardRange": st.fixed_dictionaries({"count": json_values}), "source": json_values,
    "handler": st.sampled_from(["m:f", "bad", "a.b:c"]) | json_values,
    "command": json_values, "visibilityTimeoutSeconds": json_values,
    "heartbeatSeconds": json_values, "activeDeadlineSeconds": json_values,
    "maxAttempts": json_values, "backoffBaseSeconds": json_values,
    "backoffCapSeconds": json_values, "suspend": json_values, "template": json_values,
    "database": json_values, "batchId": json_values, "concurrency": json_values,
})


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(spec_fields, st.sampled_from(["jobrunner.dev/v1alpha1", "v1", None]),
       st.one_of(st.none(), st.text(max_size=20)))
def test_manifest_parser_accepts_or_rejects_cleanly(spec, api_version, name):
    obj = {"apiVersion": api_version, "kind": "BatchRun", "metadata": {"name": name},
           "spec": spec}
    try:
        run = parse_batchrun(obj)
    except BadInput:
        return
    assert 1 <= run.workers <= 1000
    assert run.heartbeat < run.visibility_timeout / 2
    assert run.effective_deadline() > run.visibility_timeout + 60
    assert (run.handler is None) != (run.command is None)


template_item = st.dictionaries(
    st.sampled_from(["name", "image", "mountPath", "maxSkew", "topologyKey",
                     "whenUnsatisfiable", "volumeMounts", "securityContext", "restartPolicy",
                     "capabilities", "seccompProfile", "runAsUser", "fsGroup", "add", "type"]),
    json_values | st.sampled_from(["worker", "tmp", "/tmp", "data", "/data"]), max_size=5)
template_fields = st.dictionaries(
    st.sampled_from([*sorted(TEMPLATE_FIELDS), "unknown"]),
    json_values | template_item | st.lists(template_item, max_size=3), max_size=6)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(template_fields)
def test_template_parser_accepts_or_rejects_cleanly(template):
    obj = {"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
           "metadata": {"name": "fuzz"},
           "spec": {"tenant": "t", "handler": "m:f", "source": "external",
                    "template": template}}
    try:
        run = parse_batchrun(obj)
    except BadInput as exc:
        assert "spec.template" in str(exc)
        return
    job = build_job(run, name="fuzz-1", namespace="ns", batch_id="b", secret_name="s",
                    secret_key="k")
    pod = job["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["containers"] + pod.get("initContainers", [])]
    assert names[0] == "worker" and len(set(names)) == len(names)
    assert [v["name"] for v in pod["volumes"]].count("tmp") == 1
