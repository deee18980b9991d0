"""The Job the controller creates for a BatchRun: spec.template fields land in its pod
template, over jobrunner's own container, /tmp volume and hardened security contexts."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from jobrunner.features import manifest
from jobrunner.features.manifest import TEMPLATE_FIELDS, parse_batchrun
from jobrunner.operator.jobs import (
    POD_SECURITY_CONTEXT,
    WORKER_SECURITY_CONTEXT,
    api_error_detail,
    build_job,
    merge_over,
)

REPO = Path(__file__).resolve().parent.parent

BASE = {
    "apiVersion": "jobrunner.dev/v1alpha1",
    "kind": "BatchRun",
    "metadata": {"name": "demo", "namespace": "ns"},
    "spec": {"tenant": "acme", "handler": "mod:fn", "shardRange": {"count": 3}},
}


def job_for(template: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    if template is not None:
        obj["spec"]["template"] = template
    run = parse_batchrun(obj)
    return build_job(run, name="demo-abc123", namespace="ns", batch_id="ns/demo/1234",
                     secret_name="db", secret_key="dsn")


def pod_of(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def worker_of(job: dict[str, Any]) -> dict[str, Any]:
    (worker,) = [c for c in pod_of(job)["containers"] if c["name"] == "worker"]
    return worker


# ------------------------------------------------------------------------------ defaults
def test_default_pod_is_hardened_with_a_scratch_tmp():
    job = job_for()
    pod, worker = pod_of(job), worker_of(job)
    assert [c["name"] for c in pod["containers"]] == ["worker"]
    assert pod["securityContext"] == {"runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert worker["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    assert worker["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    for key in ("hostNetwork", "dnsPolicy", "affinity", "topologySpreadConstraints",
                "priorityClassName", "runtimeClassName", "imagePullSecrets",
                "initContainers"):
        assert key not in pod, key


def test_building_a_job_does_not_change_the_defaults_or_share_objects():
    template = {"securityContext": {"seccompProfile": {"type": "Localhost",
                                                       "localhostProfile": "p.json"}},
                "containerSecurityContext": {"capabilities": {"add": ["NET_RAW"]}},
                "volumes": [{"name": "data", "emptyDir": {}}]}
    before = (copy.deepcopy(POD_SECURITY_CONTEXT), copy.deepcopy(WORKER_SECURITY_CONTEXT))
    job = job_for(template)
    assert before == (POD_SECURITY_CONTEXT, WORKER_SECURITY_CONTEXT)
    pod_of(job)["volumes"][1]["emptyDir"]["sizeLimit"] = "1Gi"
    assert job_for()["spec"]["template"]["spec"]["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    assert template["volumes"] == [{"name": "data", "emptyDir": {}}]


# ------------------------------------------------------------------------------ security
def test_merge_over_is_a_json_merge_patch():
    defaults = {"a": 1, "b": {"c": 2, "d": [1]}, "e": True}
    assert merge_over(defaults, {}) == defaults
    assert merge_over(defaults, {"a": 5, "b": {"d": [], "x": 1}, "e": None, "f": "g"}) == {
        "a": 5, "b": {"c": 2, "d": [], "x": 1}, "f": "g"}
    assert merge_over(defaults, {"b": 3}) == {"a": 1, "b": 3, "e": True}
    assert defaults == {"a": 1, "b": {"c": 2, "d": [1]}, "e": True}


def test_pod_security_context_merges_over_the_defaults():
    pod = pod_of(job_for({"securityContext": {"runAsUser": 1000, "fsGroup": 2000}}))
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 2000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}


def test_seccomp_profile_merges_key_by_key():
    pod = pod_of(job_for({"securityContext": {
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/w.json"}}}))
    assert pod["securityContext"]["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": "profiles/w.json"}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_container_security_context_merges_over_the_hardened_defaults():
    worker = worker_of(job_for({"containerSecurityContext": {
        "runAsUser": 1000, "capabilities": {"add": ["NET_BIND_SERVICE"]}}}))
    assert worker["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "runAsUser": 1000,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}


def test_a_default_can_be_overridden_or_removed():
    job = job_for({"containerSecurityContext": {"readOnlyRootFilesystem": False,
                                                "capabilities": {"drop": []}},
                   "securityContext": {"seccompProfile": None, "runAsNonRoot": False}})
    assert worker_of(job)["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
        "runAsNonRoot": True, "capabilities": {"drop": []}}
    assert pod_of(job)["securityContext"] == {"runAsNonRoot": False}


# ------------------------------------------------------------------------------ volumes
def test_user_volumes_and_mounts_are_added_to_tmp():
    job = job_for({
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "pvc"}},
                    {"name": "cfg", "configMap": {"name": "settings"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": "cfg", "mountPath": "/etc/app", "readOnly": True}]})
    assert pod_of(job)["volumes"] == [
        {"name": "tmp", "emptyDir": {}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "pvc"}},
        {"name": "cfg", "configMap": {"name": "settings"}}]
    assert worker_of(job)["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"}, {"name": "data", "mountPath": "/data"},
        {"name": "cfg", "mountPath": "/etc/app", "readOnly": True}]


def test_a_volume_named_tmp_replaces_the_default_emptydir():
    tmp = {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}
    job = job_for({"volumes": [{"name": "data", "emptyDir": {}}, tmp]})
    assert pod_of(job)["volumes"] == [{"name": "data", "emptyDir": {}}, tmp]
    assert worker_of(job)["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


# ------------------------------------------------------------------------------ network
def test_host_network_brings_cluster_first_with_host_net_dns():
    pod = pod_of(job_for({"hostNetwork": True}))
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_an_explicit_dns_policy_wins():
    pod = pod_of(job_for({"hostNetwork": True, "dnsPolicy": "Default"}))
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "Default")
    pod = pod_of(job_for({"dnsPolicy": "Default"}))
    assert "hostNetwork" not in pod and pod["dnsPolicy"] == "Default"


def test_host_network_false_changes_nothing():
    pod = pod_of(job_for({"hostNetwork": False}))
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod


# ------------------------------------------------------------------------------ scheduling
def test_scheduling_fields_pass_through():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["batch"]}]}]}}}
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
               "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"jobrunner.dev/batchrun": "demo"}}}]
    pod = pod_of(job_for({
        "affinity": affinity, "topologySpreadConstraints": spread,
        "priorityClassName": "batch-low", "runtimeClassName": "gvisor",
        "imagePullSecrets": [{"name": "regcred"}],
        "nodeSelector": {"pool": "batch"},
        "tolerations": [{"key": "batch", "operator": "Exists", "effect": "NoSchedule"}]}))
    assert pod["affinity"] == affinity
    assert pod["topologySpreadConstraints"] == spread
    assert pod["priorityClassName"] == "batch-low"
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"pool": "batch"}
    assert pod["tolerations"][0]["key"] == "batch"


def test_pod_labels_include_the_run_for_selectors():
    job = job_for({"labels": {"team": "data"}, "annotations": {"a": "b"}})
    meta = job["spec"]["template"]["metadata"]
    assert meta["labels"]["jobrunner.dev/batchrun"] == "demo"
    assert meta["labels"]["team"] == "data"
    assert meta["annotations"] == {"a": "b"}


# ------------------------------------------------------------------------------ containers
def test_extra_containers_and_init_containers():
    sidecar = {"name": "proxy", "image": "envoy:1", "volumeMounts": [
        {"name": "tmp", "mountPath": "/shared"}]}
    init = [{"name": "fetch", "image": "busybox:1", "command": ["true"]},
            {"name": "sql-proxy", "image": "proxy:2", "restartPolicy": "Always"}]
    job = job_for({"containers": [sidecar], "initContainers": init,
                   "image": "me/worker:1", "envFrom": [{"secretRef": {"name": "k"}}],
                   "env": [{"name": "X", "value": "1"}], "resources": {"limits": {"cpu": "1"}}})
    pod = pod_of(job)
    assert [c["name"] for c in pod["containers"]] == ["worker", "proxy"]
    assert pod["containers"][1] == sidecar
    assert pod["initContainers"] == init
    worker = worker_of(job)
    assert worker["image"] == "me/worker:1"
    assert worker["envFrom"] == [{"secretRef": {"name": "k"}}]
    assert worker["resources"] == {"limits": {"cpu": "1"}}
    assert [e["name"] for e in worker["env"]] == [
        "JOBRUNNER_DATABASE_URL", "JOBRUNNER_WORKER_ID", "JOBRUNNER_BATCH_ID", "X"]
    # sidecars get no security defaults of the worker's container, only the pod's
    assert "securityContext" not in pod["containers"][1]


def test_every_template_field_reaches_the_job():
    """A field accepted by the manifest and the CRD but dropped by build_job would be a
    silent no-op for users: each one must change the Job."""
    samples: dict[str, Any] = {
        "image": "x:1", "imagePullPolicy": "Always", "imagePullSecrets": [{"name": "r"}],
        "serviceAccountName": "sa", "resources": {"requests": {"cpu": "1"}},
        "env": [{"name": "A", "value": "b"}], "envFrom": [{"configMapRef": {"name": "c"}}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/scratch"}],
        "containerSecurityContext": {"runAsUser": 5}, "labels": {"l": "v"},
        "annotations": {"a": "v"}, "nodeSelector": {"n": "v"},
        "tolerations": [{"operator": "Exists"}], "affinity": {"podAntiAffinity": {}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "k",
                                       "whenUnsatisfiable": "DoNotSchedule"}],
        "priorityClassName": "p", "runtimeClassName": "r", "hostNetwork": True,
        "dnsPolicy": "Default", "securityContext": {"fsGroup": 3},
        "volumes": [{"name": "v", "emptyDir": {}}],
        "containers": [{"name": "s", "image": "s:1"}],
        "initContainers": [{"name": "i", "image": "i:1"}],
        "terminationGracePeriodSeconds": 6,
    }
    assert set(samples) == TEMPLATE_FIELDS
    base = job_for()
    for key, value in samples.items():
        assert job_for({key: value}) != base, key


# ------------------------------------------------------------------------------ the CRD
def _crd_template() -> dict[str, Any]:
    crd = yaml.safe_load((REPO / "crds" / "batchrun.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["template"]


def test_crd_template_fields_are_the_manifests_and_all_described():
    template = _crd_template()
    assert set(template["properties"]) == TEMPLATE_FIELDS
    assert template.get("description")
    for name, prop in template["properties"].items():
        assert prop.get("description"), f"spec.template.{name} has no description"
        if prop.get("type") == "object" and "additionalProperties" not in prop:
            assert prop.get("x-kubernetes-preserve-unknown-fields") or prop.get("properties")


def test_crd_lists_used_by_cel_rules_are_bounded():
    """The API server estimates each CEL rule's cost from maxItems/maxLength and refuses a
    CRD whose rules could be too expensive; unbounded lists under a rule would do that."""
    props = _crd_template()["properties"]
    for name in ("volumes", "volumeMounts", "containers", "initContainers"):
        assert props[name]["maxItems"] <= 64, name
        keys = props[name]["x-kubernetes-list-map-keys"]
        for key in keys:
            assert props[name]["items"]["properties"][key]["maxLength"], (name, key)
            assert key in props[name]["items"]["required"]
    for name in ("containers", "initContainers"):
        rules = [r["rule"] for r in props[name]["x-kubernetes-validations"]]
        assert "self.all(c, c.name != 'worker')" in rules


def test_crd_enums_and_limits_match_the_manifest():
    props = _crd_template()["properties"]
    assert props["dnsPolicy"]["enum"] == list(manifest.DNS_POLICIES)
    assert props["imagePullPolicy"]["enum"] == list(manifest.PULL_POLICIES)
    assert props["hostNetwork"]["type"] == "boolean"
    spread = props["topologySpreadConstraints"]["items"]["properties"]
    assert spread["whenUnsatisfiable"]["enum"] == list(manifest.WHEN_UNSATISFIABLE)
    assert {k: props[k]["maxItems"] for k in manifest.LIST_LIMITS} == manifest.LIST_LIMITS


SCHEMA_KEYS = {
    "type", "description", "properties", "items", "required", "enum", "default", "format",
    "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "minProperties",
    "pattern",
    "additionalProperties", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}


def test_crd_schema_nodes_use_only_schema_keywords():
    """A stray comma in a YAML flow mapping (`{description: a, b}`) silently makes a key
    `b` with no value; the API server would then refuse the CRD."""
    crd = yaml.safe_load((REPO / "crds" / "batchrun.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def walk(node: dict[str, Any], path: str) -> None:
        assert set(node) <= SCHEMA_KEYS, (path, set(node) - SCHEMA_KEYS)
        for name, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    walk(schema, "")


def test_api_error_detail_reads_the_status_message():
    from jobrunner.operator.kube import ApiError

    exc = ApiError.from_body(422, "Unprocessable Entity", json.dumps(
        {"kind": "Status", "message": 'Job.batch "x" is invalid: '
         "spec.template.spec.volumes[1]: Required value: must specify a volume type"}))
    assert exc.status == 422 and exc.reason == "Unprocessable Entity"
    assert api_error_detail(exc).endswith("must specify a volume type")
    for body in (None, "not json", "[]", json.dumps({"message": ""})):
        exc = ApiError.from_body(422, "Unprocessable Entity", body)
        assert api_error_detail(exc) == "Unprocessable Entity"


def test_the_operator_docs_template_example_builds():
    text = (REPO / "docs" / "operator.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "template:" in b]
    template = yaml.safe_load(block)["spec"]["template"]
    pod = pod_of(job_for(template))
    assert [c["name"] for c in pod["initContainers"]] == ["db-proxy"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}} in pod["volumes"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_termination_grace_sets_the_pods_and_two_thirds_of_it_for_the_worker():
    default = job_for()["spec"]["template"]["spec"]
    assert default["terminationGracePeriodSeconds"] == 45
    argv = default["containers"][0]["command"]
    assert argv[argv.index("--grace-period") + 1] == "30"
    short = job_for({"terminationGracePeriodSeconds": 6})["spec"]["template"]["spec"]
    assert short["terminationGracePeriodSeconds"] == 6
    argv = short["containers"][0]["command"]
    assert argv[argv.index("--grace-period") + 1] == "4"


# ------------------------------------------------------------------------------ metrics
def test_workers_serve_metrics_on_the_configured_port(monkeypatch):
    import dataclasses

    from jobrunner.operator import jobs

    assert "ports" not in worker_of(job_for())  # (off by default)
    assert "JOBRUNNER_METRICS_PORT" not in {e["name"] for e in worker_of(job_for())["env"]}
    monkeypatch.setattr(jobs, "CONFIG", dataclasses.replace(jobs.CONFIG,
                                                            worker_metrics_port=9090))
    worker = worker_of(job_for())
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    assert {"name": "JOBRUNNER_METRICS_PORT", "value": "9090"} in worker["env"]
