"""Kueue (sigs.k8s.io/kueue, built by build.py) on the e2e cluster, as a host process.

Like the other control-plane processes it runs on the host and talks to the API server
on 127.0.0.1 as the cluster admin. Its webhooks work as on a real cluster, with Kueue's
own certificate management (cert-controller):

- The webhook configurations (from the Kueue module, as its kustomization names them)
  point at the Service ``kueue-system/kueue-webhook-service``. That Service is of type
  ExternalName with ``externalName: 127.0.0.1``: the API server resolves an ExternalName
  Service to that host and the webhook's port (no endpoints, no kube-proxy, no
  --enable-aggregator-routing), and verifies the serving certificate against the
  Service's DNS name, which is the name Kueue issues its certificate for. (An Endpoints
  or EndpointSlice address may not be a loopback one, so a selector-less Service cannot
  point at 127.0.0.1.)
- Kueue writes its CA and serving certificate to the Secret ``kueue-webhook-server-cert``
  and injects the CA into the webhook configurations and the CRDs' conversion webhooks;
  a pod would get the Secret as a volume, this process gets it copied to its ``certDir``
  by a thread here (what the kubelet would do).

Kueue is cluster-wide, but here it manages only namespaces labelled
``jobrunner.dev/kueue-e2e=true`` (its managedJobsNamespaceSelector, and the
namespaceSelector of every webhook), so it can run beside the other tests of a shared
cluster without touching their Jobs, Deployments or pods: it is started by the tests that
need it (tests/e2e/test_kueue_e2e.py's session fixture) and stopped after them.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from . import build
from .procs import Proc, free_port, wait_for

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
# Namespaces Kueue manages (and whose objects its webhooks see).
NAMESPACE_LABEL = ("jobrunner.dev/kueue-e2e", "true")
FRAMEWORKS = ("batch/job", "pod", "deployment")


class KueueError(RuntimeError):
    pass


def assets() -> Path:
    return build.KUEUE.assets_dir() / "config" / "components"


def crds(port: int) -> list[dict[str, Any]]:
    """Kueue's CRDs with the conversion-webhook patches of its kustomization applied (the
    webhook on `port`)."""
    base = assets() / "crd"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs = {}
    for res in kustomization["resources"]:
        doc = yaml.safe_load((base / res).read_text())
        docs[doc["metadata"]["name"]] = doc
    for patch in kustomization.get("patches") or []:
        p = yaml.safe_load((base / patch["path"]).read_text())
        crd = docs[p["metadata"]["name"]]
        conversion = copy.deepcopy(p["spec"]["conversion"])
        conversion["webhook"]["clientConfig"]["service"].update(
            name=SERVICE, namespace=NAMESPACE, port=port)
        crd["spec"]["conversion"] = conversion
    return list(docs.values())


def webhook_configurations(port: int) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, named and pointed as its kustomization does, on
    `port`, and seeing only the namespaces Kueue manages here."""
    docs = [d for d in yaml.safe_load_all((assets() / "webhook" / "manifests.yaml").read_text())
            if d]
    key, value = NAMESPACE_LABEL
    for doc in docs:
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            hook["clientConfig"]["service"].update(name=SERVICE, namespace=NAMESPACE,
                                                   port=port)
            # (cluster-scoped objects, ClusterQueues and the like, are never filtered out
            # by a namespaceSelector: Kueue's own webhooks still see all of them)
            hook["namespaceSelector"] = {"matchLabels": {key: value}}
            hook["timeoutSeconds"] = 10
    return docs


