"""The Helm chart on the real control plane: lint/template/schema, then install, run the
example with the controller Deployment's own pod (the process kubelet runs it with the
chart's ServiceAccount token, so the chart's RBAC is proven by real use), `kubectl auth
can-i` for that ServiceAccount, an upgrade mid-run, uninstall, and a cluster-wide install.

The tests of this module share one release and run in file order (-x recommended)."""

from __future__ import annotations

import base64
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from jobrunner.queue.client import Queue

from .harness.procs import free_port
from .operator_support import (
    REPO,
    batchrun,
    create_db_secret,
    create_namespace,
    get,
    jobs_of,
    wait_phase,
)

CHART = REPO / "charts" / "jobrunner"
EXAMPLE = REPO / "examples" / "summarise.yaml"
RELEASE = "jr"
FULLNAME = f"{RELEASE}-jobrunner"
# What the API server says when RBAC denies a request.
RBAC_DENIED = re.compile(r'forbidden: User "[^"]+" cannot', re.IGNORECASE)
FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}

# Non-default values exercising every switch of the chart.
CUSTOM_VALUES = {
    "fullnameOverride": "batch-ctl",
    "image": {"repository": "registry.example/jobrunner", "tag": "1.2.3",
              "digest": "sha256:" + "a" * 64, "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watch": {"namespaces": ["team-a", "team-b"]},
    "controller": {"replicas": 0, "logLevel": "debug", "logFormat": "text", "metricsPort": 9090,
                   "healthPort": 9091, "refreshSeconds": 2.5, "priority": 10,
                   "podAnnotations": {"a": "b"}, "nodeSelector": {"pool": "system"},
                   "tolerations": [{"key": "k", "operator": "Exists"}],
                   "extraEnv": [{"name": "X", "value": "extra"}]},
    "serviceAccount": {"name": "ctl", "annotations": {"iam": "role"}},
    "rbac": {"secretNames": ["pg-a", "pg-b"]},
    "peering": {"name": "fleet"},
    "database": {"secretName": "pg-a", "secretKey": "url"},
    "worker": {"image": "registry.example/workers:7", "pullPolicy": "IfNotPresent",
               "serviceAccount": {"create": True}},
    "metrics": {"service": {"port": 9999}, "serviceMonitor": {"enabled": True,
                                                               "labels": {"release": "prom"}}},
    "postgresql": {"enabled": True, "persistence": {"enabled": True, "size": "5Gi"}},
}


# ----------------------------------------------------------------------------- helpers
def render(k8s, *args: str, namespace: str = "jr-system") -> list[dict[str, Any]]:
    out = k8s.helm("template", RELEASE, str(CHART), "-n", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str | None = None,
         namespace: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)
            and (namespace is None or d["metadata"].get("namespace") == namespace)]


