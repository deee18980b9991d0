"""A real Kubernetes node on this machine: containerd + runc + kubelet + kube-scheduler.

Everything stays on loopback: the node is named ``127.0.0.1`` (the kubelet refuses a
loopback ``--node-ip``, but takes it as its hostname, which becomes the InternalIP), its
HTTPS server listens on 127.0.0.1 for ``kubectl logs/exec/port-forward``, and the only CNI
plugin is ``loopback`` — pods run on the host network (``hostNetwork: true``); a pod that
asks for its own network namespace fails to start, by design.

State that is worth keeping (containerd's content store and snapshots, BuildKit's cache)
lives in the build cache, keyed by the versions; what belongs to one run (sockets, shim
state, kubelet root, pod cgroups under ``/jobrunner-e2e``) is wiped at start and stop, so
a crashed run leaves nothing that the next one trips over. The machine's own cgroup
hierarchies are never remounted: the pods get a cgroup root of their own in each.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from . import build
from .images import PAUSE_IMAGE, Builder
from .procs import Proc, free_port, wait_for

RUN_DIR = Path("/run/jobrunner-e2e")
LOCK_FILE = Path("/run/jobrunner-e2e.lock")
BUILD_CACHE_MB = 1500  # BuildKit's cache kept between image builds
CGROUP_ROOT = "jobrunner-e2e"
CGROUP_FS = Path("/sys/fs/cgroup")
POD_CPU_SHARES = 4096
NODE_NAME = "127.0.0.1"
NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin (and of BuildKit's images)
RUNC = shutil.which("runc") or "/usr/sbin/runc"
CNI_BIN_DIR = "/usr/lib/cni"
# Fixed by containerd (shim sockets, fifos) and by the kubelet (device plugins).
_FIXED_DIRS = (Path("/run/containerd/s"), Path("/run/containerd/fifo"),
               Path("/var/lib/kubelet/device-plugins"))


class NodeError(RuntimeError):
    pass


def state_dir() -> Path:
    return build.cache_root() / (f"node-containerd-{build.CONTAINERD_VERSION}"
                                 f"-buildkit-{build.BUILDKIT_VERSION}")


def _cgroup_hierarchies() -> list[Path]:
    out = []
    for d in sorted(CGROUP_FS.iterdir()):
        if d.is_dir() and not d.is_symlink() and (d / "cgroup.procs").exists():
            out.append(d)
    return out


def _cgroup_pids(root: Path) -> set[int]:
    pids: set[int] = set()
    for procs in root.rglob("cgroup.procs"):
        try:
            pids.update(int(x) for x in procs.read_text().split())
        except OSError:
            pass
    return pids


def _mounts_under(prefixes: tuple[str, ...]) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp.startswith(prefixes):
            points.append(mp)
    return sorted(set(points), key=len, reverse=True)


def _pids_with_arg(needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            pass
    return out


def _kill(pids, sig=signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Node:
    """Start with :meth:`start`; :meth:`stop` removes every pod and process it made."""

    def __init__(self, root: Path, bin_dir: Path, pki, server: str, admin_kubeconfig: Path,
                 kubeconfig_for, build_images: bool = True) -> None:
        self.root = Path(root)
        self.bin_dir = Path(bin_dir)
        self.pki = pki
        self.server = server
        self.admin_kubeconfig = admin_kubeconfig
        self.kubeconfig_for = kubeconfig_for  # (CertPair) -> kubeconfig path
        self.build_images = build_images
        self.name = NODE_NAME
        self.state = state_dir()
        self.sock = RUN_DIR / "containerd.sock"
        self.buildkit_addr = f"unix://{RUN_DIR / 'buildkitd.sock'}"
        self.kubelet_port = free_port()
        self.healthz_port = free_port()
        self.scheduler_port = free_port()
        self.logs = self.root / "logs"
        self.kubelet_root = self.root / "kubelet"
        # Container logs as the kubelet writes them: <ns>_<pod>_<uid>/<container>/<n>.log
        self.pod_logs = self.root / "pod-logs"
        self.containerd: Proc | None = None
        self.buildkitd: Proc | None = None
        self.kubelet: Proc | None = None
        self.scheduler: Proc | None = None
        self._lock_file = None
        self.timings: dict[str, float] = {}

    @classmethod
    def attach(cls) -> Node:
        """A handle on the node another process runs (for ctr/buildctl; nothing started)."""
        if not (RUN_DIR / "containerd.sock").exists():
            raise NodeError("no test node is running (start one with `make cluster`)")
        return cls(Path(tempfile.mkdtemp(prefix="jobrunner-node-")), build.bin_dir(), None, "",
                   Path("/nonexistent"), None)

    @classmethod
    def attached(cls, root: Path, bin_dir: Path, admin_kubeconfig: Path,
                 kubelet_port: int) -> Node:
        """A handle on the node of a cluster another process runs (Cluster.attach): its
        pod logs, its containers' PIDs and signals; nothing started or stopped."""
        if not (RUN_DIR / "containerd.sock").exists():
            raise NodeError("no test node is running")
        node = cls(root, bin_dir, None, "", admin_kubeconfig, None, build_images=False)
        node.kubelet_port = kubelet_port
        return node

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Node:
        t0 = time.monotonic()
        self._take_lock()
        self.cleanup()
        self._prepare_dirs()
        self.containerd = Proc("containerd", [self.bin_dir / "containerd", "--config",
                                              self._containerd_config()],
                               self.logs / "containerd.log", env=self._env())
        self.containerd.start()
        self._wait(lambda: self.ctr("version", check=False).returncode == 0, self.containerd, 30,
                   "containerd")
        self._remove_stale_containers()
        self.timings["containerd"] = time.monotonic() - t0
        self.buildkitd = Proc("buildkitd", [
            self.bin_dir / "buildkitd", "--root", self.state / "buildkit",
            "--addr", self.buildkit_addr, "--oci-worker=false", "--containerd-worker=true",
            f"--containerd-worker-addr={self.sock}",
            f"--containerd-worker-namespace={NAMESPACE}", "--containerd-worker-net=host",
            # Without GC every image build's layers stay in the build cache (the pip layer
            # alone is ~150 MB a build; 10 GB after a day of builds). Keep about 1.5 GB.
            "--containerd-worker-gc", f"--containerd-worker-gc-keepstorage={BUILD_CACHE_MB}",
        ], self.logs / "buildkitd.log", env=self._env())
        self.buildkitd.start()
        self._wait(lambda: self._buildctl("debug", "workers").returncode == 0, self.buildkitd,
                   30, "buildkitd")
        t1 = time.monotonic()
        builder = self.builder()
        builder.build_pause()
        if self.build_images:
            builder.build_jobrunner()
        self.timings["images"] = time.monotonic() - t1
        t2 = time.monotonic()
        self.kubelet = Proc("kubelet", self._kubelet_argv(), self.logs / "kubelet.log",
                            env=self._env())
        self.kubelet.start()
        self.scheduler = Proc("kube-scheduler", self._scheduler_argv(),
                              self.logs / "kube-scheduler.log", env=self._env())
        self.scheduler.start()
        self._wait(self.node_ready, self.kubelet, 90, "node Ready")
        self.timings["kubelet"] = time.monotonic() - t2
        return self

    def stop(self) -> None:
        for p in (self.scheduler, self.kubelet):
            if p is not None:
                p.stop(grace=5)
        if self.containerd is not None and self.containerd.alive():
            self._remove_stale_containers()
        for p in (self.buildkitd, self.containerd):
            if p is not None:
                p.stop(grace=10)
        self.cleanup()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def builder(self) -> Builder:
        return Builder(self.bin_dir / "buildctl", self.buildkit_addr, self.logs)

    # ------------------------------------------------------------------ state
    def _take_lock(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        # Beside RUN_DIR, not in the state dir: two nodes with different caches would still
        # share RUN_DIR and the cgroup root, and each start wipes both.
        f = open(LOCK_FILE, "w")  # noqa: SIM115 - held for the node's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise NodeError("another test node is running on this machine (make cluster or a "
                            "test session); one node at a time: stop it first") from None
        self._lock_file = f

    def cleanup(self) -> None:
        """Remove what a run leaves: container processes, shims, mounts, sockets, cgroups."""
        for _ in range(3):
            pids = set(_pids_with_arg(str(RUN_DIR)))
            for h in _cgroup_hierarchies():
                if (h / CGROUP_ROOT).is_dir():
                    pids |= _cgroup_pids(h / CGROUP_ROOT)
            if not pids:
                break
            _kill(pids)
            time.sleep(0.2)
        prefixes = (str(RUN_DIR), str(self.kubelet_root), str(self.state / "containerd"),
                    str(self.state / "buildkit"), *(str(d) for d in _FIXED_DIRS))
        for mp in _mounts_under(prefixes):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        shutil.rmtree(RUN_DIR, ignore_errors=True)
        for d in _FIXED_DIRS:
            shutil.rmtree(d, ignore_errors=True)
        for h in _cgroup_hierarchies():
            top = h / CGROUP_ROOT
            if top.is_dir():
                for d in sorted((p for p in top.rglob("*") if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True):
                    try:
                        d.rmdir()
                    except OSError:
                        pass

    def _prepare_dirs(self) -> None:
        for d in (RUN_DIR / "cni" / "net.d", self.logs, self.kubelet_root, self.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        (RUN_DIR / "cni" / "net.d" / "10-loopback.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "loopback", "plugins": [{"type": "loopback"}]}))
        # The pods' cgroup root in every v1 hierarchy, beside (not inside) the machine's.
        for h in _cgroup_hierarchies():
            top = h / CGROUP_ROOT
            top.mkdir(exist_ok=True)
            if (top / "cpu.shares").exists():
                # On a real node the pods are the node's work; here all of them together
                # compete with each test database's server (an autogroup of its own,
                # 1024 each) and the suite's processes: give them the weight of several.
                (top / "cpu.shares").write_text(str(POD_CPU_SHARES))
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (h / f).exists() and not (top / f).read_text().strip():
                    (top / f).write_text((h / f).read_text())

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(self.bin_dir), "/usr/sbin", "/usr/bin", "/sbin",
                                       "/bin", env.get("PATH", "")])
        # BuildKit's RUN steps and containerd must not inherit a session's proxy settings.
        for k in list(env):
            if k.lower().endswith("_proxy"):
                del env[k]
        return env

    def _containerd_config(self) -> Path:
        cfg = f"""version = 3
root = '{self.state / "containerd"}'
state = '{RUN_DIR / "containerd"}'

[grpc]
  address = '{self.sock}'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'
  [plugins.'io.containerd.cri.v1.runtime']
    # No CAP_SYS_RESOURCE on this VM: runc cannot lower oom_score_adj below its own.
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{RUNC}'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{CNI_BIN_DIR}']
      conf_dir = '{RUN_DIR / "cni" / "net.d"}'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
"""
        path = self.root / "containerd.toml"
        path.write_text(cfg)
        return path

    def _kubelet_argv(self) -> list:
        client = self.pki.issue("kubelet-client", f"system:node:{NODE_NAME}",
                                orgs=["system:nodes"], client=True)
        serving = self.pki.issue("kubelet-serving", NODE_NAME, server=True, ips=["127.0.0.1"],
                                 dns=["localhost"])
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.pki.ca.cert)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{CGROUP_ROOT}",
            "failCgroupV1": False,
            "failSwapOn": False,
            "oomScoreAdj": 0,
            "resolvConf": "/etc/resolv.conf",
            "clusterDomain": "cluster.local",
            # The built images are the only images: never garbage-collect them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "syncFrequency": "5s",
            "nodeStatusUpdateFrequency": "5s",
            "shutdownGracePeriod": "0s",
            "serializeImagePulls": False,
            "maxPods": 200,
            "podLogsDir": str(self.pod_logs),
        }
        path = self.root / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config))
        return [self.bin_dir / "kubelet", f"--config={path}",
                f"--kubeconfig={self.kubeconfig_for('kubelet', client)}",
                f"--root-dir={self.kubelet_root}", f"--hostname-override={NODE_NAME}",
                "--v=1"]

    def _scheduler_argv(self) -> list:
        cert = self.pki.issue("scheduler", "system:kube-scheduler", client=True)
        kc = self.kubeconfig_for("scheduler", cert)
        return [self.bin_dir / "kube-scheduler", f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1", f"--secure-port={self.scheduler_port}",
                "--leader-elect=false", "--v=1"]

    # ------------------------------------------------------------------ helpers
    def _wait(self, cond, proc: Proc | None, timeout: float, what: str) -> None:
        wait_for(cond, proc, timeout, what, NodeError)

    def ctr(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / "ctr"), "--address", str(self.sock),
                               "--namespace", NAMESPACE, *map(str, args)],
                              capture_output=True, text=True, check=check, timeout=120)

    def _buildctl(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / "buildctl"), "--addr", self.buildkit_addr,
                               *args], capture_output=True, text=True, timeout=60)

    def _remove_stale_containers(self) -> None:
        ids = self.ctr("containers", "list", "--quiet", check=False).stdout.split()
        for cid in ids:
            self.ctr("tasks", "kill", "--signal", "SIGKILL", cid, check=False)
        for cid in ids:
            for _ in range(20):
                self.ctr("tasks", "delete", "--force", cid, check=False)
                if self.ctr("containers", "delete", cid, check=False).returncode == 0:
                    break
                time.sleep(0.1)

    def node_ready(self) -> bool:
        r = subprocess.run([str(self.bin_dir / "kubectl"), "--kubeconfig",
                            str(self.admin_kubeconfig), "get", "node", NODE_NAME, "-o", "json"],
                           capture_output=True, text=True, timeout=15)
        if r.returncode != 0:
            return False
        node = json.loads(r.stdout)
        conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        taints = node.get("spec", {}).get("taints") or []
        return conds.get("Ready") == "True" and not taints

    # ---------------------------------------------------------- fault injection
    def container_pid(self, container_id: str) -> int | None:
        """The host PID of a container's init process ("containerd://<id>" or "<id>")."""
        cid = container_id.split("://", 1)[-1]
        f = RUN_DIR / "containerd" / "io.containerd.runtime.v2.task" / NAMESPACE / cid / "init.pid"
        try:
            return int(f.read_text().strip())
        except (OSError, ValueError):
            return None

    def _pod(self, namespace: str, name: str) -> dict:
        r = subprocess.run([str(self.bin_dir / "kubectl"), "--kubeconfig",
                            str(self.admin_kubeconfig), "get", "pod", name, "-n", namespace,
                            "-o", "json"], capture_output=True, text=True, timeout=30)
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def pod_pids(self, namespace: str, name: str) -> dict[str, int]:
        """Host PIDs of the pod's running containers, by container name."""
        out = {}
        for cs in (self._pod(namespace, name).get("status") or {}).get("containerStatuses", []):
            if "running" in (cs.get("state") or {}) and cs.get("containerID"):
                pid = self.container_pid(cs["containerID"])
                if pid:
                    out[cs["name"]] = pid
        return out

    def kill_pod(self, namespace: str, name: str, sig: int = signal.SIGKILL,
                 container: str | None = None) -> int:
        """Signal the pod's running containers from the host (as the OOM killer or a node
        failure would: PID 1 of a container cannot be SIGKILLed from inside it)."""
        n = 0
        for cname, pid in self.pod_pids(namespace, name).items():
            if container in (None, cname):
                try:
                    os.kill(pid, sig)
                    n += 1
                except ProcessLookupError:
                    pass
        return n

    _UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}

    def _unpacked_bytes(self, ref: str) -> int:
        """Disk used by the image's unpacked snapshots (what `docker image ls` shows)."""
        out = self.ctr("images", "usage", "--snapshotter", "overlayfs", ref).stdout
        total = 0.0
        for line in out.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[2] in self._UNITS:
                total += float(parts[1]) * self._UNITS[parts[2]]
        return int(total)

    def image_info(self, ref: str) -> dict:
        """Size and layers of an image in the node's store (what `docker image ls` shows)."""
        r = self.ctr("images", "list", f"name=={ref}")
        lines = r.stdout.strip().splitlines()
        if len(lines) < 2:
            raise NodeError(f"image {ref} is not in the node's store")
        digest = lines[1].split()[2]
        manifest = json.loads(self.ctr("content", "get", digest).stdout)
        if "manifests" in manifest:  # an index: take the linux/amd64 manifest
            digest = manifest["manifests"][0]["digest"]
            manifest = json.loads(self.ctr("content", "get", digest).stdout)
        config = json.loads(self.ctr("content", "get", manifest["config"]["digest"]).stdout)
        layers = [lay["size"] for lay in manifest["layers"]]
        history = [h.get("created_by", "") for h in config.get("history", [])
                   if not h.get("empty_layer")]
        return {"ref": ref, "manifest": digest, "compressed_bytes": sum(layers),
                "unpacked_bytes": self._unpacked_bytes(ref),
                "layers": list(zip(layers, history, strict=False)),
                "user": config.get("config", {}).get("User"),
                "entrypoint": config.get("config", {}).get("Entrypoint")}
