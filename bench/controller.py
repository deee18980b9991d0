"""7b. The operator's footprint: ``jobrunner-controller`` watching N BatchRuns.

Real parts only: the e2e harness's control plane (tests/e2e/harness: etcd, kube-apiserver,
kube-controller-manager), the bench's PostgreSQL as the queue, and the controller as its
own process, started the way the e2e ``operator`` fixture starts it. The harness's process
kubelet is left out: the workers' pods stay Pending, so nothing but the controller (and
the control plane) does work while it is measured.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import yaml

from jobrunner.local.embedded import free_port

from .env import (
    Server,
    child_env,
    children,
    rss_kib,
    spawn,
    stop_processes,
    tree_cpu,
    wait_until,
)
from .systems import Jobrunner

NAMESPACE = "bench"
TASKS_PER_RUN = 10
APP_NAME = "jobrunner-controller"  # the controller's pool sets this application_name
REFRESH_SECONDS = "5"  # the chart's default (controller.refreshSeconds); e2e tests use 1


class ControllerDb(Jobrunner):
    """The queue database the controller's BatchRuns point at (migrated up front, as a
    real installation's would be: the first reconcile then only checks the version)."""

    db = "bench_controller"


# -- the control plane ----------------------------------------------------------------------
def require_binaries() -> Path:
    """The cached control-plane binaries, or a clear failure: building them takes about ten
    minutes and needs Go, which is not something a benchmark stage should start on its own."""
    from tests.e2e.harness import build

    bin_dir = build.bin_dir()
    missing = [n for n in build.K8S_BINARIES if not os.access(bin_dir / n, os.X_OK)]
    if missing:
        raise RuntimeError(
            f"controller stage: the control-plane binaries {', '.join(missing)} are not built "
            f"in {bin_dir}; build them once with `make e2e-bins` (or `python -m "
            "tests.e2e.harness.build`; needs Go, about 10 minutes cold), then rerun "
            "`python -m bench --only controller`")
    return bin_dir


def start_cluster(bin_dir: Path) -> Any:
    from tests.e2e.harness.cluster import Cluster

    return Cluster(bin_dir, with_kubelet=False).start()


def prepare_namespace(cluster: Any, dsn: str) -> None:
    """CRDs, the namespace and the default database Secret (what the chart and a user do)."""
    from tests.e2e.operator_support import apply_crds, create_db_secret

    apply_crds(cluster)
    cluster.kubectl("create", "namespace", NAMESPACE)
    # the Job controller cannot create pods before the namespace's default account exists
    cluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", NAMESPACE,
                    "--timeout=60s")
    create_db_secret(cluster, NAMESPACE, dsn)
    # A CRD that was just established still answers with 429 "storage is (re)initializing"
    # for a moment; a controller started then logs a retried error that a real installation
    # (CRDs installed long before) never sees. Once kubectl can list BatchRuns, the API
    # server's cache for them is ready.
    wait_until(lambda: cluster.kubectl("get", "batchruns", "-n", NAMESPACE,
                                       check=False).returncode == 0,
               60, 0.5, "the API server to list BatchRuns")


def batchruns_yaml(n: int) -> str:
    """n small BatchRuns: 10 generated tasks and one worker each."""
    docs = [{"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
             "metadata": {"name": f"run-{i:04d}", "namespace": NAMESPACE},
             "spec": {"tenant": "bench", "workers": 1, "handler": "bench.handlers:noop",
                      "shardRange": {"count": TASKS_PER_RUN}}}
            for i in range(n)]
    return yaml.safe_dump_all(docs)


# -- the controller process -----------------------------------------------------------------
def start_controller(cluster: Any, log: Path, metrics_port: int,
                     health_port: int) -> subprocess.Popen:
    """`python -m jobrunner.operator` as the e2e fixture runs it, but with the chart's refresh
    interval, JSON logs and the metrics and health servers on: the deployed footprint."""
    env = child_env(KUBECONFIG=str(cluster.kubeconfig), PATH=cluster.env["PATH"],
                    JOBRUNNER_REFRESH_SECONDS=REFRESH_SECONDS,
                    JOBRUNNER_WORKER_IMAGE="jobrunner:bench")
    return spawn([sys.executable, "-m", "jobrunner.operator", "--namespace", NAMESPACE,
                  "--standalone",
                  "--metrics-port", str(metrics_port), "--health-port", str(health_port),
                  "--log-format", "json"], env=env, log=log)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_started(proc: subprocess.Popen, health_port: int, log: Path) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the controller exited ({proc.returncode}):\n{_tail(log)}")
        return _http_ok(f"http://127.0.0.1:{health_port}/healthz")

    wait_until(up, 120, 0.2, "the controller's health endpoint")


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def tree(pid: int) -> list[int]:
    return [pid, *(p for c in children(pid) for p in tree(c))]


