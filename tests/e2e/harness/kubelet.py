"""A process "kubelet" (and scheduler) for the e2e control plane.

It registers one Ready ``Node``, binds every unscheduled pod to it through the
``pods/binding`` subresource, and runs each pod's containers as local processes
(``command``/``args`` resolved on the PATH of the current Python environment; the
image is ignored). Pod status is reported like the real kubelet does, deletion is
graceful (SIGTERM, ``terminationGracePeriodSeconds``, SIGKILL, then a delete with
``gracePeriodSeconds=0``), and restart policies are honoured.

In-cluster credentials: instead of /var/run/secrets/kubernetes.io/serviceaccount,
each pod gets ``KUBECONFIG`` pointing to a per-pod kubeconfig holding a bound
service-account token from the TokenRequest API (plus ``token``, ``ca.crt`` and
``namespace`` files next to it, whose directory is in ``JOBRUNNER_E2E_SA_DIR``),
unless ``automountServiceAccountToken`` is false on the pod or its service account.

Crash tests: ``Kubelet.kill_pod(ns, name, signal)`` or the pod annotation
``e2e.jobrunner.dev/kill: "9"`` (any new value, e.g. ``"9/2"``, signals again;
``e2e.jobrunner.dev/kill-container`` restricts it to one container).

Not emulated: volumes (no mounts; emptyDir-less), probes (containers are ready
once started), resource limits, image pulls, ``kubectl logs/exec`` (no kubelet
server) - use :meth:`Kubelet.pod_log` instead.
"""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from urllib.parse import quote, urlencode

import urllib3
import yaml

from .procs import _die_with_parent, kill_group

KILL_ANNOTATION = "e2e.jobrunner.dev/kill"
KILL_CONTAINER_ANNOTATION = "e2e.jobrunner.dev/kill-container"
POD_IP = "127.0.0.1"
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def now_micro() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


# --------------------------------------------------------------------------- REST
class ApiError(Exception):
    def __init__(self, status: int, body: bytes | str | None = None):
        self.status = status
        self.body = body.decode(errors="replace") if isinstance(body, bytes) else (body or "")
        try:
            self.reason = json.loads(self.body).get("reason", "")
            self.message = json.loads(self.body).get("message", "")
        except Exception:
            self.reason, self.message = "", self.body[:300]
        super().__init__(f"HTTP {status} {self.reason}: {self.message}")


