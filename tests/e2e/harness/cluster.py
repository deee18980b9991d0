"""A real single-node Kubernetes cluster on 127.0.0.1.

etcd + kube-apiserver (client-cert auth, Node,RBAC authorization, service-account
token signing) + kube-controller-manager (all default controllers) + a real node from
:mod:`tests.e2e.harness.node` (containerd, runc, kubelet, kube-scheduler) running the
jobrunner image built from the repository's Dockerfile.

By hand (foreground, Ctrl-C to stop and clean up)::

    python -m tests.e2e.harness.cluster

writes ``.e2e/kubeconfig`` in the repository, prints it, and keeps running.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import yaml

from . import build
from .images import JOBRUNNER_IMAGE
from .node import Node
from .pki import PKI, CertPair
from .procs import Proc, free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_KUBECONFIG = REPO_ROOT / ".e2e" / "kubeconfig"
SERVICE_CIDR = "10.0.0.0/24"  # only allocated, never contacted (no kube-proxy)


def _b64(data: bytes) -> str:
    return b64encode(data).decode()


def kubeconfig_dict(
    server: str, ca_pem: bytes, user: dict, namespace: str = "default", name: str = "jobrunner-e2e"
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}
        ],
        "current-context": name,
        "preferences": {},
    }


def write_kubeconfig(path: Path, cfg: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


class ClusterError(RuntimeError):
    pass


class CommandError(subprocess.CalledProcessError):
    """A failed kubectl/helm call; its message includes the command's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()[-2000:]}"