def tree_rss_kib(pid: int) -> int:
    total = 0
    for p in tree(pid):
        try:
            total += rss_kib(p)
        except OSError:  # a child that just exited
            pass
    return total


def threads(pid: int) -> int:
    return sum(len(os.listdir(f"/proc/{p}/task")) for p in tree(pid))


# -- measuring ------------------------------------------------------------------------------
CONNECTIONS = """
SELECT count(*) FILTER (WHERE application_name = %(app)s), count(*)
FROM pg_stat_activity WHERE datname = %(db)s AND backend_type = 'client backend'
"""


def sample(proc: subprocess.Popen, server: Server, cluster: Any, seconds: float) -> dict:
    """Once a second for `seconds`: the controller's RSS, threads and PostgreSQL connections
    (named ones, and every connection to its database: nothing else uses that database);
    CPU of the controller, of PostgreSQL and of the API server over the whole window."""
    rss: list[int] = []
    named: list[int] = []
    total: list[int] = []
    most_threads = 0
    apiserver = cluster.apiserver.popen.pid
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        cpu0, pg0, api0 = tree_cpu(proc.pid), server.cpu_seconds(), tree_cpu(apiserver)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            if proc.poll() is not None:
                raise RuntimeError(f"the controller exited ({proc.returncode}) while sampled")
            rss.append(tree_rss_kib(proc.pid))
            most_threads = max(most_threads, threads(proc.pid))
            row = conn.execute(CONNECTIONS, {"app": APP_NAME, "db": ControllerDb.db}).fetchone()
            named.append(row[0])
            total.append(row[1])
            time.sleep(1.0)
        elapsed = time.monotonic() - t0
        cpu, pg, api = (tree_cpu(proc.pid) - cpu0, server.cpu_seconds() - pg0,
                        tree_cpu(apiserver) - api0)
    return {"window_s": round(elapsed, 1), "samples": len(rss),
            "rss_mib": round(statistics.median(rss) / 1024, 1),
            "rss_max_mib": round(max(rss) / 1024, 1),
            "rss_first_mib": round(rss[0] / 1024, 1), "rss_last_mib": round(rss[-1] / 1024, 1),
            "threads": most_threads, "connections": max(named),
            "connections_median": statistics.median(named),
            "connections_any_name": max(total),
            "cpu_s_per_min": round(cpu / elapsed * 60, 2),
            "postgres_cpu_s_per_min": round(pg / elapsed * 60, 2),
            "apiserver_cpu_s_per_min": round(api / elapsed * 60, 2)}


def _reconciled(item: dict) -> bool:
    """Enqueued and its Job made: the create handler's work is done."""
    status = item.get("status") or {}
    return bool(status.get("phase") and (status.get("milestones") or {}).get("enqueued")
                and status.get("jobName"))


def wait_reconciled(cluster: Any, proc: subprocess.Popen, n: int, started: float,
                    timeout: float, log: Path) -> list[float]:
    """Poll the BatchRuns until all n are reconciled; seconds from `started` for each."""
    from kubernetes import client

    with cluster.api_client() as api_client:
        return _poll_reconciled(client.CustomObjectsApi(api_client), proc, n, started,
                                timeout, log)


def _poll_reconciled(api: Any, proc: subprocess.Popen, n: int, started: float,
                     timeout: float, log: Path) -> list[float]:
    seen: dict[str, float] = {}
    deadline = started + timeout
    while len(seen) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"the controller exited ({proc.returncode}):\n{_tail(log)}")
        items = api.list_namespaced_custom_object("jobrunner.dev", "v1alpha1", NAMESPACE,
                                                  "batchruns")["items"]
        now = time.monotonic()
        for item in items:
            if item["metadata"]["name"] not in seen and _reconciled(item):
                seen[item["metadata"]["name"]] = now - started
        if now > deadline:
            phases = statistics.multimode(
                [(i.get("status") or {}).get("phase") for i in items if not _reconciled(i)])
            raise TimeoutError(f"{n - len(seen)} of {n} BatchRuns not reconciled after "
                               f"{timeout:.0f}s (most common phase {phases}):\n{_tail(log)}")
        time.sleep(0.25)
    return sorted(seen.values())