class Kueue:
    """Kueue's controller manager for `cluster` (a harness Cluster, started or attached)."""

    def __init__(self, cluster, root: Path) -> None:
        self.cluster, self.root = cluster, Path(root)
        self.webhook_port = free_port()
        self.health_port = free_port()
        self.cert_dir = self.root / "certs"
        self.proc: Proc | None = None
        self._stop = threading.Event()
        self._sync: threading.Thread | None = None
        self.started_in: float | None = None

    def _apply(self, docs: list[dict[str, Any]]) -> None:
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts",
                             "--field-manager=jobrunner-e2e", "-f", "-",
                             input=yaml.safe_dump_all(docs))

    def _config(self) -> Path:
        key, value = NAMESPACE_LABEL
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port,
                        "certDir": str(self.cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True, "webhookServiceName": SERVICE,
                                       "webhookSecretName": SECRET},
            "manageJobsWithoutQueueName": False,
            "managedJobsNamespaceSelector": {"matchLabels": {key: value}},
            "integrations": {"frameworks": list(FRAMEWORKS)},
        }
        path = self.root / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, timeout: float = 180.0) -> Kueue:
        t0 = time.monotonic()
        # (the suite builds it in the background, after the cluster's binaries: wait)
        build.ensure("kueue")
        binary = Path(self.cluster.bin_dir) / "kueue"
        if not binary.exists():
            raise KueueError(f"missing {binary}; run `python -m tests.e2e.harness.build`")
        self.cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        self._apply([
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": SERVICE, "namespace": NAMESPACE},
             "spec": {"type": "ExternalName", "externalName": "127.0.0.1"}},
            # Kueue fills it; it must exist (the rotator only updates it)
            {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
             "metadata": {"name": SECRET, "namespace": NAMESPACE}},
        ])
        definitions = crds(self.webhook_port)
        self._apply(definitions)
        self.cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                             *(f"crd/{c['metadata']['name']}" for c in definitions))
        self._apply(webhook_configurations(self.webhook_port))
        env = dict(self.cluster.env)
        env["KUBECONFIG"] = str(self.cluster.kubeconfig)
        self.proc = Proc("kueue", [binary, f"--config={self._config()}",
                                   # (its aggregated API: not registered here, no port)
                                   "--feature-gates=VisibilityOnDemand=false",
                                   "--zap-log-level=info"],
                         self.root / "kueue.log", env=env)
        self.proc.start()
        self._sync = threading.Thread(target=self._sync_certs, daemon=True,
                                      name="kueue-certs")
        self._sync.start()
        try:
            wait_for(self._ready, self.proc, timeout, "Kueue's webhooks to answer",
                     KueueError, interval=0.5)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0
        return self

    def _sync_certs(self) -> None:
        """The kubelet's part for a pod: the Secret's keys as files in certDir."""
        while not self._stop.wait(0.5):
            r = self.cluster.kubectl("get", "secret", SECRET, "-n", NAMESPACE, "-o", "json",
                                     check=False, timeout=15)
            if r.returncode != 0:
                continue
            data = json.loads(r.stdout).get("data") or {}
            if not data.get("tls.crt"):
                continue
            self.cert_dir.mkdir(parents=True, exist_ok=True)
            for name, value in data.items():
                tmp = self.cert_dir / f".{name}.tmp"
                tmp.write_bytes(base64.b64decode(value))
                tmp.chmod(0o600)
                tmp.replace(self.cert_dir / name)
            return  # (issued for ten years: no rotation within a test session)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz",
                                    timeout=3) as r:
            if r.status != 200:
                return False
        # Through the API server, its webhooks included: a server-side dry run.
        probe = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                 "metadata": {"name": "readiness-probe"}}
        r = self.cluster.kubectl("create", "--dry-run=server", "-f", "-",
                                 input=json.dumps(probe), check=False, timeout=30)
        return r.returncode == 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def log_tail(self, n: int = 60) -> str:
        return self.proc.log_tail(n) if self.proc else ""

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None:
            self.proc.stop(grace=5)

    def manage(self, namespace: str) -> None:
        """Let Kueue manage `namespace` (its webhooks and integrations)."""
        key, value = NAMESPACE_LABEL
        self.cluster.kubectl("label", "namespace", namespace, f"{key}={value}", "--overwrite")