def controller_pods(k8s, namespace: str, release: str = RELEASE) -> list[dict]:
    out = k8s.kubectl("get", "pods", "-n", namespace, "-o", "json", "-l",
                      f"app.kubernetes.io/instance={release},"
                      "app.kubernetes.io/component=controller").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def wait_for(what: str, predicate, timeout: float = 90, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class PodLog:
    """`output()` for wait_phase's failure message: the controller pod's log."""

    def __init__(self, k8s, namespace: str, release: str = RELEASE) -> None:
        self.k8s, self.namespace, self.release = k8s, namespace, release

    def output(self) -> str:
        text = []
        for pod in controller_pods(self.k8s, self.namespace, self.release):
            try:
                text.append(self.k8s.pod_log(self.namespace, pod["metadata"]["name"]))
            except FileNotFoundError:
                pass
        return "\n".join(text)


def jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


SA_TOKEN = "secrets/kubernetes.io/serviceaccount/token"  # under /var/run


def process_credentials(k8s, namespace: str, pod: str) -> dict[str, Any]:
    """The Kubernetes identity the container's process really uses: the token the kubelet
    projected into its filesystem, read from the host through /proc/PID/root."""
    (pid,) = k8s.node.pod_pids(namespace, pod).values()
    env = dict(item.split("=", 1) for item in
               Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
    root = Path(f"/proc/{pid}/root")
    # /var/run is an absolute symlink to /run in Debian: resolve it inside the container
    var_run = root / "var" / "run"
    if var_run.is_symlink():
        var_run = root / os.readlink(var_run).lstrip("/")
    claims = jwt_claims((var_run / SA_TOKEN).read_text().strip())
    return {"env": env, "user": claims["kubernetes.io"]["serviceaccount"]["name"],
            "claims": claims}


def can_i(k8s, namespace: str | None, sa: str, *args: str) -> bool:
    scope = ["-n", namespace] if namespace else ["--all-namespaces"]
    r = k8s.kubectl("auth", "can-i", *args, *scope, f"--as={sa}", check=False)
    assert r.stdout.strip() in ("yes", "no"), (args, r.stdout, r.stderr)
    return r.stdout.strip() == "yes"


def permissions(k8s, namespace: str, user: str) -> dict[str, set[str]]:
    """`kubectl auth can-i --list` as {resource[/name]: verbs} (resource rules only)."""
    listing = k8s.kubectl("auth", "can-i", "--list", "-n", namespace, f"--as={user}").stdout
    granted: dict[str, set[str]] = {}
    for line in listing.splitlines()[1:]:
        match = re.match(r"(\S+)\s+\[([^\]]*)\]\s+\[([^\]]*)\]\s+\[([^\]]*)\]", line)
        if not match or match.group(2):
            continue  # non-resource URLs (discovery, health: open to every account)
        resource, names, verbs = match.group(1), match.group(3), match.group(4)
        key = f"{resource}/{names}" if names else resource
        granted.setdefault(key, set()).update(verbs.split())
    return granted


def helm_install(k8s, namespace: str, *sets: str, release: str = RELEASE):
    metrics, health = free_port(), free_port()
    return k8s.helm(
        "install", release, str(CHART), "-n", namespace, "--wait", "--timeout", "3m",
        "--set", f"controller.metricsPort={metrics}", "--set", f"controller.healthPort={health}",
        "--set", "controller.refreshSeconds=1", "--set", "controller.logFormat=text",
        "--set", "image.repository=jobrunner", "--set", "image.tag=e2e",
        "--set", "image.pullPolicy=Never", *node_values(k8s), *sets)


def node_values(k8s) -> list[str]:
    """The test node has no pod network: controller and workers on the host network, the
    controller reaching the API server at 127.0.0.1 (not the Service's ClusterIP)."""
    sets = ["--set", "controller.hostNetwork=true", "--set", "worker.hostNetwork=true"]
    for i, env in enumerate(k8s.in_cluster_env()):
        sets += ["--set", f"controller.extraEnv[{i}].name={env['name']}",
                 "--set-string", f"controller.extraEnv[{i}].value={env['value']}"]
    return sets


def new_namespace(k8s) -> str:
    return create_namespace(k8s, "h-" + uuid.uuid4().hex[:8])


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def db(pg_admin_dsn: str, template_db: str):
    """One migrated database for the module's release (the `dsn` fixture is per test)."""
    name = f"jr_helm_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    params = conninfo_to_dict(pg_admin_dsn)
    params["dbname"] = name
    yield make_conninfo(**params)
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def release(k8s, db):
    """`helm install` of the chart with its defaults (release namespace only, peering on),
    the database Secret created first, as NOTES.txt tells users to."""
    namespace = new_namespace(k8s)
    create_db_secret(k8s, namespace, db)
    installed = helm_install(k8s, namespace)
    yield {"namespace": namespace, "install": installed, "log": PodLog(k8s, namespace)}
    k8s.kubectl("delete", "batchruns", "--all", "-n", namespace, "--timeout=60s", check=False)
    k8s.helm("uninstall", RELEASE, "-n", namespace, check=False)
    k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# ----------------------------------------------------------------------------- static
def test_lint_and_template_with_default_and_custom_values(k8s, tmp_path):
    custom = tmp_path / "custom.yaml"
    custom.write_text(yaml.safe_dump(CUSTOM_VALUES))
    for args in ([], ["-f", str(custom)], ["--set", "watch.clusterWide=true"]):
        lint = k8s.helm("lint", "--strict", str(CHART), *args)
        assert "1 chart(s) linted, 0 chart(s) failed" in lint.stdout, lint.stdout

    docs = render(k8s)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ServiceAccount", "Role", "RoleBinding", "Service", "Deployment",
                            "KopfPeering"]), kinds
    assert render(k8s) == docs, "rendering is not deterministic (GitOps would flap)"
    (deploy,) = find(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert ctr["command"] == ["jobrunner-controller"]
    assert "--namespace=jr-system" in ctr["args"] and "--peering=jr-jobrunner" in ctr["args"]
    sc = ctr["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] and pod["serviceAccountName"] == FULLNAME
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ctr["resources"]["requests"] and ctr["resources"]["limits"]["memory"]
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["JOBRUNNER_DB_SECRET_NAME"] == "jobrunner-db"
    assert env["JOBRUNNER_DB_SECRET_KEY"] == "dsn"
    assert "JOBRUNNER_WORKER_SERVICE_ACCOUNT" not in env
    (sa,) = find(docs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False  # only the controller pod mounts it
    (role,) = find(docs, "Role", namespace="jr-system")
    secret_rules = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secret_rules == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    verbs = {v for r in role["rules"] for v in r["verbs"]}
    assert not verbs & {"deletecollection", "*", "escalate", "bind", "impersonate"}
    # delete only on BatchRuns (a schedule's Replace and history limits), nothing else
    assert {tuple(r["resources"]) for r in role["rules"] if "delete" in r["verbs"]} == {
        ("batchruns",)}
    assert not any("*" in r["resources"] or "*" in r["apiGroups"] for r in role["rules"])
    assert not any(d["kind"] == "Secret" for d in docs)  # no secret by default

    docs = render(k8s, "-f", str(custom))
    (deploy,) = find(docs, "Deployment", "batch-ctl")
    (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
    assert ctr["image"] == "registry.example/jobrunner@sha256:" + "a" * 64
    assert [a for a in ctr["args"] if a.startswith("--namespace")] == [
        "--namespace=team-a", "--namespace=team-b"]
    assert "--peering=fleet" in ctr["args"] and "--priority=10" in ctr["args"]
    assert "--metrics-port=9090" in ctr["args"] and "--log-level=debug" in ctr["args"]
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["JOBRUNNER_WORKER_IMAGE"] == "registry.example/workers:7"
    assert env["JOBRUNNER_WORKER_SERVICE_ACCOUNT"] == "batch-ctl-worker" and env["X"] == "extra"
    assert env["JOBRUNNER_DB_SECRET_KEY"] == "url"
    assert deploy["spec"]["replicas"] == 0
    # namespaces other than the release's: a guarded RoleBinding to a ClusterRole each
    assert not find(docs, "Role")
    assert {r["metadata"]["namespace"] for r in find(docs, "KopfPeering")} == {"team-a", "team-b"}
    bindings = find(docs, "RoleBinding")
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    for binding in bindings:
        assert binding["metadata"]["name"] == "batch-ctl-controller"
        assert binding["metadata"]["finalizers"] == ["jobrunner.dev/controller-access"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": "ClusterRole", "name": "jr-system-batch-ctl"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ctl",
                                        "namespace": "jr-system"}]
    (role,) = find(docs, "ClusterRole", "jr-system-batch-ctl")
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
            "resourceNames": ["pg-a", "pg-b"]} in role["rules"]
    assert {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"],
            "verbs": ["get", "patch"], "resourceNames": ["batch-ctl-controller"]} in role["rules"]
    assert not find(docs, "ClusterRoleBinding")
    (hook,) = find(docs, "Job")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    hook_pod = hook["spec"]["template"]["spec"]
    assert hook_pod["serviceAccountName"] == "ctl"
    assert hook_pod["containers"][0]["command"] == ["jobrunner-controller",
                                                    "--release-rbac-guard"]
    hook_env = {e["name"]: e.get("value") for e in hook_pod["containers"][0]["env"]}
    assert hook_env["JOBRUNNER_RBAC_GUARD_NAMESPACES"] == "team-a,team-b"
    assert env["JOBRUNNER_RBAC_GUARD"] == hook_env["JOBRUNNER_RBAC_GUARD"] == (
        "batch-ctl-controller")
    workers = find(docs, "ServiceAccount", "batch-ctl-worker")
    assert {w["metadata"]["namespace"] for w in workers} == {"team-a", "team-b"}
    assert all(w["automountServiceAccountToken"] is False for w in workers)
    assert not find(docs, "Role", "batch-ctl-worker")  # workers get no API access at all
    (monitor,) = find(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (sts,) = find(docs, "StatefulSet")
    assert "not-for-production" in json.dumps(sts["metadata"]["annotations"])
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    dsn_secrets = find(docs, "Secret", "pg-a")
    assert {s["metadata"]["namespace"] for s in dsn_secrets} == {"team-a", "team-b"}

    docs = render(k8s, "--set", "watch.clusterWide=true")
    assert {d["kind"] for d in docs} >= {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    assert not find(docs, "Role") and not find(docs, "KopfPeering")
    (deploy,) = find(docs, "Deployment")
    assert "--all-namespaces" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    (crole,) = find(docs, "ClusterRole")
    assert any(r["resources"] == ["clusterkopfpeerings"] for r in crole["rules"])


@pytest.mark.parametrize(("value", "message"), [
    ("controller.replicas=2", "/controller/replicas"),
    ("controller.logLevel=verbose", "/controller/logLevel"),
    ("database.password=hunter2", "additional properties 'password' not allowed"),
    ("watch.namespaces={Not_A_Namespace}", "/watch/namespaces/0"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("controller.metricsPort=70000", "/controller/metricsPort"),
])
def test_bad_values_are_rejected_by_the_schema(k8s, value, message):
    r = k8s.helm("template", RELEASE, str(CHART), "--set", value, check=False)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert message in r.stderr, r.stderr


def test_exclusive_watch_settings_fail_with_a_message(k8s):
    r = k8s.helm("template", RELEASE, str(CHART), "--set", "watch.clusterWide=true",
                 "--set", "worker.serviceAccount.create=true", check=False)
    assert r.returncode != 0 and "worker.serviceAccount.create needs a namespace list" in r.stderr


# ----------------------------------------------------------------------------- cluster
def test_install_runs_the_example_with_the_charts_service_account(k8s, release, db):
    ns, log = release["namespace"], release["log"]
    installed = release["install"].stdout
    assert "STATUS: deployed" in installed
    assert "delete the BatchRuns FIRST" in installed and "keeps the CRDs" in installed
    for crd in ("batchruns.jobrunner.dev", "kopfpeerings.kopf.dev",
                "clusterkopfpeerings.kopf.dev"):
        k8s.kubectl("get", "crd", crd)

    (pod,) = controller_pods(k8s, ns)
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    assert pod["status"]["phase"] == "Running"
    creds = wait_for("the controller process", lambda: k8s.node.pod_pids(
        ns, pod["metadata"]["name"]) and process_credentials(k8s, ns, pod["metadata"]["name"]))
    # the process runs with the chart's ServiceAccount token, not the admin's certificate
    assert creds["claims"]["sub"] == f"system:serviceaccount:{ns}:{FULLNAME}"
    assert creds["user"] == FULLNAME

    k8s.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    br = wait_phase(k8s, "summarise-stdlib-docs", ns, ("Succeeded", "Failed"), timeout=300,
                    controller=log)
    assert br["status"]["phase"] == "Succeeded", br["status"]
    assert br["status"]["counts"]["done"] == 48
    assert len(jobs_of(k8s, ns)) == 1
    peering = get(k8s, "kopfpeering", FULLNAME, ns)
    assert peering is not None
    output = log.output()
    assert not RBAC_DENIED.search(output), output[-3000:]

    # GitOps: re-applying the unchanged manifest changes nothing, no status flapping
    again = k8s.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    assert "unchanged" in again.stdout
    time.sleep(3)  # three refresh periods
    after = get(k8s, "batchrun", "summarise-stdlib-docs", ns)
    assert after["metadata"]["resourceVersion"] == br["metadata"]["resourceVersion"]

    printed = k8s.kubectl("get", "br", "-n", ns).stdout
    assert re.search(r"summarise-stdlib-docs\s+Succeeded\s+48\s+48\s+0\s+4", printed), printed
    print(f"\n$ helm install {RELEASE} charts/jobrunner -n {ns} --wait ...\n{installed}"
          f"$ kubectl apply -n {ns} -f examples/summarise.yaml\n"
          f"$ kubectl get br -n {ns}\n{printed}")


def test_the_other_options_pass_the_api_servers_validation(k8s, release, namespace):
    """The demo PostgreSQL, a namespace list, worker ServiceAccounts, cluster-wide RBAC:
    a server-side dry run validates every object against the real API server."""
    for sets in (["--set", "postgresql.enabled=true", "--set",
                  "postgresql.persistence.enabled=true", "--set",
                  f"watch.namespaces={{{namespace},{release['namespace']}}}",
                  "--set", "worker.serviceAccount.create=true", "--set", "peering.name=other",
                  "--set", "database.secretName=demo-db", "--set", "rbac.secretNames={demo-db}"],
                 ["--set", "watch.clusterWide=true", "--set", "postgresql.enabled=true"]):
        r = k8s.helm("install", "dry", str(CHART), "-n", namespace, "--dry-run=server", *sets,
                     check=False)
        assert r.returncode == 0, r.stderr
        assert "NOT FOR PRODUCTION" in r.stdout
    assert k8s.helm("list", "-n", namespace, "-q").stdout.strip() == ""


def test_controller_rbac_is_exactly_what_it_needs(k8s, release):
    ns = release["namespace"]
    sa = f"system:serviceaccount:{ns}:{FULLNAME}"
    allowed = [
        ("get", "batchruns.jobrunner.dev"), ("list", "batchruns.jobrunner.dev"),
        ("watch", "batchruns.jobrunner.dev"), ("patch", "batchruns.jobrunner.dev"),
        ("create", "batchruns.jobrunner.dev"), ("delete", "batchruns.jobrunner.dev"),
        ("get", "batchrunschedules.jobrunner.dev"), ("list", "batchrunschedules.jobrunner.dev"),
        ("watch", "batchrunschedules.jobrunner.dev"),
        ("patch", "batchrunschedules.jobrunner.dev", "--subresource=status"),
        ("get", "batchruns.jobrunner.dev", "--subresource=status"),
        ("patch", "batchruns.jobrunner.dev", "--subresource=status"),
        ("update", "batchruns.jobrunner.dev", "--subresource=status"),
        ("update", "batchruns.jobrunner.dev", "--subresource=finalizers"),
        ("get", "jobs.batch"), ("create", "jobs.batch"), ("patch", "jobs.batch"),
        ("get", "deployments.apps"), ("create", "deployments.apps"),
        ("patch", "deployments.apps"), ("watch", "workerpools.jobrunner.dev"),
        ("patch", "workerpools.jobrunner.dev/status"),
        ("create", "events"), ("patch", "events"),
        ("create", "events.events.k8s.io"), ("patch", "events.events.k8s.io"),
        ("get", "pods"), ("list", "pods"), ("watch", "pods"),
        ("get", "secrets/jobrunner-db"), ("get", "configmaps"),
        ("list", "kopfpeerings.kopf.dev"), ("watch", "kopfpeerings.kopf.dev"),
        ("get", f"kopfpeerings.kopf.dev/{FULLNAME}"),
        ("patch", f"kopfpeerings.kopf.dev/{FULLNAME}"),
    ]
    denied = [
        ("list", "secrets"), ("watch", "secrets"), ("create", "secrets"),
        ("create", "pods", "--subresource=exec"), ("create", "pods"), ("delete", "pods"),
        ("delete", "jobs.batch"), ("update", "jobs.batch"), ("list", "jobs.batch"),
        ("update", "batchruns.jobrunner.dev"), ("create", "batchrunschedules.jobrunner.dev"),
        ("delete", "batchrunschedules.jobrunner.dev"),
        ("patch", "kopfpeerings.kopf.dev/someone-else"), ("create", "kopfpeerings.kopf.dev"),
        ("list", "configmaps"), ("watch", "configmaps"), ("update", "configmaps"),
        ("create", "roles.rbac.authorization.k8s.io"),
        ("create", "rolebindings.rbac.authorization.k8s.io"),
        ("impersonate", "serviceaccounts"), ("create", "serviceaccounts", "--subresource=token"),
        ("delete", "deployments.apps"), ("list", "deployments.apps"),
        ("update", "deployments.apps"), ("delete", "workerpools.jobrunner.dev"),
        ("create", "workerpools.jobrunner.dev"),
    ]
    for check in allowed:
        assert can_i(k8s, ns, sa, *check), f"the controller may not {check} in {ns}"
    for check in denied:
        assert not can_i(k8s, ns, sa, *check), f"the controller may {check} in {ns}"
    # nothing outside its namespace, nothing cluster-wide
    for check in [("list", "secrets"), ("get", "secrets"), ("list", "batchruns.jobrunner.dev"),
                  ("delete", "namespaces"), ("list", "namespaces"),
                  ("list", "customresourcedefinitions.apiextensions.k8s.io"),
                  ("list", "clusterkopfpeerings.kopf.dev"), ("list", "nodes")]:
        assert not can_i(k8s, None, sa, *check), f"the controller may {check} cluster-wide"
    for check in [("get", "secrets"), ("get", "batchruns.jobrunner.dev"), ("create", "jobs.batch")]:
        assert not can_i(k8s, "kube-system", sa, *check), f"the controller may {check} elsewhere"

    # the complete list of what it may do in its namespace, beyond what any account may
    baseline = permissions(k8s, ns, f"system:serviceaccount:{ns}:no-such-account")
    granted = {key: verbs - baseline.get(key, set())
               for key, verbs in permissions(k8s, ns, sa).items()}
    granted = {key: verbs for key, verbs in granted.items() if verbs}
    assert granted == {
        "batchruns.jobrunner.dev": {"get", "list", "watch", "patch", "create", "delete"},
        "batchrunschedules.jobrunner.dev": {"get", "list", "watch", "patch"},
        "batchrunschedules.jobrunner.dev/status": {"get", "patch", "update"},
        "batchrunschedules.jobrunner.dev/finalizers": {"update"},
        "batchruns.jobrunner.dev/status": {"get", "patch", "update"},
        "batchruns.jobrunner.dev/finalizers": {"update"},
        "jobs.batch": {"get", "create", "patch"},
        "workerpools.jobrunner.dev": {"get", "list", "watch", "patch"},
        "workerpools.jobrunner.dev/status": {"get", "patch", "update"},
        "deployments.apps": {"get", "create", "patch"},
        "events": {"create", "patch"},
        "events.events.k8s.io": {"create", "patch"},
        "pods": {"get", "list", "watch"},
        "secrets": {"get"},
        "configmaps": {"get"},
        "kopfpeerings.kopf.dev": {"list", "watch"},
        f"kopfpeerings.kopf.dev/{FULLNAME}": {"get", "patch"},
    }, granted


def test_upgrade_rolls_the_controller_without_losing_an_inflight_run(k8s, release, db):
    ns, log = release["namespace"], release["log"]
    deploy = json.loads(k8s.kubectl("get", "deploy", FULLNAME, "-n", ns, "-o", "json").stdout)
    (before,) = controller_pods(k8s, ns)

    # unchanged values: nothing rolls (GitOps re-sync is a no-op)
    k8s.helm("upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values", "--wait",
             "--timeout", "2m")
    same = json.loads(k8s.kubectl("get", "deploy", FULLNAME, "-n", ns, "-o", "json").stdout)
    assert same["metadata"]["generation"] == deploy["metadata"]["generation"]
    assert [p["metadata"]["uid"] for p in controller_pods(k8s, ns)] == [before["metadata"]["uid"]]

    k8s.kubectl("apply", "-n", ns, "-f", "-", input=batchrun("inflight", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 60, "payload": {"sleep": 0.5}}, **FAST}))
    br = wait_phase(k8s, "inflight", ns, ("Running",), controller=log)
    wait_for("the first tasks", lambda: (get(k8s, "br", "inflight", ns)["status"].get(
        "counts") or {}).get("done", 0) >= 2, timeout=60)
    job = next(j for j in jobs_of(k8s, ns) if j["metadata"]["name"] == br["status"]["jobName"])

    pre = get(k8s, "br", "inflight", ns)["status"]
    assert pre["phase"] == "Running" and pre["counts"]["done"] < 60, pre
    k8s.helm("upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values", "--wait",
             "--timeout", "2m", "--set", "controller.logLevel=debug")
    (after,) = wait_for("the new controller pod", lambda: [
        p for p in controller_pods(k8s, ns) if p["status"].get("phase") == "Running"])
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    assert "--log-level=debug" in after["spec"]["containers"][0]["args"]
    assert get(k8s, "pod", before["metadata"]["name"], ns) is None  # Recreate: old one gone

    status = wait_phase(k8s, "inflight", ns, ("Succeeded", "Failed"), timeout=180,
                        controller=log)["status"]
    assert status["phase"] == "Succeeded", status
    jobs = [j for j in jobs_of(k8s, ns) if j["metadata"]["name"] == status["jobName"]]
    assert len(jobs) == 1 and jobs[0]["metadata"]["uid"] == job["metadata"]["uid"]
    assert status["counts"]["total"] == 60 and status["counts"]["done"] == 60
    with psycopg.connect(db) as conn:
        tasks = conn.execute("SELECT count(*), count(DISTINCT task_key) FROM agent_work_queue"
                             " WHERE batch_id = %s", (status["batchId"],)).fetchone()
        # exec_log: one row per handler execution (only this run uses that handler)
        runs = conn.execute("SELECT count(*), count(DISTINCT task_key) FROM exec_log"
                            ).fetchone()
    assert tasks == (60, 60)
    assert runs[0] == runs[1] == 60, f"tasks ran more than once: {runs}"


def test_uninstall_leaves_nothing_but_the_crds(k8s, release):
    ns = release["namespace"]
    # BatchRuns first, while the controller still runs to remove their finalizer
    k8s.kubectl("delete", "batchruns", "--all", "-n", ns, "--timeout=90s")
    out = k8s.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "2m").stdout
    assert f'release "{RELEASE}" uninstalled' in out, out

    def leftovers() -> list[str]:
        names = k8s.kubectl(
            "get", "deploy,rs,pods,svc,sa,secrets,configmaps,roles,rolebindings,jobs,"
            "batchruns,kopfpeerings", "-n", ns, "-o", "name").stdout.split()
        expected = {"serviceaccount/default", "secret/jobrunner-db",  # the test's own
                    "configmap/kube-root-ca.crt"}
        return [n for n in names if n not in expected]

    left = wait_for("the release's objects to go", lambda: not leftovers() or None,
                    timeout=90) and leftovers()
    assert left == []
    selector = f"app.kubernetes.io/instance={RELEASE}"
    assert k8s.kubectl("get", "clusterroles,clusterrolebindings,clusterkopfpeerings", "-l",
                       selector, "-o", "name").stdout.strip() == ""
    assert k8s.helm("list", "-n", ns, "-q").stdout.strip() == ""
    for crd in ("batchruns.jobrunner.dev", "kopfpeerings.kopf.dev"):
        k8s.kubectl("get", "crd", crd)  # kept, as Helm does with crds/ (and NOTES says so)


def test_watched_namespaces_can_be_deleted_and_the_release_uninstalled(k8s, db):
    """watch.namespaces beyond the release's (peering on, the Deployment's own pod): the
    guarded RoleBinding gives the controller exactly its rules there; deleting a watched
    namespace with a running BatchRun completes; `helm uninstall --wait` completes (its
    pre-delete hook drops the bindings' finalizer) and leaves no binding behind."""
    home, app, kept = new_namespace(k8s), new_namespace(k8s), new_namespace(k8s)
    release, fullname = "jrw", "jrw-jobrunner"
    guard = f"{fullname}-controller"
    try:
        for ns in (app, kept):
            create_db_secret(k8s, ns, db)
        helm_install(k8s, home, "--set", f"watch.namespaces={{{home},{app},{kept}}}",
                     release=release)
        log = PodLog(k8s, home, release)
        sa = f"system:serviceaccount:{home}:{fullname}"
        for ns in (app, kept):
            binding = get(k8s, "rolebinding", guard, ns)
            assert binding["metadata"]["finalizers"] == ["jobrunner.dev/controller-access"]
            assert can_i(k8s, ns, sa, "patch", f"rolebindings.rbac.authorization.k8s.io/{guard}")
            assert not can_i(k8s, ns, sa, "patch", "rolebindings.rbac.authorization.k8s.io")
            assert can_i(k8s, ns, sa, "get", "secrets/jobrunner-db")
            assert not can_i(k8s, ns, sa, "list", "secrets")
        assert not can_i(k8s, home, sa, "patch",
                         f"rolebindings.rbac.authorization.k8s.io/{guard}")
        assert not can_i(k8s, None, sa, "list", "batchruns.jobrunner.dev")

        k8s.kubectl("apply", "-n", app, "-f", "-", input=batchrun("doomed", {
            "tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
            "shardRange": {"count": 100, "payload": {"sleep": 1}}, **FAST}))
        batch_id = wait_phase(k8s, "doomed", app, ("Running",), controller=log)[
            "status"]["batchId"]
        assert not RBAC_DENIED.search(log.output())  # the ClusterRole's rules suffice
        r = k8s.kubectl("delete", "namespace", app, "--timeout=120s", timeout=150,
                        check=False)
        gone = k8s.kubectl("get", "namespace", app, check=False)
        assert "NotFound" in gone.stderr, (r.stderr, gone.stdout, log.output()[-3000:])
        with psycopg.connect(db, row_factory=dict_row) as conn:
            counts = Queue(conn).counts(batch_id)
        assert counts["pending"] == 0 and counts["cancelled"] > 0, counts

        out = k8s.helm("uninstall", release, "-n", home, "--wait", "--timeout", "2m").stdout
        assert f'release "{release}" uninstalled' in out, out
        assert k8s.kubectl("get", "rolebindings,roles", "-n", kept, "-o", "name"
                           ).stdout.strip() == ""
        assert k8s.kubectl("get", "clusterroles,jobs", "-A", "-l",
                           f"app.kubernetes.io/instance={release}", "-o", "name"
                           ).stdout.strip() == ""
        k8s.kubectl("delete", "namespace", kept, "--timeout=60s", timeout=90)
    finally:
        k8s.helm("uninstall", release, "-n", home, "--no-hooks", check=False)
        for ns in (home, app, kept):
            k8s.kubectl("patch", "rolebinding", guard, "-n", ns, "--type=merge", "-p",
                        '{"metadata":{"finalizers":null}}', check=False)
            k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.exclusive  # (see tests/e2e/conftest.py)
def test_cluster_wide_install_runs_batchruns_in_any_namespace(k8s, db):
    home, app = new_namespace(k8s), new_namespace(k8s)
    release, fullname = "jrcw", "jrcw-jobrunner"
    try:
        create_db_secret(k8s, app, db)
        helm_install(k8s, home, "--set", "watch.clusterWide=true", release=release)
        log = PodLog(k8s, home, release)
        sa = f"system:serviceaccount:{home}:{fullname}"
        assert can_i(k8s, app, sa, "get", "secrets/jobrunner-db")
        assert can_i(k8s, None, sa, "list", "batchruns.jobrunner.dev")
        assert can_i(k8s, None, sa, "patch", f"clusterkopfpeerings.kopf.dev/{fullname}")
        assert not can_i(k8s, None, sa, "list", "secrets")
        assert not can_i(k8s, app, sa, "create", "pods", "--subresource=exec")
        assert not can_i(k8s, None, sa, "delete", "namespaces")
        assert not can_i(k8s, None, sa, "list", "kopfpeerings.kopf.dev")

        k8s.kubectl("apply", "-n", app, "-f", "-", input=batchrun("anywhere", {
            "tenant": "t", "workers": 1, "handler": "tests.support.handlers:noop",
            "shardRange": {"count": 5}, **FAST}))
        status = wait_phase(k8s, "anywhere", app, ("Succeeded", "Failed"), timeout=120,
                            controller=log)["status"]
        assert status["phase"] == "Succeeded" and status["counts"]["done"] == 5
        k8s.kubectl("get", "clusterkopfpeering", fullname)
        assert not RBAC_DENIED.search(log.output())

        k8s.kubectl("delete", "batchruns", "--all", "-n", app, "--timeout=90s")
        k8s.helm("uninstall", release, "-n", home, "--wait", "--timeout", "2m")
        assert k8s.kubectl("get", "clusterroles,clusterrolebindings,clusterkopfpeerings",
                           "-l", f"app.kubernetes.io/instance={release}", "-o", "name"
                           ).stdout.strip() == ""
    finally:
        k8s.kubectl("delete", "batchruns", "--all", "-n", app, "--timeout=30s", check=False)
        k8s.helm("uninstall", release, "-n", home, check=False)
        for ns in (home, app):
            k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)
