"""Static checks of the chart's `api` component (the Batch API, docs/batch-api.md): its
values and schema agree, the pods are hardened and probed, upstream keys only ever come
from Secrets, the Ingress is optional. When a helm binary is at hand (HELM, or the e2e
harness's cache) the template is also rendered and the objects checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import build

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "jobrunner"
TEMPLATE = CHART / "templates" / "api.yaml"
MODELS = {"llama": {"baseUrl": "http://vllm.models:8000/v1",
                    "apiKeySecret": {"name": "vllm-key", "key": "api-key"},
                    "inputCostPerToken": "0.0000001", "outputCostPerToken": "0.0000002"},
          "small": {"baseUrl": "http://llamacpp:8080/v1", "upstreamModel": "tiny"}}


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))


def test_api_values_validate_and_the_component_is_off_by_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["api"]["enabled"] is False and values["api"]["models"] == {}
    validator = _validator()
    validator.validate({**values, "api": {**values["api"], "enabled": True, "models": MODELS}})
    for bad in ({"m": {}},                                             # no baseUrl
                {"m": {"baseUrl": "vllm:8000"}},                       # not a URL
                {"m": {"baseUrl": "http://x/v1", "apiKey": "sk-..."}},  # a key in values
                {"m": {"baseUrl": "http://x/v1", "apiKeySecret": {"name": "s"}}},
                {"m": {"baseUrl": "http://x/v1", "inputCostPerToken": 0.1}}):  # not a string
        assert list(validator.iter_errors({**values, "api": {**values["api"], "models": bad}})), bad


def test_api_pods_are_hardened_and_probed():
    text = TEMPLATE.read_text()
    for line in ("runAsNonRoot: true", "allowPrivilegeEscalation: false", "privileged: false",
                 "readOnlyRootFilesystem: true", "drop: [ALL]", "type: RuntimeDefault",
                 "automountServiceAccountToken: false",
                 "httpGet: {path: /healthz, port: http}", "httpGet: {path: /readyz, port: http}"):
        assert line in text, line
    # every interface of the pod by default (the command's own default is 127.0.0.1)
    assert "- --host={{ .Values.api.host }}" in text
    assert yaml.safe_load((CHART / "values.yaml").read_text())["api"]["host"] == "0.0.0.0"


def test_upstream_keys_and_the_dsn_come_from_secrets_only():
    text = TEMPLATE.read_text()
    # the DSN (api), each route's key (workers), the console's CSRF key (api, optional)
    assert text.count("secretKeyRef") == 3
    assert "api_key_env:" in text and "api_key:" not in text
    assert ".Values.database.secretName" in text


def test_the_ingress_is_optional():
    text = TEMPLATE.read_text()
    start = text.index("{{- if .Values.api.ingress.enabled }}")
    assert text.index("kind: Ingress") > start
    assert text.index("{{- end }}", text.index("kind: Ingress")) > text.index("kind: Ingress")


def _helm() -> str | None:
    found = os.environ.get("HELM") or shutil.which("helm")
    if found:
        return found
    if build.go_available() or os.access(build.helm_dir() / "bin" / "helm", os.X_OK):
        build.ensure("helm")  # (`make test` builds it in the background: wait for it)
        return str(build.helm_dir() / "bin" / "helm")
    return None


def test_the_rendered_api_component():
    helm = _helm()
    if helm is None:
        pytest.skip("no helm binary (HELM, PATH or the e2e harness's cache)")
    out = subprocess.run(
        [helm, "template", "r", str(CHART), "--namespace", "ai", "--set", "api.enabled=true",
         "--set", "api.ingress.enabled=true", "--set", "api.ingress.host=batch.example.com",
         "--set-json", f"api.models={json.dumps(MODELS)}", "--show-only", "templates/api.yaml"],
        capture_output=True, text=True, check=True).stdout
    docs = {d["kind"]: d for d in yaml.safe_load_all(out) if d}
    assert set(docs) == {"ConfigMap", "Deployment", "Service", "Ingress", "WorkerPool"}
    routes = yaml.safe_load(docs["ConfigMap"]["data"]["routes.yaml"])["models"]
    assert routes["llama"] == {"base_url": "http://vllm.models:8000/v1",
                               "api_key_env": "JOBRUNNER_UPSTREAM_KEY_0",
                               "input_cost_per_token": "0.0000001",
                               "output_cost_per_token": "0.0000002"}
    assert routes["small"] == {"base_url": "http://llamacpp:8080/v1", "upstream_model": "tiny"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["jobrunner", "serve"]
    assert "--pool=ai/r-jobrunner-api" in container["args"]
    assert [e["name"] for e in container["env"]] == ["JOBRUNNER_DATABASE_URL"]  # no keys
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    pool = docs["WorkerPool"]["spec"]
    assert pool["handlers"] == ["jobrunner.openai_batch:handle"]
    env = {e["name"]: e for e in pool["template"]["env"]}
    assert env["JOBRUNNER_UPSTREAM_KEY_0"]["valueFrom"]["secretKeyRef"] == {
        "name": "vllm-key", "key": "api-key"}
    assert env["JOBRUNNER_MODEL_ROUTES"]["value"] == "/etc/jobrunner/routes/routes.yaml"
    rule = docs["Ingress"]["spec"]["rules"][0]
    assert rule["host"] == "batch.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"]["name"] == "r-jobrunner-api"


def test_the_console_trusts_proxy_headers_only_when_told():
    helm = _helm()
    if helm is None:
        pytest.skip("no helm binary (HELM, PATH or the e2e harness's cache)")

    def container(*sets: str) -> dict:
        args = [helm, "template", "r", str(CHART), "--set", "api.enabled=true",
                "--show-only", "templates/api.yaml"]
        for s in sets:
            args += ["--set", s]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        (deploy,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
        return deploy["spec"]["template"]["spec"]["containers"][0]

    default = container()
    assert not [a for a in default["args"] if "console" in a]  # (served, no proxy trust)
    assert [e["name"] for e in default["env"]] == ["JOBRUNNER_DATABASE_URL"]
    proxied = container("api.console.proxyAuth.enabled=true",
                        "api.console.proxyAuth.adminGroup=sre",
                        "api.console.proxyAuth.secretName=console-csrf")
    assert [a for a in proxied["args"] if "console" in a] == [
        "--console-proxy-auth", "--console-proxy-user-header=X-Forwarded-User",
        "--console-proxy-groups-header=X-Forwarded-Groups", "--console-proxy-admin-group=sre"]
    secret = {e["name"]: e for e in proxied["env"]}["JOBRUNNER_CONSOLE_SECRET"]
    assert secret["valueFrom"]["secretKeyRef"] == {"name": "console-csrf", "key": "secret"}
    assert "--no-console" in container("api.console.enabled=false")["args"]
