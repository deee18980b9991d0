"""Tests of the e2e harness itself: real API server, controller-manager and a real node
(containerd, runc, kubelet, kube-scheduler) running the image built from the Dockerfile."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import pytest

PY = "python"
IMAGE = "jobrunner:e2e"  # built from the Dockerfile into the node's containerd
NODE = "127.0.0.1"


def wait_for(cond, timeout=60.0, interval=0.25, what="condition"):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def get_json(k8s, *args):
    return json.loads(k8s.kubectl("get", *args, "-o", "json").stdout)


def apply(k8s, manifest: str, namespace: str | None = None, check=True):
    args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
    return k8s.kubectl(*args, input=textwrap.dedent(manifest), check=check)


def job_pods(k8s, ns, job):
    return get_json(k8s, "pods", "-n", ns, "-l", f"job-name={job}")["items"]


def job(
    name, command, parallelism=1, completions=1, backoff=0, deadline=None, restart="Never", extra=""
):
    dl = f"\n  activeDeadlineSeconds: {deadline}" if deadline else ""
    return f"""
apiVersion: batch/v1
kind: Job
metadata:
  name: {name}
spec:
  parallelism: {parallelism}
  completions: {completions}
  backoffLimit: {backoff}{dl}
  template:
    spec:
      restartPolicy: {restart}
      terminationGracePeriodSeconds: 5
      hostNetwork: true
      containers:
      - name: main
        image: {IMAGE}
        imagePullPolicy: Never
        command: {json.dumps(command)}
        env:
        - name: POD_NAME
          valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}{extra}
"""


def test_cluster_basics(k8s):
    nodes = get_json(k8s, "nodes")["items"]
    assert [n["metadata"]["name"] for n in nodes] == [NODE]
    ready = {c["type"]: c["status"] for c in nodes[0]["status"]["conditions"]}
    assert ready["Ready"] == "True"
    info = nodes[0]["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://2.")
    assert info["kubeletVersion"] == "v1.37.2"
    addresses = {a["type"]: a["address"] for a in nodes[0]["status"]["addresses"]}
    assert addresses["InternalIP"] == "127.0.0.1"
    ver = json.loads(k8s.kubectl("version", "-o", "json").stdout)
    assert ver["clientVersion"]["gitVersion"] == ver["serverVersion"]["gitVersion"]
    assert ver["serverVersion"]["gitVersion"].startswith("v1.")
    assert k8s.helm("version", "--short").stdout.startswith("v")
    # service-account tokens via the TokenRequest API
    tok = k8s.kubectl("create", "token", "default", "-n", "default").stdout.strip()
    assert tok.count(".") == 2


def test_job_parallelism_completes(k8s, namespace):
    code = "import os, time; time.sleep(2); print('hello from', os.environ['POD_NAME'], flush=True)"
    apply(k8s, job("par", [PY, "-c", code], parallelism=3, completions=3), namespace)
    # all three run at the same time
    wait_for(
        lambda: (
            sum(p["status"].get("phase") == "Running" for p in job_pods(k8s, namespace, "par")) == 3
        ),
        timeout=60,
        what="3 running pods",
    )
    k8s.kubectl("wait", "--for=condition=Complete", "job/par", "-n", namespace, "--timeout=120s")
    j = get_json(k8s, "job/par", "-n", namespace)
    assert j["status"]["succeeded"] == 3
    pods = job_pods(k8s, namespace, "par")
    assert len(pods) == 3
    for p in pods:
        assert p["status"]["phase"] == "Succeeded"
        cs = p["status"]["containerStatuses"][0]
        assert cs["state"]["terminated"]["exitCode"] == 0
        assert cs["state"]["terminated"]["reason"] == "Completed"
        assert p["status"]["podIP"] == "127.0.0.1"
        assert p["spec"]["nodeName"] == NODE
        name = p["metadata"]["name"]
        assert k8s.pod_log(namespace, name).strip() == f"hello from {name}"


def test_active_deadline_kills_pod(k8s, namespace):
    apply(k8s, job("deadline", [PY, "-c", "import time; time.sleep(600)"], deadline=5), namespace)
    pod = wait_for(
        lambda: [
            p for p in job_pods(k8s, namespace, "deadline") if p["status"].get("phase") == "Running"
        ],
        timeout=60,
        what="running pod",
    )[0]
    pids = k8s.node.pod_pids(namespace, pod["metadata"]["name"])
    assert pids, "the pod's process should be running"
    k8s.kubectl("wait", "--for=condition=Failed", "job/deadline", "-n", namespace, "--timeout=90s")
    j = get_json(k8s, "job/deadline", "-n", namespace)
    failed = next(c for c in j["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    for pid in pids.values():
        wait_for(lambda pid=pid: not _alive(pid), timeout=30, what=f"pid {pid} gone")
    # the kubelet finalised the deleted pod (grace 0 after SIGTERM)
    wait_for(lambda: not job_pods(k8s, namespace, "deadline"), timeout=60, what="pod removal")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.e2e.jobrunner.dev
spec:
  group: e2e.jobrunner.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            x-kubernetes-validations:
            - rule: "self.min <= self.max"
              message: "min must not exceed max"
            properties:
              min: {type: integer}
              max: {type: integer}
"""


