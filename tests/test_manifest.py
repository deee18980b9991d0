"""The BatchRun spec as `jobrunner run` reads it (the CRD enforces the same rules)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from jobrunner.features.manifest import load_manifest, parse_batchrun
from jobrunner.model.errors import BadInput

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
    ({"shardRange": None, "source": "kafka"}, "spec.source must be a mapping with one of"),
    ({"shardRange": None, "source": {"kafka": {}}}, "spec.source: unknown field(s) kafka"),
    ({"shardRange": None, "source": {"external": {}, "file": "x.jsonl"}},
     "exactly one of external, generator, configMap, file (found external, file)"),
    ({"shardRange": None, "source": {"generator": {"handler": "m:g", "command": ["x"]}}},
     "exactly one of handler (module:function) or command"),
    ({"shardRange": None, "source": {"generator": {"handler": "m:g", "chunkSize": 0}}},
     "chunkSize must be an integer from 1 to 10000"),
    ({"shardRange": None, "source": {"generator": {"handler": "m:g", "args": [1]}}},
     "args must be a mapping"),
    ({"shardRange": None, "source": {"configMap": {"name": "tasks"}}},
     "spec.source.configMap.key is required"),
    ({"shardRange": None, "source": {"file": "tasks.jsonl"}},
     "a file is read by `jobrunner run` only"),
    ({"tenant": "a\x00b"}, "NUL byte"),
    ({"limits": []}, "spec.limits must be a non-empty list"),
    ({"limits": ["a", "a"]}, "spec.limits names a limit twice"),
    ({"limits": [""]}, "limit name must not be empty"),
    ({"tokens": 0}, "spec.tokens must be between 1"),
    ({"tokens": -3}, "spec.tokens must be between 1"),
    ({"shardRange": None, "source": "external", "limits": ["a"]},
     "with source: external, name them in the tasks"),
    ({"shardRange": None, "source": {"external": {}}, "tokens": 5},
     "with source: external, name them in the tasks"),
    ({"budget": {}}, "spec.budget must be a mapping with tokens and/or cost"),
    ({"budget": {"tokens": 0}}, "spec.budget.tokens must be a whole number between 1"),
    ({"budget": {"cost": "0.00"}}, "spec.budget.cost must be greater than 0"),
    ({"budget": {"cost": "-1"}}, "spec.budget.cost must be a decimal number in quotes"),
    ({"budget": {"cost": 12.5}}, "spec.budget.cost must be a decimal number in quotes"),
    ({"budget": {"dollars": "1"}}, "unknown field(s) in spec.budget: dollars"),
])
def test_rejected_specs(changes, message):
    with pytest.raises(BadInput, match=None) as info:
        parse_batchrun(spec_with(**changes))
    assert message in str(info.value)


def test_flow_control_fields():
    run = parse_batchrun(spec_with(limits=["openai", "gpu"], tokens=1800,
                                   budget={"tokens": 2_000_000, "cost": "40.50"}))
    assert run.limits == ("openai", "gpu") and run.tokens == 1800
    assert (run.budget_tokens, str(run.budget_cost)) == (2_000_000, "40.50")
    plain = parse_batchrun(spec_with())
    assert (plain.limits, plain.tokens, plain.budget_tokens, plain.budget_cost) == (
        None, None, None, None)


def test_every_example_manifest_parses():
    manifests = sorted((REPO / "examples").glob("*.yaml"))
    assert manifests
    for path in manifests:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        runs = [d for d in docs if d.get("kind") == "BatchRun"]
        if len(runs) == 1:
            load_manifest(path)
        else:  # several runs (examples/workerpool.yaml): each on its own, as the controller
            for run in runs:
                parse_batchrun(run, source=str(path))
        for pool in (d for d in docs if d.get("kind") == "WorkerPool"):
            from jobrunner.operator.workerpool import parse_workerpool

            parse_workerpool(pool)


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


# ------------------------------------------------------------------------------ spec.template
def test_full_template_is_accepted():
    template = {
        "image": "me/worker:1", "imagePullPolicy": "Always", "serviceAccountName": "",
        "imagePullSecrets": [{"name": "regcred"}], "resources": {"limits": {"memory": "1Gi"}},
        "env": [{"name": "A", "value": "1"}], "envFrom": [{"secretRef": {"name": "s"}}],
        "labels": {"team": "data"}, "annotations": {"a": "b"}, "nodeSelector": {"pool": "x"},
        "tolerations": [{"operator": "Exists"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "priorityClassName": "low", "runtimeClassName": "gvisor",
        "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
        "securityContext": {"runAsUser": 1000, "fsGroup": 1000, "runAsNonRoot": None,
                            "seccompProfile": {"type": "RuntimeDefault"},
                            "supplementalGroups": [5]},
        "containerSecurityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": False,
                                     "capabilities": {"add": ["NET_RAW"], "drop": ["ALL"]}},
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                    {"name": "data", "emptyDir": {}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data/"},
                         {"name": "tmp", "mountPath": "/tmp/sub", "subPath": "x"}],
        "containers": [{"name": "proxy", "image": "p:1",
                        "volumeMounts": [{"name": "data", "mountPath": "/tmp"}],
                        "securityContext": {"runAsUser": 7}}],
        "initContainers": [{"name": "init", "image": "i:1", "restartPolicy": "Always"}],
    }
    run = parse_batchrun(spec_with(template=template))
    assert run.template == template


def test_null_template_fields_are_dropped():
    run = parse_batchrun(spec_with(template={"volumes": None, "image": "x", "hostNetwork": None}))
    assert run.template == {"image": "x"}
    assert parse_batchrun(spec_with(template=None)).template == {}


def _c(name="side", **extra):
    return {"name": name, "image": "img:1", **extra}


@pytest.mark.parametrize(("template", "message"), [
    ("image: x", "spec.template must be a mapping, got the string"),
    ({"imagee": "x"}, "spec.template: unknown field(s) imagee"),
    ({"image": 3}, "spec.template.image must be a string, got the number 3"),
    ({"imagePullPolicy": "Sometimes"}, "spec.template.imagePullPolicy must be one of Always"),
    ({"hostNetwork": "true"}, "spec.template.hostNetwork must be true or false, got the string"),
    ({"hostNetwork": 1}, "spec.template.hostNetwork must be true or false, got the number 1"),
    ({"dnsPolicy": "None"}, "spec.template.dnsPolicy must be one of ClusterFirst"),
    ({"priorityClassName": ""}, "spec.template.priorityClassName must be a non-empty string"),
    ({"runtimeClassName": 5}, "spec.template.runtimeClassName must be a non-empty string"),
    ({"resources": []}, "spec.template.resources must be a mapping, got a list"),
    ({"labels": {"version": 1.0}}, "spec.template.labels.version must be a string (quote it"),
    ({"nodeSelector": ["a"]}, "spec.template.nodeSelector must be a mapping of strings"),
    ({"env": {"A": "1"}}, "spec.template.env must be a list, got a mapping"),
    ({"env": [{"value": "1"}]}, "spec.template.env[0].name is required"),
    ({"env": ["A=1"]}, "spec.template.env[0] must be a mapping, got the string 'A=1'"),
    ({"tolerations": {"key": "x"}}, "spec.template.tolerations must be a list"),
    ({"imagePullSecrets": ["regcred"]}, "spec.template.imagePullSecrets[0] must be a mapping"),
    ({"imagePullSecrets": [{"name": ""}]},
     "spec.template.imagePullSecrets[0].name must be a non-empty"),
    ({"affinity": [{"nodeAffinity": {}}]}, "spec.template.affinity must be a mapping"),
    ({"affinity": {"nodeAfinity": {}}}, "spec.template.affinity: unknown field(s) nodeAfinity"),
    ({"affinity": {"nodeAffinity": []}}, "spec.template.affinity.nodeAffinity must be a mapping"),
    ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "k"}]},
     "spec.template.topologySpreadConstraints[0].whenUnsatisfiable is required"),
    ({"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "k",
                                     "whenUnsatisfiable": "DoNotSchedule"}]},
     "spec.template.topologySpreadConstraints[0].maxSkew must be an integer of at least 1"),
    ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "k",
                                     "whenUnsatisfiable": "Maybe"}]},
     "topologySpreadConstraints[0].whenUnsatisfiable must be one of DoNotSchedule"),
    # volumes and mounts
    ({"volumes": {"name": "x"}}, "spec.template.volumes must be a list, got a mapping"),
    ({"volumes": [{"emptyDir": {}}]}, "spec.template.volumes[0].name is required"),
    ({"volumes": [{"name": "Data"}]}, "spec.template.volumes[0].name 'Data' must be a DNS label"),
    ({"volumes": [{"name": "d"}, {"name": "d"}]},
     "spec.template.volumes[1].name 'd' is used twice"),
    ({"volumes": [{"name": f"v{i}"} for i in range(65)]},
     "spec.template.volumes has 65 items; the limit is 64"),
    ({"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
     "spec.template.volumeMounts[0].name 'data' is not a volume: define it in"),
    ({"volumes": [{"name": "d"}], "volumeMounts": [{"name": "d"}]},
     "spec.template.volumeMounts[0].mountPath is required"),
    ({"volumes": [{"name": "d"}], "volumeMounts": [{"name": "d", "mountPath": "data"}]},
     "spec.template.volumeMounts[0].mountPath must be an absolute path"),
    ({"volumes": [{"name": "d"}], "volumeMounts": [{"name": "d", "mountPath": "/tmp"}]},
     "spec.template.volumeMounts[0].mountPath: /tmp is the worker's scratch directory"),
    ({"volumeMounts": [{"name": "tmp", "mountPath": "/tmp/"}]},
     "to change what backs it, define a volume named 'tmp' in spec.template.volumes"),
    ({"volumes": [{"name": "d"}], "volumeMounts": [{"name": "d", "mountPath": "/d"},
                                                   {"name": "d", "mountPath": "/d/"}]},
     "spec.template.volumeMounts[1].mountPath '/d/' is mounted twice"),
    # security contexts
    ({"securityContext": "restricted"}, "spec.template.securityContext must be a mapping"),
    ({"securityContext": {"runAsUser": "1000"}},
     "spec.template.securityContext.runAsUser must be an integer, got the string '1000'"),
    ({"securityContext": {"runAsNonRoot": "yes"}},
     "spec.template.securityContext.runAsNonRoot must be true or false"),
    ({"securityContext": {"capabilities": {"drop": ["ALL"]}}},
     "spec.template.securityContext.capabilities is a container field: for the worker set "
     "it in spec.template.containerSecurityContext"),
    ({"securityContext": {"runAsUsr": 1}},
     "spec.template.securityContext: unknown field 'runAsUsr'"),
    ({"containerSecurityContext": {"fsGroup": 1}},
     "spec.template.containerSecurityContext.fsGroup is a pod-level field: set it in "
     "spec.template.securityContext"),
    ({"containerSecurityContext": {"privileged": 0}},
     "spec.template.containerSecurityContext.privileged must be true or false"),
    ({"containerSecurityContext": {"capabilities": {"add": "NET_RAW"}}},
     "spec.template.containerSecurityContext.capabilities.add must be a list of capability"),
    ({"containerSecurityContext": {"capabilities": {"remove": ["X"]}}},
     "spec.template.containerSecurityContext.capabilities: unknown field 'remove'"),
    ({"containerSecurityContext": {"capabilities": ["ALL"]}},
     "spec.template.containerSecurityContext.capabilities must be a mapping"),
    ({"securityContext": {"seccompProfile": {"type": 1}}},
     "spec.template.securityContext.seccompProfile.type must be a string"),
    # extra containers
    ({"containers": _c()}, "spec.template.containers must be a list, got a mapping"),
    ({"containers": [_c("worker")]},
     "spec.template.containers[0].name: 'worker' is the name of jobrunner's own container"),
    ({"initContainers": [_c("worker")]},
     "spec.template.initContainers[0].name: 'worker' is the name of jobrunner's own"),
    ({"containers": [_c(), _c()]}, "spec.template.containers[1].name 'side' is used twice"),
    ({"initContainers": [_c()], "containers": [_c()]},
     "spec.template.containers[0].name 'side' is used twice (container names must be unique "
     "across spec.template.containers and spec.template.initContainers)"),
    ({"containers": [{"name": "side"}]}, "spec.template.containers[0].image is required"),
    ({"containers": [{"image": "x"}]}, "spec.template.containers[0].name is required"),
    ({"containers": [_c("Side_Car")]}, "spec.template.containers[0].name 'Side_Car' must be"),
    ({"containers": [_c(image="")]}, "spec.template.containers[0].image must be a non-empty"),
    ({"containers": [_c(args="--flag")]}, "spec.template.containers[0].args must be a list"),
    ({"containers": [_c(volumeMounts=[{"name": "nope", "mountPath": "/x"}])]},
     "spec.template.containers[0].volumeMounts[0].name 'nope' is not a volume"),
    ({"containers": [_c(securityContext={"fsGroup": 1})]},
     "spec.template.containers[0].securityContext.fsGroup is a pod-level field"),
    ({"initContainers": [_c(restartPolicy="OnFailure")]},
     "spec.template.initContainers[0].restartPolicy must be one of Always"),
    ({"containers": [_c(f"c{i}") for i in range(17)]},
     "spec.template.containers has 17 items; the limit is 16"),
])
def test_rejected_templates(template, message):
    with pytest.raises(BadInput) as info:
        parse_batchrun(spec_with(template=template))
    assert message in str(info.value)
    assert "(BatchRun demo)" in str(info.value)


def test_generator_tasks_take_the_runs_flow_control_defaults():
    run = parse_batchrun(spec_with(shardRange=None, limits=["openai"], tokens=900,
                                   source={"generator": {"handler": "m:gen"}}))
    assert run.generator is not None
    assert (run.generator.limits, run.generator.tokens) == (("openai",), 900)
    # kept with the generator's task (its spec is stored as JSON with the batch)
    again = type(run.generator).from_json(run.generator.as_json())
    assert (again.limits, again.tokens) == (("openai",), 900)