class Rest:
    """Raw JSON requests through a kubernetes ``ApiClient``'s configured connection pool."""

    def __init__(self, api_client):
        self.api_client = api_client
        self.cfg = api_client.configuration
        self.pm = api_client.rest_client.pool_manager
        self.host = self.cfg.host.rstrip("/")

    def _headers(self, content_type: str | None) -> dict:
        h = {"Accept": "application/json", "User-Agent": "jobrunner-e2e-kubelet/1.0"}
        if content_type:
            h["Content-Type"] = content_type
        keys = getattr(self.cfg, "api_key", None) or {}
        for k in ("authorization", "BearerToken"):
            if keys.get(k):
                prefix = (getattr(self.cfg, "api_key_prefix", None) or {}).get(k, "")
                h["Authorization"] = f"{prefix} {keys[k]}".strip()
        return h

    def request(
        self,
        method: str,
        path: str,
        body=None,
        query: dict | None = None,
        content_type: str = "application/json",
        timeout: float = 20.0,
        stream: bool = False,
    ):
        url = self.host + path + (("?" + urlencode(query)) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        r = self.pm.request(
            method,
            url,
            body=data,
            headers=self._headers(content_type if data is not None else None),
            timeout=urllib3.Timeout(connect=5.0, read=timeout),
            preload_content=not stream,
            retries=False,
        )
        if stream:
            if r.status >= 400:
                body = r.read()
                r.release_conn()
                raise ApiError(r.status, body)
            return r
        if r.status >= 400:
            raise ApiError(r.status, r.data)
        return json.loads(r.data) if r.data else None

    def get(self, path, **kw):
        return self.request("GET", path, **kw)


def pod_path(ns: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{quote(ns)}/pods/{quote(name)}" + (f"/{sub}" if sub else "")


# ------------------------------------------------------------------- env helpers
_EXPAND = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(s: str, env: dict) -> str:
    """Kubernetes $(VAR) expansion: defined vars replaced, $$ -> $, others kept."""

    def rep(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _EXPAND.sub(rep, s)


class ConfigError(Exception):
    """Like the kubelet's CreateContainerConfigError."""


def _parse_quantity(q) -> Decimal:
    from kubernetes.utils import parse_quantity

    return Decimal(parse_quantity(q))


# ------------------------------------------------------------------- containers
@dataclass
class ContainerState:
    spec: dict
    init: bool = False
    restart_count: int = 0
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    done: bool = False  # terminated and will not be restarted
    started_once: bool = False

    @property
    def name(self) -> str:
        return self.spec["name"]

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def status(self) -> dict:
        running = "running" in self.state
        st = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": running,
            "started": running,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.popen is not None:
            st["containerID"] = f"process://{self.popen.pid}"
        return st


class PodRuntime:
    """Runs one pod; its own thread orchestrates containers and status."""

    def __init__(self, kubelet: Kubelet, pod: dict):
        self.k = kubelet
        self.pod = pod
        m = pod["metadata"]
        self.ns, self.name, self.uid = m["namespace"], m["name"], m["uid"]
        self.spec = pod["spec"]
        self.lock = threading.RLock()
        self.changed = threading.Event()
        self.deleted = False  # object is gone from the API
        self.stopping = False  # containers must not (re)start
        self.finished = threading.Event()
        self.phase = "Pending"
        self.reason = self.message = None
        self.start_time = (pod.get("status") or {}).get("startTime") or now_rfc3339()
        self.active_since = time.monotonic()
        self.init_done = not self.spec.get("initContainers")
        self.init = [ContainerState(c, init=True) for c in self.spec.get("initContainers") or []]
        self.main = [ContainerState(c) for c in self.spec.get("containers") or []]
        for c in self.main:
            if self.init:
                c.state = {"waiting": {"reason": "PodInitializing"}}
        self.cond_times: dict = {}
        self.dirty = True
        self.handled_kill = (m.get("annotations") or {}).get(KILL_ANNOTATION)
        safe = f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.dir = self.k.root / "pods" / safe
        self.log_dir = self.k.root / "logs" / self.ns / self.name / self.uid
        self.workdir = self.dir / "work"
        self.sa_dir: Path | None = None
        self.thread = threading.Thread(
            target=self._main, name=f"pod-{self.ns}/{self.name}", daemon=True
        )

    # ------------------------------------------------------------ public
    def start(self):
        self.thread.start()

    def update(self, pod: dict):
        with self.lock:
            self.pod = pod
            ann = pod["metadata"].get("annotations") or {}
            kill = ann.get(KILL_ANNOTATION)
        if kill and kill != self.handled_kill:
            self.handled_kill = kill
            try:
                sig = _parse_signal(kill.split("/")[0])
                self.kill(sig, ann.get(KILL_CONTAINER_ANNOTATION))
            except ValueError:
                self.k.log(f"bad {KILL_ANNOTATION} value {kill!r} on {self.ns}/{self.name}")
        self.changed.set()

    def gone(self):
        """The pod object was removed from the API (watch DELETED or relist)."""
        self.deleted = True
        self.changed.set()

    def kill(self, sig: int = signal.SIGKILL, container: str | None = None) -> int:
        n = 0
        with self.lock:
            for c in self.init + self.main:
                wanted = container is None or c.name == container
                if wanted and c.running() and kill_group(c.popen.pid, sig):
                    n += 1
        self.k.log(f"signal {sig} -> {n} container(s) of {self.ns}/{self.name}")
        return n

    def pids(self) -> dict:
        with self.lock:
            return {c.name: c.popen.pid for c in self.init + self.main if c.running()}

    # ------------------------------------------------------------ main loop
    def _main(self):
        try:
            self._run()
        except Exception:
            self.k.log(f"pod runtime {self.ns}/{self.name} crashed:\n{traceback.format_exc()}")
        finally:
            self._kill_all(signal.SIGKILL)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.finished.set()

    def _deletion(self):
        m = self.pod["metadata"]
        return m.get("deletionTimestamp"), m.get("deletionGracePeriodSeconds")

    def _run(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._push_status()
        terminal_status = (self.pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if terminal_status:  # e.g. kubelet restarted: never re-run a finished pod
            self.phase = self.pod["status"]["phase"]
            self.stopping = True
        elif self._deletion()[0]:  # already being deleted: never start it
            self.stopping = True
        else:
            threading.Thread(
                target=self._containers, daemon=True, name=f"containers-{self.ns}/{self.name}"
            ).start()
        term_deadline = None
        deleted_api = False
        while True:
            self.changed.wait(timeout=1.0)
            self.changed.clear()
            if self.k.stopping.is_set():
                self.stopping = True
                self._kill_all(signal.SIGTERM)
                self._wait_containers(2.0)
                return
            if self.deleted:
                self.stopping = True
                self._terminate(min(self._grace(), 2))
                return
            dts, grace = self._deletion()
            if dts and term_deadline is None:
                self.stopping = True
                g = grace if grace is not None else self._grace()
                term_deadline = time.monotonic() + g
                self.k.log(f"terminating {self.ns}/{self.name} (grace {g}s)")
                self._kill_all(signal.SIGTERM)
            if dts and grace is not None and term_deadline is not None:
                term_deadline = min(term_deadline, time.monotonic() + grace)
            ad = self.spec.get("activeDeadlineSeconds")
            if (
                ad is not None
                and not self.stopping
                and self.phase not in ("Succeeded", "Failed")
                and time.monotonic() - self.active_since > ad
            ):
                self.stopping = True
                self.reason, self.message = (
                    "DeadlineExceeded",
                    "Pod was active on the node longer than the specified deadline",
                )
                self._terminate(self._grace())
                self.phase = "Failed"
                self.dirty = True
            if term_deadline is not None:
                if self._any_running() and time.monotonic() >= term_deadline:
                    self._kill_all(signal.SIGKILL)
                if not self._any_running():
                    self._wait_containers(10)
                    self._compute_phase(final=True)
                    if self.dirty:
                        self._push_status()
                    if not self.dirty and not deleted_api:
                        deleted_api = self._delete_now()
                    if deleted_api:
                        # stay until the object disappears (finalizers) so that no
                        # new runtime is created for it; the watch will call gone().
                        pass
            self._compute_phase()
            if self.dirty:
                self._push_status()

    def _grace(self) -> int:
        g = self.spec.get("terminationGracePeriodSeconds")
        return 30 if g is None else int(g)

    def _any_running(self) -> bool:
        with self.lock:
            return any(c.running() for c in self.init + self.main)

    def _kill_all(self, sig):
        with self.lock:
            for c in self.init + self.main:
                if c.popen is not None and (c.popen.poll() is None or sig == signal.SIGKILL):
                    kill_group(c.popen.pid, sig)

    def _wait_containers(self, timeout: float):
        end = time.monotonic() + timeout
        while self._any_running() and time.monotonic() < end:
            time.sleep(0.05)

    def _terminate(self, grace: float):
        self._kill_all(signal.SIGTERM)
        self._wait_containers(grace)
        self._kill_all(signal.SIGKILL)
        self._wait_containers(5)

    def _delete_now(self) -> bool:
        try:
            self.k.rest.request(
                "DELETE",
                pod_path(self.ns, self.name),
                body={
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
            self.k.log(f"deleted {self.ns}/{self.name}")
            return True
        except ApiError as e:
            if e.status in (404, 409):
                return True
            self.k.log(f"delete {self.ns}/{self.name}: {e}")
        except Exception as e:
            self.k.log(f"delete {self.ns}/{self.name}: {e}")
        return False

    # ------------------------------------------------------------ containers
    def _containers(self):
        try:
            for c in self.init:
                if not self._run_container(c):
                    self._compute_phase()
                    self.changed.set()
                    return
            self.init_done = True
            for c in self.main:
                if c.state.get("waiting", {}).get("reason") == "PodInitializing":
                    c.state = {"waiting": {"reason": "ContainerCreating"}}
            self.dirty = True
            self.changed.set()
            threads = [
                threading.Thread(
                    target=self._run_container,
                    args=(c,),
                    daemon=True,
                    name=f"ctr-{self.ns}/{self.name}/{c.name}",
                )
                for c in self.main
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except Exception:
            self.k.log(f"containers of {self.ns}/{self.name} crashed:\n{traceback.format_exc()}")
        finally:
            self.changed.set()

    def _restart_wanted(self, c: ContainerState, code: int) -> bool:
        policy = self.spec.get("restartPolicy", "Always")
        if c.init:
            return policy != "Never" and code != 0
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _set(self, c: ContainerState, **kw):
        with self.lock:
            for k, v in kw.items():
                setattr(c, k, v)
            self.dirty = True
        self.changed.set()

    def _run_container(self, c: ContainerState) -> bool:
        """Run (and restart) one container. For init containers: True on success."""
        backoff = self.k.restart_backoff[0]
        while True:
            if self.stopping:
                return False
            try:
                env = self._container_env(c.spec)
                argv, cwd = self._argv_cwd(c.spec, env)
            except ConfigError as e:
                if c.state.get("waiting", {}).get("message") != str(e):
                    self.k.log(f"{self.ns}/{self.name}/{c.name}: CreateContainerConfigError: {e}")
                self._set(
                    c,
                    state={"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}},
                )
                self._sleep(2.0)
                continue
            except Exception as e:  # API unreachable etc.: retry like the kubelet
                self.k.log(f"{self.ns}/{self.name}/{c.name}: preparing: {type(e).__name__}: {e}")
                self._set(
                    c, state={"waiting": {"reason": "ContainerCreating", "message": str(e)[:200]}}
                )
                self._sleep(1.0)
                continue
            log_path = self.log_dir / f"{c.name}-{c.restart_count}.log"
            started = now_rfc3339()
            code, reason, message = None, None, None
            with self.lock:
                if self.stopping:
                    return False
                try:
                    with open(log_path, "ab") as log:
                        popen = subprocess.Popen(
                            argv,
                            cwd=cwd,
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=_die_with_parent,
                        )
                except OSError as e:
                    code, reason, message = (
                        128,
                        "StartError",
                        f"failed to start container process: {e}",
                    )
                    with open(log_path, "ab") as log:
                        log.write((message + "\n").encode())
                else:
                    c.popen = popen
                    c.started_once = True
                    c.state = {"running": {"startedAt": started}}
                    self.dirty = True
            self.changed.set()
            if code is None:
                self.k.log(f"started {self.ns}/{self.name}/{c.name} pid {c.popen.pid}: {argv}")
                rc = c.popen.wait()
                kill_group(
                    c.popen.pid, signal.SIGKILL
                )  # the "container" dies with its main process
                code = rc if rc >= 0 else 128 + (-rc)
                reason = "Completed" if code == 0 else "Error"
                self.k.log(f"exited {self.ns}/{self.name}/{c.name} code {code}")
            term = {
                "exitCode": code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": now_rfc3339(),
                "containerID": f"process://{c.popen.pid if c.popen else 0}",
            }
            if message:
                term["message"] = message
            if (code != 0 and code < 128) or reason == "StartError":
                pass
            restart = (not self.stopping) and self._restart_wanted(c, code)
            if not restart:
                self._set(c, state={"terminated": term}, done=True)
                return code == 0
            delay = backoff
            backoff = min(backoff * 2, self.k.restart_backoff[1])
            waiting_reason = "CrashLoopBackOff"
            with self.lock:
                c.last_state = {"terminated": term}
                c.state = {
                    "waiting": {
                        "reason": waiting_reason,
                        "message": f"back-off {delay:.0f}s restarting failed container="
                        f"{c.name} pod={self.name}_{self.ns}({self.uid})",
                    }
                }
                c.restart_count += 1
                self.dirty = True
            self.changed.set()
            if c.init and code == 0:
                return True
            self._sleep(delay)

    def _sleep(self, secs: float):
        end = time.monotonic() + secs
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def _argv_cwd(self, spec: dict, env: dict):
        cmd = [expand(x, env) for x in spec.get("command") or []]
        args = [expand(x, env) for x in spec.get("args") or []]
        argv = cmd + args
        if not argv:
            raise ConfigError("container has neither command nor args (images are not emulated)")
        wd = spec.get("workingDir")
        if wd:
            p = Path(wd)
            if not p.is_dir():  # don't litter the host: emulate inside the pod dir
                p = self.dir / "rootfs" / wd.lstrip("/")
                p.mkdir(parents=True, exist_ok=True)
            cwd = str(p)
        else:
            cwd = str(self.workdir)
        exe = argv[0]
        if "/" not in exe:
            found = shutil.which(exe, path=env.get("PATH", ""))
            if found:
                argv[0] = found
        elif not os.path.isabs(exe):
            argv[0] = os.path.join(cwd, exe)
        return argv, cwd

    # ------------------------------------------------------------ env
    def _container_env(self, spec: dict) -> dict:
        base = {
            "PATH": self.k.child_path,
            "HOME": str(self.workdir),
            "HOSTNAME": self.name,
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(self.dir),
        }
        if self.k.pythonpath:
            base["PYTHONPATH"] = os.pathsep.join(self.k.pythonpath)
        if os.environ.get("VIRTUAL_ENV"):
            base["VIRTUAL_ENV"] = os.environ["VIRTUAL_ENV"]
        sa_dir = self._service_account()
        if sa_dir is not None:
            base["KUBECONFIG"] = str(sa_dir / "kubeconfig")
            base["JOBRUNNER_E2E_SA_DIR"] = str(sa_dir)
        env: dict = {}
        for ef in spec.get("envFrom") or []:
            prefix = ef.get("prefix") or ""
            if "secretRef" in ef:
                data = self._get_obj("secrets", ef["secretRef"], decode=True)
            elif "configMapRef" in ef:
                data = self._get_obj("configmaps", ef["configMapRef"], decode=False)
            else:
                continue
            for k, v in (data or {}).items():
                if "=" not in k:
                    env[prefix + k] = v
        for e in spec.get("env") or []:
            name = e["name"]
            if "valueFrom" in e:
                v = self._value_from(e["valueFrom"], spec)
                if v is None:
                    continue
                env[name] = v
            else:
                env[name] = expand(e.get("value") or "", env)
        base.update(env)
        return base

    def _get_obj(self, kind: str, ref: dict, decode: bool):
        name = ref.get("name") or ""
        optional = bool(ref.get("optional"))
        try:
            obj = self.k.rest.get(f"/api/v1/namespaces/{quote(self.ns)}/{kind}/{quote(name)}")
        except ApiError as e:
            if e.status == 404:
                if optional:
                    return None
                raise ConfigError(f'{kind[:-1]} "{name}" not found') from None
            raise
        if decode:
            return {
                k: base64.b64decode(v).decode(errors="replace")
                for k, v in (obj.get("data") or {}).items()
            }
        out = dict(obj.get("data") or {})
        for k, v in (obj.get("binaryData") or {}).items():
            out.setdefault(k, base64.b64decode(v).decode(errors="replace"))
        return out

    def _value_from(self, vf: dict, spec: dict):
        m = self.pod["metadata"]
        if "fieldRef" in vf:
            path = vf["fieldRef"]["fieldPath"]
            simple = {
                "metadata.name": m.get("name"),
                "metadata.namespace": m.get("namespace"),
                "metadata.uid": m.get("uid"),
                "spec.nodeName": self.k.node_name,
                "spec.serviceAccountName": self.spec.get("serviceAccountName") or "default",
                "status.hostIP": POD_IP,
                "status.hostIPs": POD_IP,
                "status.podIP": POD_IP,
                "status.podIPs": POD_IP,
            }
            if path in simple:
                return simple[path] or ""
            mm = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
            if mm:
                return (m.get(mm.group(1)) or {}).get(mm.group(2), "")
            if path in ("metadata.labels", "metadata.annotations"):
                d = m.get(path.split(".")[1]) or {}
                return "\n".join(f'{k}="{v}"' for k, v in sorted(d.items()))
            raise ConfigError(f"unsupported fieldPath {path}")
        if "resourceFieldRef" in vf:
            r = vf["resourceFieldRef"]
            cname = r.get("containerName") or spec["name"]
            cspec = next(
                (
                    c
                    for c in (self.spec.get("containers") or [])
                    + (self.spec.get("initContainers") or [])
                    if c["name"] == cname
                ),
                spec,
            )
            kind, _, res = r["resource"].partition(".")
            q = ((cspec.get("resources") or {}).get(kind) or {}).get(res)
            if q is None and kind == "requests":
                q = ((cspec.get("resources") or {}).get("limits") or {}).get(res)
            if q is None:
                q = self.k.allocatable.get(res, "0")
            divisor = _parse_quantity(r.get("divisor") or "1") or Decimal(1)
            val = _parse_quantity(q) / divisor
            return str(math.ceil(val))
        for key, kind, decode in (
            ("secretKeyRef", "secrets", True),
            ("configMapKeyRef", "configmaps", False),
        ):
            if key in vf:
                ref = vf[key]
                data = self._get_obj(kind, ref, decode)
                if data is None:
                    return None
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise ConfigError(
                        f"couldn't find key {ref['key']} in {kind[:-1]} {self.ns}/{ref.get('name')}"
                    )
                return data[ref["key"]]
        raise ConfigError(f"unsupported valueFrom {vf}")

    def _service_account(self) -> Path | None:
        if self.sa_dir is not None:
            return self.sa_dir
        sa = self.spec.get("serviceAccountName") or "default"
        automount = self.spec.get("automountServiceAccountToken")
        if automount is None:
            try:
                obj = self.k.rest.get(
                    f"/api/v1/namespaces/{quote(self.ns)}/serviceaccounts/{quote(sa)}"
                )
                automount = obj.get("automountServiceAccountToken")
            except ApiError as e:
                if e.status != 404:
                    raise
        if automount is False:
            return None
        tr = self.k.rest.request(
            "POST",
            f"/api/v1/namespaces/{quote(self.ns)}/serviceaccounts/{quote(sa)}/token",
            body={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": self.k.token_seconds,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": self.name,
                        "uid": self.uid,
                    },
                },
            },
        )
        token = tr["status"]["token"]
        d = self.dir / "serviceaccount"
        d.mkdir(parents=True, exist_ok=True)
        (d / "token").write_text(token)
        (d / "ca.crt").write_bytes(self.k.ca_pem)
        (d / "namespace").write_text(self.ns)
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "in-cluster",
                    "cluster": {
                        "server": self.k.server,
                        "certificate-authority": str(d / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": sa, "user": {"tokenFile": str(d / "token")}}],
            "contexts": [
                {
                    "name": "in-cluster",
                    "context": {"cluster": "in-cluster", "user": sa, "namespace": self.ns},
                }
            ],
            "current-context": "in-cluster",
        }
        # client-go wants `tokenFile`, the Python client reads `token`: give both.
        cfg["users"][0]["user"]["token"] = token
        (d / "kubeconfig").write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.sa_dir = d
        return d

    # ------------------------------------------------------------ status
    def _compute_phase(self, final: bool = False):
        with self.lock:
            old = self.phase
            if self.phase in ("Succeeded", "Failed") and not final:
                return
            init_failed = any(
                c.done and "terminated" in c.state and c.state["terminated"]["exitCode"] != 0
                for c in self.init
            )
            if init_failed or self.reason == "DeadlineExceeded":
                self.phase = "Failed"
            elif self.main and all(c.done for c in self.main):
                codes = [c.state["terminated"]["exitCode"] for c in self.main]
                self.phase = "Succeeded" if all(x == 0 for x in codes) else "Failed"
            elif final:
                # terminated by deletion: a terminal phase before the object goes away
                codes = []
                for c in self.main:
                    t = c.state.get("terminated")
                    codes.append(t["exitCode"] if t else 137 if c.started_once else None)
                    if not t:
                        c.state = (
                            {
                                "terminated": {
                                    "exitCode": 137,
                                    "reason": "ContainerStatusUnknown",
                                    "message": "The container could not be located when "
                                    "the pod was terminated",
                                    "startedAt": None,
                                    "finishedAt": now_rfc3339(),
                                }
                            }
                            if not c.started_once
                            else c.state
                        )
                if (
                    all(x == 0 for x in codes if x is not None)
                    and all(x is not None for x in codes)
                    and self.spec.get("restartPolicy") != "Always"
                ):
                    self.phase = "Succeeded"
                else:
                    self.phase = "Failed"
            elif self.init_done and any("running" in c.state or c.started_once for c in self.main):
                self.phase = "Running"
            else:
                self.phase = "Pending"
            if old != self.phase:
                self.dirty = True
                self.k.log(f"{self.ns}/{self.name}: {old} -> {self.phase}")

    def _conditions(self) -> list:
        terminal = self.phase in ("Succeeded", "Failed")
        all_ready = (
            bool(self.main) and all("running" in c.state for c in self.main) and not terminal
        )
        want = {
            "PodReadyToStartContainers": not terminal or self._any_running(),
            "Initialized": self.init_done,
            "ContainersReady": all_ready,
            "Ready": all_ready,
        }
        reasons = {
            "ContainersReady": "ContainersNotReady",
            "Ready": "ContainersNotReady",
            "Initialized": "ContainersNotInitialized",
        }
        if terminal:
            reasons.update(
                {
                    "ContainersReady": "PodCompleted",
                    "Ready": "PodCompleted",
                    "Initialized": "PodCompleted",
                }
            )
        out = []
        for t in OWN_CONDITIONS:
            status = "True" if want[t] else "False"
            prev = self.cond_times.get(t)
            if prev is None or prev[0] != status:
                self.cond_times[t] = (status, now_rfc3339())
            c = {
                "type": t,
                "status": status,
                "lastProbeTime": None,
                "lastTransitionTime": self.cond_times[t][1],
            }
            if status == "False" and t in reasons:
                c["reason"] = reasons[t]
            out.append(c)
        return out

    def _status_body(self, current: dict) -> dict:
        st = dict(current.get("status") or {})
        foreign = [c for c in st.get("conditions") or [] if c.get("type") not in OWN_CONDITIONS]
        with self.lock:
            st.update(
                {
                    "phase": self.phase,
                    "hostIP": POD_IP,
                    "hostIPs": [{"ip": POD_IP}],
                    "podIP": POD_IP,
                    "podIPs": [{"ip": POD_IP}],
                    "startTime": st.get("startTime") or self.start_time,
                    "conditions": foreign + self._conditions(),
                    "containerStatuses": [c.status() for c in self.main],
                }
            )
            if self.init:
                st["initContainerStatuses"] = [c.status() for c in self.init]
            if self.reason:
                st["reason"], st["message"] = self.reason, self.message
            self.dirty = False
        if not any(c.get("type") == "PodScheduled" for c in st["conditions"]):
            st["conditions"].insert(
                0,
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastProbeTime": None,
                    "lastTransitionTime": self.start_time,
                },
            )
        return st

    def _push_status(self) -> bool:
        for _ in range(5):
            try:
                cur = self.k.rest.get(pod_path(self.ns, self.name))
                if cur["metadata"]["uid"] != self.uid:
                    self.gone()
                    return True
                cur["status"] = self._status_body(cur)
                self.k.rest.request("PUT", pod_path(self.ns, self.name, "status"), body=cur)
                return True
            except ApiError as e:
                if e.status == 404:
                    self.dirty = False
                    self.gone()
                    return True
                if e.status == 409:
                    self.dirty = True
                    continue
                self.dirty = True
                self.k.log(f"status {self.ns}/{self.name}: {e}")
                return False
            except Exception as e:  # API server down: retried by the main loop
                self.dirty = True
                self.k.log(f"status {self.ns}/{self.name}: {type(e).__name__}: {str(e)[:200]}")
                return False
        self.dirty = True
        return False


def _parse_signal(v) -> int:
    v = str(v).strip().upper()
    if v.isdigit():
        return int(v)
    if not v.startswith("SIG"):
        v = "SIG" + v
    try:
        return int(getattr(signal, v))
    except AttributeError:
        raise ValueError(v) from None


# --------------------------------------------------------------------- kubelet
class Kubelet:
    def __init__(
        self,
        api_client_factory,
        server: str,
        ca_pem: bytes,
        root: Path,
        node_name: str = "e2e-node",
        extra_path=(),
        pythonpath=(),
        k8s_version: str = "v0.0.0",
        restart_backoff=(1.0, 16.0),
        token_seconds: int = 86400,
        verbose: bool | None = None,
    ):
        self._factory = api_client_factory
        self.server = server
        self.ca_pem = ca_pem
        self.root = Path(root)
        self.node_name = node_name
        self.k8s_version = k8s_version
        self.restart_backoff = restart_backoff
        self.token_seconds = token_seconds
        self.pythonpath = list(pythonpath)
        py_bin = os.path.dirname(sys.executable)
        self.child_path = os.pathsep.join(
            [py_bin, *extra_path, os.environ.get("PATH", "/usr/bin:/bin")]
        )
        self.verbose = (
            bool(os.environ.get("JOBRUNNER_E2E_KUBELET_VERBOSE")) if verbose is None else verbose
        )
        self.allocatable = {
            "cpu": str(os.cpu_count() or 2),
            "memory": "16Gi",
            "pods": "110",
            "ephemeral-storage": "50Gi",
        }
        self.stopping = threading.Event()
        self._lock = threading.RLock()
        self.runtimes: dict[str, PodRuntime] = {}  # uid -> runtime
        self._cache: dict[str, dict] = {}  # uid -> last seen pod
        self._threads: list[threading.Thread] = []
        self._node_ok = False
        self._log_file = None
        self._watch_resp = None
        self.rest = Rest(self._new_client())

    def _new_client(self):
        return self._factory(pool_maxsize=32) if _accepts_pool(self._factory) else self._factory()

    def log(self, msg: str):
        line = f"{time.strftime('%H:%M:%S')} {msg}\n"
        if self._log_file is not None:
            try:
                self._log_file.write(line)
                self._log_file.flush()
            except ValueError:
                pass
        if self.verbose:
            sys.stderr.write("[kubelet] " + line)

    # ------------------------------------------------------------ lifecycle
    def start(self):
        self.root.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.root / "kubelet.log", "a")  # noqa: SIM115 (closed in stop)
        for target, name in (
            (self._node_loop, "kubelet-node"),
            (self._watch_loop, "kubelet-watch"),
            (self._resync_loop, "kubelet-resync"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self):
        self.stopping.set()
        with self._lock:
            rts = list(self.runtimes.values())
        for rt in rts:
            rt.changed.set()
        for rt in rts:
            rt.finished.wait(timeout=10)
        resp = self._watch_resp
        if resp is not None:  # unblock the watch thread's read
            try:
                resp.shutdown() if hasattr(resp, "shutdown") else resp.close()
            except Exception:
                pass
        for t in self._threads:
            t.join(timeout=2)
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    # ------------------------------------------------------------ node
    def node_ready(self) -> bool:
        return self._node_ok

    def _node_body(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "process",
                },
            },
            "spec": {},
        }

    def _node_status(self) -> dict:
        now = now_rfc3339()

        def cond(t, status, reason, msg):
            return {
                "type": t,
                "status": status,
                "reason": reason,
                "message": msg,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._boot_time,
            }

        return {
            "conditions": [
                cond(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                ),
                cond(
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure",
                    "kubelet has no disk pressure",
                ),
                cond(
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID",
                    "kubelet has sufficient PID available",
                ),
                cond("Ready", "True", "KubeletReady", "process kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": POD_IP},
                {"type": "Hostname", "address": self.node_name},
            ],
            "capacity": dict(self.allocatable),
            "allocatable": dict(self.allocatable),
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": self._machine_id,
                "systemUUID": self._machine_id,
                "bootID": self._boot_id,
                "kernelVersion": platform.release(),
                "osImage": "jobrunner-e2e process kubelet",
                "containerRuntimeVersion": "process://1.0",
                "kubeletVersion": self.k8s_version,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _node_loop(self):
        self._machine_id = uuid.uuid4().hex
        self._boot_id = str(uuid.uuid4())
        self._boot_time = now_rfc3339()
        last_status = 0.0
        while not self.stopping.is_set():
            try:
                try:
                    node = self.rest.get(f"/api/v1/nodes/{self.node_name}")
                except ApiError as e:
                    if e.status != 404:
                        raise
                    node = self.rest.request("POST", "/api/v1/nodes", body=self._node_body())
                    self.log(f"registered node {self.node_name}")
                    last_status = 0.0
                if time.monotonic() - last_status > 10 or not self._node_ok:
                    node["status"] = self._node_status()
                    self.rest.request("PUT", f"/api/v1/nodes/{self.node_name}/status", body=node)
                    last_status = time.monotonic()
                self._renew_lease(node)
                self._node_ok = True
            except Exception as e:
                self._node_ok = False
                self.log(f"node heartbeat: {type(e).__name__}: {str(e)[:200]}")
                self.stopping.wait(1.0)
                continue
            self.stopping.wait(5.0)

    def _renew_lease(self, node: dict):
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}"
        try:
            lease = self.rest.get(path)
            lease["spec"]["renewTime"] = now_micro()
            lease["spec"]["holderIdentity"] = self.node_name
            self.rest.request("PUT", path, body=lease)
        except ApiError as e:
            if e.status != 404:
                raise
            self.rest.request(
                "POST",
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                body={
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.node_name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [
                            {
                                "apiVersion": "v1",
                                "kind": "Node",
                                "name": self.node_name,
                                "uid": node["metadata"]["uid"],
                            }
                        ],
                    },
                    "spec": {
                        "holderIdentity": self.node_name,
                        "leaseDurationSeconds": 40,
                        "renewTime": now_micro(),
                    },
                },
            )

    # ------------------------------------------------------------ pods
    def _watch_loop(self):
        rest = Rest(self._new_client())
        while not self.stopping.is_set():
            try:
                lst = rest.get("/api/v1/pods", query={"limit": "0"}, timeout=30)
                rv = lst["metadata"]["resourceVersion"]
                seen = set()
                for p in lst.get("items") or []:
                    seen.add(p["metadata"]["uid"])
                    self._on_pod(p)
                with self._lock:
                    missing = [u for u in list(self._cache) if u not in seen]
                for u in missing:
                    self._on_gone(u)
                while not self.stopping.is_set():
                    rv = self._watch_once(rest, rv)
            except _Relist:
                continue
            except Exception as e:
                if not self.stopping.is_set():
                    self.log(f"pod watch: {type(e).__name__}: {str(e)[:200]}; relisting")
                    self.stopping.wait(1.0)

    def _watch_once(self, rest: Rest, rv: str) -> str:
        r = rest.request(
            "GET",
            "/api/v1/pods",
            query={
                "watch": "true",
                "resourceVersion": rv,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": "30",
            },
            timeout=45,
            stream=True,
        )
        self._watch_resp = r
        try:
            buf = b""
            for chunk in r.stream(4096, decode_content=True):
                if self.stopping.is_set():
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    typ, obj = ev.get("type"), ev.get("object") or {}
                    if typ == "ERROR":
                        self.log(f"watch error: {obj.get('code')} {obj.get('message')}")
                        raise _Relist()
                    new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if new_rv:
                        rv = new_rv
                    if typ == "BOOKMARK":
                        continue
                    if typ == "DELETED":
                        self._on_gone(obj["metadata"]["uid"])
                    else:
                        self._on_pod(obj)
        finally:
            self._watch_resp = None
            r.release_conn()
        return rv

    def _resync_loop(self):
        while not self.stopping.wait(3.0):
            with self._lock:
                pods = list(self._cache.values())
            for p in pods:
                if self.stopping.is_set():
                    return
                try:
                    self._on_pod(p, resync=True)
                except Exception as e:
                    self.log(f"resync: {e}")

    def _on_gone(self, uid: str):
        with self._lock:
            self._cache.pop(uid, None)
            rt = self.runtimes.pop(uid, None)
        if rt is not None:
            rt.gone()

    def _on_pod(self, pod: dict, resync: bool = False):
        if self.stopping.is_set():
            return
        m, spec = pod["metadata"], pod.get("spec") or {}
        uid = m["uid"]
        node = spec.get("nodeName")
        with self._lock:
            if not resync:
                self._cache[uid] = pod
            elif uid not in self._cache:
                return
            rt = self.runtimes.get(uid)
        if not node:
            if (
                not m.get("deletionTimestamp")
                and (spec.get("schedulerName") or "default-scheduler") == "default-scheduler"
            ):
                self._bind(pod)
            return
        if node != self.node_name:
            return
        if rt is not None:
            if not resync:
                rt.update(pod)
            return
        with self._lock:
            if uid in self.runtimes or self.stopping.is_set():
                return
            rt = PodRuntime(self, pod)
            self.runtimes[uid] = rt
        rt.start()

    def _bind(self, pod: dict):
        m = pod["metadata"]
        try:
            self.rest.request(
                "POST",
                pod_path(m["namespace"], m["name"], "binding"),
                body={
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m["uid"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
                },
            )
            self.log(f"bound {m['namespace']}/{m['name']} to {self.node_name}")
        except ApiError as e:
            if e.status not in (404, 409):
                self.log(f"bind {m['namespace']}/{m['name']}: {e}")
        except Exception as e:
            self.log(f"bind {m['namespace']}/{m['name']}: {type(e).__name__}: {e}")

    # ------------------------------------------------------------ test helpers
    def _runtime(self, namespace: str, name: str) -> PodRuntime | None:
        with self._lock:
            rts = [rt for rt in self.runtimes.values() if rt.ns == namespace and rt.name == name]
        live = [rt for rt in rts if not rt.finished.is_set()]
        return (live or rts or [None])[-1]

    def kill_pod(
        self, namespace: str, name: str, sig: int = signal.SIGKILL, container: str | None = None
    ) -> int:
        """Send ``sig`` to the process group of the pod's running container(s); returns how many."""
        rt = self._runtime(namespace, name)
        if rt is None:
            raise LookupError(f"pod {namespace}/{name} is not running on {self.node_name}")
        return rt.kill(_parse_signal(sig), container)

    def pod_pids(self, namespace: str, name: str) -> dict:
        rt = self._runtime(namespace, name)
        return rt.pids() if rt else {}

    def pod_log(
        self, namespace: str, name: str, container: str | None = None, previous: bool = False
    ) -> str:
        """Combined stdout/stderr of a container (default: the pod's first container) of the
        most recent pod with that name; ``previous`` gives the instance before the last restart."""
        base = self.root / "logs" / namespace / name
        if not base.is_dir():
            raise FileNotFoundError(f"no logs for pod {namespace}/{name}")
        uid_dir = max(base.iterdir(), key=lambda p: p.stat().st_mtime)
        if container is None:
            rt = self.runtimes.get(uid_dir.name)
            if rt is not None and rt.main:
                container = rt.main[0].name
            else:
                names = sorted({f.name.rsplit("-", 1)[0] for f in uid_dir.glob("*.log")})
                if not names:
                    return ""
                container = names[0]
        files = sorted(
            uid_dir.glob(f"{container}-*.log"), key=lambda f: int(f.stem.rsplit("-", 1)[1])
        )
        if not files:
            return ""
        f = files[-2] if previous and len(files) > 1 else files[-1]
        if previous and len(files) < 2:
            raise FileNotFoundError(f"no previous instance of {namespace}/{name}/{container}")
        return f.read_text(errors="replace")

    def log_dir(self, namespace: str, name: str) -> Path:
        return self.root / "logs" / namespace / name


class _Relist(Exception):
    pass


def _accepts_pool(factory) -> bool:
    import inspect

    try:
        return "pool_maxsize" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