def test_crd_cel_validation(k8s, namespace):
    apply(k8s, CRD)
    k8s.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.e2e.jobrunner.dev", "--timeout=60s"
    )
    widget = (
        "apiVersion: e2e.jobrunner.dev/v1\nkind: Widget\n"
        "metadata: {{name: {n}}}\nspec: {{min: {a}, max: {b}}}\n"
    )
    bad = apply(k8s, widget.format(n="bad", a=5, b=1), namespace, check=False)
    assert bad.returncode != 0
    assert "min must not exceed max" in bad.stderr
    assert "Invalid value" in bad.stderr
    apply(k8s, widget.format(n="good", a=1, b=5), namespace)
    assert get_json(k8s, "widget/good", "-n", namespace)["spec"] == {"min": 1, "max": 5}


def test_helm_install(k8s, namespace, tmp_path):
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: {{ .Release.Name }}-cm
        data:
          greeting: {{ .Values.greeting | quote }}
        """)
    )
    (chart / "templates" / "sa.yaml").write_text(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: {{ .Release.Name }}-sa\n"
    )
    k8s.helm(
        "install",
        "rel",
        str(chart),
        "-n",
        namespace,
        "--set",
        "greeting=hi",
        "--wait",
        "--timeout=60s",
    )
    cm = get_json(k8s, "configmap/rel-cm", "-n", namespace)
    assert cm["data"] == {"greeting": "hi"}
    assert cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    get_json(k8s, "serviceaccount/rel-sa", "-n", namespace)
    assert "rel" in k8s.helm("list", "-n", namespace, "-q").stdout.split()
    k8s.helm("uninstall", "rel", "-n", namespace, "--wait")
    assert k8s.kubectl("get", "configmap/rel-cm", "-n", namespace, check=False).returncode != 0


RBAC = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: reader}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: pod-reader}
rules:
- apiGroups: [""]
  resources: [pods, configmaps]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: reader-binding}
subjects:
- {kind: ServiceAccount, name: reader, namespace: NS}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}
"""


