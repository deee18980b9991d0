"""The BatchRun spec as `jobrunner run` reads it (the CRD enforces the same rules)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from jobrunner.errors import BadInput
from jobrunner.manifest import load_manifest, parse_batchrun

REPO = Path(__file__).resolve().parent.parent

BASE = {
    "apiVersion": "jobrunner.dev/v1alpha1",
    "kind": "BatchRun",
    "metadata": {"name": "demo"},
    "spec": {"tenant": "acme", "handler": "mod:fn", "shardRange": {"count": 3}},
}


def spec_with(**changes):
    obj = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            obj["spec"].pop(key, None)
        else:
            obj["spec"][key] = value
    return obj


def test_defaults():
    run = parse_batchrun(BASE)
    assert (run.workers, run.visibility_timeout, run.max_attempts) == (1, 600, 8)
    assert run.heartbeat == 200
    assert [t.key for t in run.tasks] == ["shard-0", "shard-1", "shard-2"]
    assert run.tasks[2].payload == {"index": 2}
    assert run.effective_deadline() > run.visibility_timeout + 60


def test_inline_shards():
    run = parse_batchrun(spec_with(shardRange=None, shards=[
        {"key": "a", "shardKey": "repo", "payload": {"x": 1}}, {"key": "b"}]))
    assert [(t.key, t.shard_key, t.payload) for t in run.tasks] == [
        ("a", "repo", {"x": 1}), ("b", None, {})]


def test_external_source():
    assert parse_batchrun(spec_with(shardRange=None, source="external")).tasks is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"tenant": None}, "spec.tenant is required"),
    ({"shards": [{"key": "a"}]}, "exactly one of spec.shards, spec.shardRange or spec.source"),
    ({"shardRange": None}, "exactly one of spec.shards"),
    ({"workers": 0}, "spec.workers must be between 1 and 1000"),
    ({"workers": 1001}, "spec.workers must be between 1 and 1000"),
    ({"visibilityTimeoutSeconds": 600, "activeDeadlineSeconds": 600},
     "must be greater than spec.visibilityTimeoutSeconds + 60"),
    ({"visibilityTimeoutSeconds": 60, "heartbeatSeconds": 30}, "less than half"),
    ({"handler": None}, "exactly one of spec.handler"),
    ({"command": ["echo"]}, "exactly one of spec.handler"),
    ({"handler": "no-colon"}, "module:function"),
    ({"colour": "red"}, "unknown field(s) in spec: colour"),
    ({"shardRange": {"count": 0}}, "count must be between 1"),
    ({"shardRange": None, "shards": [{"key": "a"}, {"key": "a"}]}, "is used twice"),
    ({"shardRange": None, "shards": [{"key": "a", "payload": [1]}]},
     "payload must be a JSON object"),
    ({"shardRange": None, "source": "kafka"}, "spec.source must be 'external'"),
    ({"tenant": "a\x00b"}, "NUL byte"),
])
def test_rejected_specs(changes, message):
    with pytest.raises(BadInput, match=None) as info:
        parse_batchrun(spec_with(**changes))
    assert message in str(info.value)


def test_every_example_manifest_parses():
    manifests = sorted((REPO / "examples").glob("*.yaml"))
    assert manifests
    for path in manifests:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if any(d.get("kind") == "BatchRun" for d in docs):
            load_manifest(path)


def test_manifest_file_errors(tmp_path):
    with pytest.raises(BadInput, match="cannot read manifest"):
        load_manifest(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(BadInput, match="not valid YAML"):
        load_manifest(bad)
    other = tmp_path / "other.yaml"
    other.write_text("apiVersion: v1\nkind: ConfigMap\n")
    with pytest.raises(BadInput, match="exactly one BatchRun"):
        load_manifest(other)