def phases(cluster: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in json.loads(cluster.kubectl("get", "batchruns", "-n", NAMESPACE, "-o",
                                           "json").stdout)["items"]:
        phase = (item.get("status") or {}).get("phase") or "none"
        out[phase] = out.get(phase, 0) + 1
    return out


def count_jobs(cluster: Any) -> int:
    return len(json.loads(cluster.kubectl("get", "jobs", "-n", NAMESPACE, "-o",
                                          "json").stdout)["items"])


def count_tasks(dsn: str) -> int:
    # A connection of its own, closed at once (System.sql may keep one open): sampling
    # counts every connection to this database as the controller's.
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM agent_work_queue").fetchone()[0]


def log_lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.exists() else []


def log_summary(lines: list[str], limit: int = 8) -> dict:
    """Warnings and errors in the controller's JSON log lines, with a few distinct messages."""
    levels: dict[str, int] = {}
    messages: list[str] = []
    other = 0
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            other += 1  # a traceback or a library printing outside logging
            continue
        level = entry.get("level", "?")
        levels[level] = levels.get(level, 0) + 1
        if level in ("warning", "error", "critical"):
            text = f"{level}: {entry.get('logger')}: {entry.get('msg', '')}"[:240]
            if text not in messages and len(messages) < limit:
                messages.append(text)
    return {"levels": levels, "non_json_lines": other, "messages": messages}


def reconcile_errors(metrics_port: int) -> dict[str, float]:
    """jobrunner_reconcile_errors_total by reason, from the controller's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("jobrunner_reconcile_errors_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return out


# -- the stage ------------------------------------------------------------------------------
def controller(server: Server, runs: int, window: float, logdir: Path) -> dict:
    """The controller just started (0 BatchRuns), then watching `runs` BatchRuns."""
    bin_dir = require_binaries()
    db = ControllerDb(server)
    db.setup()  # a new database on this invocation's server: empty and migrated
    log = logdir / "controller.log"
    cluster = start_cluster(bin_dir)
    procs: list[subprocess.Popen] = []
    try:
        prepare_namespace(cluster, db.dsn)
        result = measure(cluster, server, db, runs, window, log, procs)
        measured = len(log_lines(log))
    finally:
        stopping = time.monotonic()
        stop_processes(procs, timeout=20)  # SIGTERM, SIGKILL after 20 s
        stop_s = time.monotonic() - stopping
        cluster.stop()
    result["stop_s"] = round(stop_s, 1)
    result["stop_returncode"] = procs[0].returncode
    # Apart: what it logs while stopping (kopf abandons, with a warning, a timer whose sync
    # handler is still running in a thread at SIGTERM) is not trouble of the measured run.
    lines = log_lines(log)
    result["log"] = log_summary(lines[:measured])
    result["log_shutdown"] = log_summary(lines[measured:])
    return result


def measure(cluster: Any, server: Server, db: ControllerDb, runs: int, window: float,
            log: Path, procs: list[subprocess.Popen]) -> dict:
    """Start the controller (into `procs`, for the caller to stop), sample it idle, apply
    the BatchRuns, wait for all to be reconciled, sample it watching them."""
    metrics_port, health_port = free_port(), free_port()
    proc = start_controller(cluster, log, metrics_port, health_port)
    procs.append(proc)
    wait_started(proc, health_port, log)
    time.sleep(3.0)  # past the watch streams' start
    empty = sample(proc, server, cluster, min(window, 10.0))
    print(f"  controller, 0 BatchRuns: {empty}", flush=True)

    started = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=batchruns_yaml(runs), timeout=300)
    applied_s = time.monotonic() - started
    done = wait_reconciled(cluster, proc, runs, started, 120 + 3 * runs, log)
    print(f"  controller: {runs} BatchRuns reconciled in {done[-1]:.1f}s", flush=True)
    # one refresh interval, so the timers of every run are in their steady rhythm
    time.sleep(float(REFRESH_SECONDS) + 2)
    watching = sample(proc, server, cluster, window)
    print(f"  controller, {runs} BatchRuns: {watching}", flush=True)
    return {
        "batchruns": runs, "tasks_per_run": TASKS_PER_RUN,
        "refresh_seconds": float(REFRESH_SECONDS),
        "apply_s": round(applied_s, 2), "reconciled_s": round(done[-1], 1),
        "reconciled_p50_s": round(statistics.median(done), 1),
        "first_reconciled_s": round(done[0], 1),
        "idle": empty, "watching": watching,
        "phases": phases(cluster), "jobs": count_jobs(cluster),
        "tasks_enqueued": count_tasks(db.dsn),
        "reconcile_errors": reconcile_errors(metrics_port),
    }