class Cluster:
    """Start with :meth:`start` (or use as a context manager); :meth:`stop` cleans up."""

    def __init__(
        self,
        bin_dir: Path | str | None = None,
        kubeconfig_path: Path | str | None = None,
        keep: bool | None = None,
        with_node: bool = True,
        quiet: bool = True,
    ):
        self.bin_dir = Path(bin_dir) if bin_dir else build.bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="jobrunner-e2e-"))
        self.kubeconfig = (
            Path(kubeconfig_path) if kubeconfig_path else self.root / "admin.kubeconfig"
        )
        self.keep = bool(os.environ.get("JOBRUNNER_E2E_KEEP")) if keep is None else keep
        self.with_node = with_node
        self.image = JOBRUNNER_IMAGE.removeprefix("docker.io/library/")
        self.quiet = quiet
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.apiserver_port = free_port()
        self.kcm_port = free_port()
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.node: Node | None = None
        self.etcd: Proc | None = None
        self.apiserver: Proc | None = None
        self.kcm: Proc | None = None
        self._stopped = False
        self._lock = threading.RLock()
        # Set by attach(): another process runs the cluster; this one only uses it.
        self.attached = False
        path_entries = [
            str(self.bin_dir),
            os.path.dirname(sys.executable),
            os.environ.get("PATH", ""),
        ]
        self.env = dict(os.environ)
        self.env["KUBECONFIG"] = str(self.kubeconfig)
        self.env["PATH"] = os.pathsep.join(p for p in path_entries if p)
        # helm keeps its state in per-cluster dirs, not in the user's home.
        for var, sub in (
            ("HELM_CACHE_HOME", "helm/cache"),
            ("HELM_CONFIG_HOME", "helm/config"),
            ("HELM_DATA_HOME", "helm/data"),
        ):
            self.env[var] = str(self.root / sub)

    # ---------------------------------------------------------------- lifecycle
    def _log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[e2e-cluster] {msg}", file=sys.stderr, flush=True)

    def _bin(self, name: str) -> str:
        p = self.bin_dir / name
        if not os.access(p, os.X_OK):
            raise ClusterError(f"missing binary {p}; run `python -m tests.e2e.harness.build`")
        return str(p)

    def _setup_pki(self) -> None:
        pki_dir = self.root / "pki"
        self.pki = PKI(pki_dir)
        self.serving = self.pki.issue(
            "apiserver",
            "kube-apiserver",
            server=True,
            dns=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ips=["127.0.0.1", "10.0.0.1"],
        )
        self.admin = self.pki.issue(
            "admin", "kubernetes-admin", orgs=["system:masters"], client=True
        )
        self.kcm_cert = self.pki.issue("kcm", "system:kube-controller-manager", client=True)
        self.sa_keys = self.pki.service_account_keys()
        self.ca_pem = self.pki.ca.cert_pem
        admin_user = {
            "client-certificate-data": _b64(self.admin.cert_pem),
            "client-key-data": _b64(self.admin.key_pem),
        }
        self.admin_config = kubeconfig_dict(self.server, self.ca_pem, admin_user)
        write_kubeconfig(self.kubeconfig, self.admin_config)
        self.kcm_kubeconfig = write_kubeconfig(
            self.root / "kcm.kubeconfig",
            kubeconfig_dict(
                self.server,
                self.ca_pem,
                {
                    "client-certificate-data": _b64(self.kcm_cert.cert_pem),
                    "client-key-data": _b64(self.kcm_cert.key_pem),
                },
            ),
        )

    def _etcd_argv(self):
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        return [
            self._bin("etcd"),
            "--name=e2e",
            f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e2e={peer}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
            "--quota-backend-bytes=2147483648",
        ]

    def _apiserver_argv(self):
        p = self.pki.dir
        return [
            self._bin("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={self.serving.cert}",
            f"--tls-private-key-file={self.serving.key}",
            f"--client-ca-file={p / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            "--anonymous-auth=false",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.sa_keys.cert}",
            f"--service-account-signing-key-file={self.sa_keys.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # logs/exec/port-forward: the API server calls the kubelet on 127.0.0.1 over
            # verified TLS, as a cluster admin.
            f"--kubelet-client-certificate={self.admin.cert}",
            f"--kubelet-client-key={self.admin.key}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]

    def _kcm_argv(self):
        p = self.pki.dir
        return [
            self._bin("kube-controller-manager"),
            f"--kubeconfig={self.kcm_kubeconfig}",
            f"--authentication-kubeconfig={self.kcm_kubeconfig}",
            f"--authorization-kubeconfig={self.kcm_kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.kcm_port}",
            "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.sa_keys.key}",
            f"--root-ca-file={p / 'ca.crt'}",
            f"--cluster-signing-cert-file={p / 'ca.crt'}",
            f"--cluster-signing-key-file={p / 'ca.key'}",
            "--controllers=*",
            "--profiling=false",
            "--v=1",
        ]

    def start(self, timeout: float = 180.0) -> Cluster:
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            self._setup_pki()
            logs = self.root / "logs"
            self.etcd = Proc("etcd", self._etcd_argv(), logs / "etcd.log")
            self.etcd.start()
            self._wait(
                lambda: self._http_ok(f"http://127.0.0.1:{self.etcd_port}/health"), self.etcd, 60
            )
            self.apiserver = Proc(
                "kube-apiserver", self._apiserver_argv(), logs / "kube-apiserver.log"
            )
            self.start_apiserver(timeout=timeout)
            self.kcm = Proc(
                "kube-controller-manager", self._kcm_argv(), logs / "kube-controller-manager.log"
            )
            self.kcm.start()
            self._wait(
                lambda: self._https_ok(f"https://127.0.0.1:{self.kcm_port}/healthz", verify=False),
                self.kcm,
                timeout,
            )
            if self.with_node:
                self.node = Node(self.root / "node", self.bin_dir, self.pki, self.server,
                                 self.kubeconfig, self._component_kubeconfig)
                self.node.start()
            # The cluster is usable once the service-account controller works.
            self._wait(self._default_sa_exists, self.kcm, timeout)
        except BaseException:
            self.stop()
            raise
        self._log(f"cluster ready in {time.monotonic() - t0:.1f}s at {self.server}")
        return self

    # ------------------------------------------------------------ sharing
    def share_info(self) -> dict:
        """What another process needs to use this running cluster (see attach)."""
        return {
            "root": str(self.root), "kubeconfig": str(self.kubeconfig), "server": self.server,
            "apiserver_port": self.apiserver_port, "bin_dir": str(self.bin_dir),
            "ca": str(self.pki.ca.cert), "admin_cert": str(self.admin.cert),
            "admin_key": str(self.admin.key),
            "node": None if self.node is None else {
                "root": str(self.node.root), "kubelet_port": self.node.kubelet_port},
        }

    @classmethod
    def attach(cls, info_file: Path | str) -> Cluster:
        """A handle on a cluster another process started (``python -m
        tests.e2e.harness.cluster --info FILE``): kubectl, helm, API clients, pod logs and
        signals to pods work; restarting or stopping its processes does not (such tests are
        marked ``exclusive`` and run on a cluster of their own)."""
        info = json.loads(Path(info_file).read_text())
        c = cls(info["bin_dir"], kubeconfig_path=info["kubeconfig"], keep=False)
        c.attached = True
        c.server, c.apiserver_port = info["server"], info["apiserver_port"]
        ca = Path(info["ca"])
        c.pki = type("SharedPKI", (), {"ca": CertPair(ca, ca), "dir": ca.parent})()
        c.admin = CertPair(Path(info["admin_cert"]), Path(info["admin_key"]))
        c.ca_pem = ca.read_bytes()
        c.admin_config = yaml.safe_load(Path(info["kubeconfig"]).read_text())
        if info["node"]:
            c.node = Node.attached(Path(info["node"]["root"]), c.bin_dir, c.kubeconfig,
                                   info["node"]["kubelet_port"])
        return c

    def _not_attached(self, what: str) -> None:
        if self.attached:
            raise ClusterError(f"{what}: this process only attached to a cluster another one "
                               "runs; mark the test @pytest.mark.exclusive (tests/e2e/README.md)")

    def start_apiserver(self, timeout: float = 180.0) -> None:
        self._not_attached("start_apiserver")
        with self._lock:
            if self.apiserver.alive():
                return
            self.apiserver.start()
            self._wait(lambda: self._https_ok(f"{self.server}/readyz"), self.apiserver, timeout)

    def stop_apiserver(self, grace: float = 3.0) -> None:
        """SIGTERM kube-apiserver, SIGKILL after ``grace`` seconds. (Its graceful shutdown stops
        serving at once but the process then lingers for a long time, hence the short grace.)"""
        with self._lock:
            self.apiserver.stop(grace=grace)

    def restart_apiserver(
        self, downtime: float = 0.0, timeout: float = 180.0, grace: float = 3.0
    ) -> None:
        """Stop kube-apiserver and start it again on the same port with the same etcd data."""
        self.stop_apiserver(grace=grace)
        if downtime:
            time.sleep(downtime)
        self.start_apiserver(timeout=timeout)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self.attached:  # (its own helm dirs only: the cluster is the other process's)
            shutil.rmtree(self.root, ignore_errors=True)
            return
        if self.node is not None:
            try:
                self.node.stop()
            except Exception as e:  # pragma: no cover
                print(f"[e2e-cluster] node stop failed: {e}", file=sys.stderr)
        for p, grace in ((self.kcm, 5), (self.apiserver, 3), (self.etcd, 5)):
            if p is not None:
                p.stop(grace=grace)
        if self.keep:
            print(f"[e2e-cluster] kept {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---------------------------------------------------------------- readiness
    def _wait(self, cond, proc: Proc | None, timeout: float) -> None:
        wait_for(cond, proc, timeout, getattr(cond, "__name__", str(cond)), ClusterError,
                 interval=0.25)

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        if verify:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        else:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        return ctx

    def _https_ok(self, url: str, verify: bool = True) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=3, context=self._ssl_context(verify)) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _default_sa_exists(self) -> bool:
        r = self.kubectl(
            "get", "serviceaccount", "default", "-n", "default", check=False, timeout=15
        )
        return r.returncode == 0

    # ---------------------------------------------------------------- clients
    def kubectl(
        self, *args, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return self._run([self._bin("kubectl"), *args], check, input, timeout)

    def helm(
        self, *args, check: bool = True, input: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        return self._run([self._bin("helm"), *args], check, input, timeout)

    def _run(self, argv, check, input, timeout) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [str(a) for a in argv],
            env=self.env,
            input=input,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise CommandError(r.returncode, r.args, r.stdout, r.stderr)
        return r

    def api_client(self, pool_maxsize: int | None = None):
        """A fresh ``kubernetes.client.ApiClient`` with admin credentials."""
        from kubernetes import client, config

        cfg = client.Configuration()
        if pool_maxsize:
            cfg.connection_pool_maxsize = pool_maxsize
        loader = config.kube_config.KubeConfigLoader(
            config_dict=self.admin_config, temp_file_path=str(self.root / "pki")
        )
        loader.load_and_set(cfg)
        cfg.retries = 0
        return client.ApiClient(configuration=cfg)

    def _component_kubeconfig(self, name: str, cert) -> Path:
        return write_kubeconfig(
            self.root / f"{name}.kubeconfig",
            kubeconfig_dict(self.server, self.ca_pem, {
                "client-certificate-data": _b64(cert.cert_pem),
                "client-key-data": _b64(cert.key_pem)}))

    def pod_log(self, namespace: str, name: str, container: str | None = None,
                previous: bool = False) -> str:
        """`kubectl logs` (served by the kubelet from the container runtime's log files)."""
        args = ["logs", name, "-n", namespace]
        if container:
            args += ["-c", container]
        if previous:
            args.append("--previous")
        return self.kubectl(*args, timeout=60).stdout

    def kubelet_get(self, path: str) -> str:
        """GET from the kubelet's own HTTPS API as the admin (the API server's node proxy
        refuses loopback addresses, so this goes straight to 127.0.0.1)."""
        url = f"https://127.0.0.1:{self.node.kubelet_port}{path}"
        with urllib.request.urlopen(url, timeout=10, context=self._ssl_context()) as r:
            return r.read().decode()

    def in_cluster_env(self) -> list[dict]:
        """Env entries that let an in-cluster client on the host network reach the API
        server (the kubelet injects the unreachable ClusterIP 10.0.0.1 otherwise)."""
        return [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.apiserver_port)}]

    def info(self) -> dict:
        return {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "bin_dir": str(self.bin_dir),
            "root": str(self.root),
            "etcd": f"http://127.0.0.1:{self.etcd_port}",
        }


def usage(cluster: Cluster, bin_dir: Path) -> str:
    """How to use the running cluster, printed by `make cluster`."""
    env = cluster.in_cluster_env()
    host, port = env[0]["value"], env[1]["value"]
    return f"""
A single-node cluster on 127.0.0.1: node {cluster.node.name if cluster.node else '(none)'} \
(containerd, runc, kubelet), image {cluster.image} built from ./Dockerfile.
In another shell:

  export KUBECONFIG={cluster.kubeconfig} PATH={bin_dir}:$PATH
  kubectl get nodes -o wide
  # Secret jobrunner-db (the DSN) exists when make cluster started its PostgreSQL; else:
  #   kubectl create secret generic jobrunner-db --from-literal=dsn='postgresql://…'
  helm install jr charts/jobrunner --wait \\
    --set image.repository=jobrunner --set image.tag={cluster.image.split(':')[1]} \\
    --set image.pullPolicy=Never --set controller.hostNetwork=true \\
    --set worker.hostNetwork=true \\
    --set controller.extraEnv[0].name=KUBERNETES_SERVICE_HOST \\
    --set controller.extraEnv[0].value={host} \\
    --set controller.extraEnv[1].name=KUBERNETES_SERVICE_PORT \\
    --set-string controller.extraEnv[1].value={port}
  kubectl apply -f examples/summarise.yaml
  kubectl get pods -o wide; kubectl logs -l jobrunner.dev/batchrun=summarise-stdlib-docs
  kubectl get br

Pods must use the host network (no pod network here, by design: loopback only).
Rebuild the image after a change: python -m tests.e2e.harness.images --rebuild
Component logs: {cluster.root / 'logs'} and {cluster.root / 'node' / 'logs'}
Ctrl-C stops everything and removes the pods.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Run the jobrunner e2e Kubernetes cluster in the foreground."
    )
    ap.add_argument(
        "--kubeconfig", default=str(DEFAULT_KUBECONFIG), help="where to write the admin kubeconfig"
    )
    ap.add_argument("--no-node", action="store_true", help="control plane only")
    ap.add_argument("--no-postgres", action="store_true",
                    help="do not start the embedded PostgreSQL and its jobrunner-db Secret")
    ap.add_argument(
        "--keep", action="store_true", help="keep the temp dir (logs, etcd data) on exit"
    )
    ap.add_argument("--info", help="once ready, write what other processes need to attach "
                    "(JOBRUNNER_E2E_CLUSTER=FILE pytest tests/e2e) to FILE")
    a = ap.parse_args(argv)
    if not build.cluster_present() and not build.go_available():
        print("e2e binaries are missing and `go` is not installed", file=sys.stderr)
        return 2
    bin_dir = build.ensure_cluster()
    cluster = Cluster(
        bin_dir,
        kubeconfig_path=a.kubeconfig,
        keep=a.keep,
        with_node=not a.no_node,
        quiet=False,
    )
    stop = threading.Event()

    def _sig(signum, frame):
        stop.set()

    signal.signal(signal.SIGINT, _sig)
    signal.signal(signal.SIGTERM, _sig)
    pg = None
    try:
        if not a.no_postgres:
            from jobrunner.local.embedded import EmbeddedPostgres

            pg = EmbeddedPostgres(REPO_ROOT / ".e2e" / "postgres")
            pg.start()
        cluster.start()
        if pg is not None:
            # The DSN goes into the Secret through stdin: never on a command line or screen.
            secret = {"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": "jobrunner-db", "namespace": "default"},
                      "stringData": {"dsn": pg.dsn()}}
            cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))
            print(f"[e2e-cluster] PostgreSQL on 127.0.0.1:{pg.port} (data in {pg.root}); "
                  "its DSN is in Secret default/jobrunner-db", file=sys.stderr)
        print(json.dumps(cluster.info(), indent=2))
        print(usage(cluster, bin_dir), flush=True)
        if a.info:
            tmp = Path(a.info + ".tmp")
            tmp.write_text(json.dumps(cluster.share_info()))
            tmp.replace(a.info)
        while not stop.wait(1):
            procs = [cluster.etcd, cluster.apiserver, cluster.kcm]
            if cluster.node:
                procs += [cluster.node.containerd, cluster.node.kubelet, cluster.node.scheduler]
            for p in procs:
                if not p.alive():
                    print(f"{p.name} died:\n{p.log_tail()}", file=sys.stderr)
                    return 1
    finally:
        cluster.stop()
        if pg is not None:
            pg.stop()
        try:
            if Path(a.kubeconfig).exists():
                Path(a.kubeconfig).unlink()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