def test_rbac(k8s, namespace, tmp_path):
    apply(k8s, RBAC.replace("NS", namespace), namespace)
    who = f"--as=system:serviceaccount:{namespace}:reader"

    def can_i(*args):
        r = k8s.kubectl("auth", "can-i", *args, who, "-n", namespace, check=False)
        return r.stdout.strip()

    assert can_i("list", "pods") == "yes"
    assert can_i("get", "configmaps") == "yes"
    assert can_i("delete", "pods") == "no"
    assert can_i("create", "jobs.batch") == "no"
    assert can_i("list", "secrets") == "no"
    # and with a real token from the TokenRequest API (authentication, not impersonation)
    token = k8s.kubectl("create", "token", "reader", "-n", namespace).stdout.strip()
    empty = tmp_path / "empty-kubeconfig"
    empty.write_text("")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(k8s.ca_pem)
    as_sa = [
        "--kubeconfig",
        str(empty),
        "--server",
        k8s.server,
        "--certificate-authority",
        str(ca),
        "--token",
        token,
        "-n",
        namespace,
    ]
    assert k8s.kubectl("get", "pods", *as_sa).returncode == 0
    denied = k8s.kubectl("get", "secrets", *as_sa, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_pod_env_and_in_cluster_credentials(k8s, namespace):
    apply(k8s, RBAC.replace("NS", namespace), namespace)
    k8s.kubectl(
        "create",
        "secret",
        "generic",
        "db",
        "-n",
        namespace,
        "--from-literal=dsn=postgresql://u:p@127.0.0.1:5432/db",
        "--from-literal=PGUSER=u",
    )
    k8s.kubectl("create", "configmap", "cfg", "-n", namespace, "--from-literal=MODE=fast")
    # The controller's own API client (the image has no kubernetes package): its in-cluster
    # login, from the service account and $KUBERNETES_SERVICE_HOST/PORT.
    script = textwrap.dedent("""\
        import json, os
        from jobrunner.operator import kube
        pods = [p["metadata"]["name"] for p in kube.list_pods(os.environ["NS"], "app=envtest")]
        try:
            kube.request("GET", f"/api/v1/namespaces/{os.environ['NS']}/secrets")
            secrets = "allowed"
        except kube.ApiError as e:
            secrets = e.status
        keys = ["DSN", "NS", "POD_NAME", "POD_UID", "SA", "NODE", "IP", "LBL", "GREETING",
                "DB_PGUSER", "MODE", "MISSING", "CPU"]
        env = {k: os.environ.get(k) for k in keys}
        print(json.dumps({"env": env, "pods": pods, "secrets": secrets,
                          "cwd": os.getcwd(), "argv": os.sys.argv[1:]}), flush=True)
        """)
    pod = f"""
apiVersion: v1
kind: Pod
metadata:
  name: envpod
  labels: {{app: envtest}}
spec:
  serviceAccountName: reader
  restartPolicy: Never
  hostNetwork: true
  containers:
  - name: main
    image: {IMAGE}
    imagePullPolicy: Never
    command: [python, -c, {json.dumps(script)}]
    args: ["$(GREETING)", "$$(GREETING)"]
    envFrom:
    - configMapRef: {{name: cfg}}
    - secretRef: {{name: db}}
      prefix: DB_
    env:
    - {{name: DSN, valueFrom: {{secretKeyRef: {{name: db, key: dsn}}}}}}
    - {{name: MISSING, valueFrom: {{secretKeyRef: {{name: nope, key: x, optional: true}}}}}}
    - {{name: NS, valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}}}
    - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
    - {{name: POD_UID, valueFrom: {{fieldRef: {{fieldPath: metadata.uid}}}}}}
    - {{name: SA, valueFrom: {{fieldRef: {{fieldPath: spec.serviceAccountName}}}}}}
    - {{name: NODE, valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}}}
    - {{name: IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
    - {{name: LBL, valueFrom: {{fieldRef: {{fieldPath: "metadata.labels['app']"}}}}}}
    - {{name: CPU, valueFrom: {{resourceFieldRef: {{resource: limits.cpu}}}}}}
    - {{name: GREETING, value: "hi $(POD_NAME) in $(NS)"}}
    - {{name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
    - {{name: KUBERNETES_SERVICE_PORT, value: "{k8s.apiserver_port}"}}
"""
    apply(k8s, pod, namespace)
    k8s.kubectl(
        "wait",
        "--for=jsonpath={.status.phase}=Succeeded",
        "pod/envpod",
        "-n",
        namespace,
        "--timeout=90s",
    )
    out = json.loads(k8s.pod_log(namespace, "envpod"))
    p = get_json(k8s, "pod/envpod", "-n", namespace)
    env = out["env"]
    assert env["DSN"] == "postgresql://u:p@127.0.0.1:5432/db"
    assert env["DB_PGUSER"] == "u" and env["MODE"] == "fast" and env["MISSING"] is None
    assert (
        env["NS"] == namespace
        and env["POD_NAME"] == "envpod"
        and env["POD_UID"] == p["metadata"]["uid"]
    )
    assert env["SA"] == "reader" and env["NODE"] == NODE and env["IP"] == "127.0.0.1"
    assert env["LBL"] == "envtest" and int(env["CPU"]) >= 1
    assert env["GREETING"] == f"hi envpod in {namespace}"
    assert out["argv"] == [f"hi envpod in {namespace}", "$(GREETING)"]
    assert out["pods"] == ["envpod"]  # the SA may list pods ...
    assert out["secrets"] == 403  # ... but not secrets
    cs = p["status"]["containerStatuses"][0]
    assert cs["state"]["terminated"]["exitCode"] == 0 and cs["ready"] is False
    assert {c["type"] for c in p["status"]["conditions"]} >= {
        "PodScheduled",
        "Initialized",
        "Ready",
        "ContainersReady",
    }


def test_missing_secret_and_no_automount(k8s, namespace):
    pod = """
apiVersion: v1
kind: Pod
metadata: {name: nosa}
spec:
  automountServiceAccountToken: false
  restartPolicy: Never
  hostNetwork: true
  containers:
  - name: main
    image: jobrunner:e2e
    imagePullPolicy: Never
    command:
    - python
    - -c
    - |
      import os
      print(os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token'), os.environ['X'])
    env:
    - {name: X, valueFrom: {secretKeyRef: {name: later, key: x}}}
"""
    apply(k8s, pod, namespace)
    wait_for(
        lambda: (
            (get_json(k8s, "pod/nosa", "-n", namespace)["status"].get("containerStatuses") or [{}])[
                0
            ]
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "CreateContainerConfigError"
        ),
        timeout=30,
        what="CreateContainerConfigError",
    )
    k8s.kubectl("create", "secret", "generic", "later", "-n", namespace, "--from-literal=x=42")
    k8s.kubectl(
        "wait",
        "--for=jsonpath={.status.phase}=Succeeded",
        "pod/nosa",
        "-n",
        namespace,
        "--timeout=60s",
    )
    assert k8s.pod_log(namespace, "nosa").split() == ["False", "42"]


def test_restart_policy_and_init_containers(k8s, namespace):
    pod = """
apiVersion: v1
kind: Pod
metadata: {name: flaky}
spec:
  restartPolicy: OnFailure
  hostNetwork: true
  volumes: [{name: init, emptyDir: {}}, {name: work, emptyDir: {}}]
  initContainers:
  - name: init
    image: jobrunner:e2e
    imagePullPolicy: Never
    workingDir: /init
    volumeMounts: [{name: init, mountPath: /init}]
    command: [python, -c, "open('marker', 'w').write('x')"]
  containers:
  - name: main
    image: jobrunner:e2e
    imagePullPolicy: Never
    # an emptyDir outlives container restarts: it counts the attempts
    workingDir: /work
    volumeMounts: [{name: work, mountPath: /work}]
    command:
    - python
    - -c
    - |
      import os, sys
      n = len(os.listdir('.'))
      open(f'f{n}', 'w')
      print(n)
      sys.exit(0 if n >= 2 else 3)
"""
    apply(k8s, pod, namespace)
    k8s.kubectl(
        "wait",
        "--for=jsonpath={.status.phase}=Succeeded",
        "pod/flaky",
        "-n",
        namespace,
        "--timeout=90s",
    )
    p = get_json(k8s, "pod/flaky", "-n", namespace)
    cs = p["status"]["containerStatuses"][0]
    assert cs["restartCount"] == 2
    assert cs["lastState"]["terminated"]["exitCode"] == 3
    assert p["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    # (the kubelet drops the dead containers of a finished pod, with their logs: no
    # --previous here)
    assert k8s.pod_log(namespace, "flaky").strip() == "2"


def test_kill_9_gets_replacement_pod(k8s, namespace):
    apply(k8s, job("crash", [PY, "-c", "import time; time.sleep(600)"], backoff=2), namespace)

    def running():
        return [
            p for p in job_pods(k8s, namespace, "crash") if p["status"].get("phase") == "Running"
        ]

    first = wait_for(running, timeout=60, what="running pod")[0]["metadata"]["name"]
    assert k8s.node.kill_pod(namespace, first, signal.SIGKILL) == 1
    k8s.kubectl(
        "wait",
        "--for=jsonpath={.status.phase}=Failed",
        f"pod/{first}",
        "-n",
        namespace,
        "--timeout=30s",
    )
    term = get_json(k8s, f"pod/{first}", "-n", namespace)["status"]["containerStatuses"][0][
        "state"
    ]["terminated"]
    assert term["exitCode"] == 137 and term["reason"] == "Error"
    # the Job controller notices the failure and creates a replacement (after its backoff)
    second = wait_for(
        lambda: [p for p in running() if p["metadata"]["name"] != first],
        timeout=90,
        what="replacement pod",
    )[0]["metadata"]["name"]
    j = get_json(k8s, "job/crash", "-n", namespace)
    assert j["status"].get("failed") == 1 and j["status"].get("active") == 1
    assert k8s.node.kill_pod(namespace, second, signal.SIGKILL) == 1
    k8s.kubectl(
        "wait",
        "--for=jsonpath={.status.phase}=Failed",
        f"pod/{second}",
        "-n",
        namespace,
        "--timeout=30s",
    )
    # deleting the Job garbage-collects its pods through ownerReferences
    k8s.kubectl("delete", "job/crash", "-n", namespace, "--cascade=background", "--wait=false")
    wait_for(
        lambda: not job_pods(k8s, namespace, "crash"), timeout=90, what="pods garbage-collected"
    )


@pytest.mark.exclusive  # (see tests/e2e/conftest.py)
def test_restart_apiserver(k8s, namespace):
    k8s.restart_apiserver()
    assert k8s.kubectl("get", "namespace", namespace).returncode == 0
    # the kubelet's watch recovered: new pods still run
    apply(
        k8s,
        """
apiVersion: v1
kind: Pod
metadata: {name: after-restart}
spec:
  restartPolicy: Never
  hostNetwork: true
  containers:
  - {name: main, image: jobrunner:e2e, imagePullPolicy: Never, command: [python, -c, "print('ok')"]}
""",
        namespace,
    )
    k8s.kubectl(
        "wait",
        "--for=jsonpath={.status.phase}=Succeeded",
        "pod/after-restart",
        "-n",
        namespace,
        "--timeout=90s",
    )
    assert k8s.pod_log(namespace, "after-restart").strip() == "ok"
