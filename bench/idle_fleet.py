"""``python -m bench.idle_fleet [--before DIR]``: what a waiting fleet costs the database,
and how fast it reacts (issue 30), side by side in one run.

Systems, each N simulated pods (bench/fleet_child.py: one Worker, or peer worker, per pod
with its own connections and timers, 100 pods per process):

- jobrunner (this tree): queue and heartbeat connections through PgBouncer (transaction
  pooling, 20 server connections), the notifier's one LISTEN connection per pod direct
  (JOBRUNNER_LISTEN_DATABASE_URL): the deployment docs/scaling.md recommends.
- jobrunner (DIR, e.g. main): the same through PgBouncer with --no-listen, the deployment
  the older docs/scaling.md recommended (no LISTEN through a transaction pooler).
- pgqueuer and procrastinate: their workers' defaults, direct connections (both need
  LISTEN, which PgBouncer's transaction pooling does not carry).

Measured, for N in --pods, interleaved over --reps repetitions:
- idle: nothing to do; after --settle seconds, the server's CPU (every backend and
  background process of the embedded server, the harness's own connection left out) and
  PgBouncer's over --window seconds, minus the same server's CPU with no pods at all,
  per waiting pod per second; the server connections (backends) and PgBouncer clients.
- wake-up (jobrunner systems, the largest N): a task enqueued while every pod waits,
  the enqueue call -> the handler's start (wall clock, same host), --wake samples; then
  --wake more with enqueues only 0.3-0.6 s apart, the fleet still busy (WAKE_GAPS).
- retry: a task whose first attempt fails (backoff base 1 s: due 2-2.5 s later), its
  run_after (read from its row while pending) -> the second attempt's start.

Writes bench/results/idle-fleet.md and idle-fleet.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue

from . import env
from .report import table
from .scenarios import PG_USER, free_port, pct
from .systems import BATCH, TENANT, Jobrunner, PgQueuer, Procrastinate

# Pods simulated per Python process (--pods-per-process). 100 fits 1,000 pods in memory
# for the idle cost, where nothing runs; for the wake-up it is not faithful: a note wakes
# every pod of a process at once and their threads queue for one GIL (1 pod: 6.5 ms from
# enqueue to handler; 50 in one process: 55-68 ms, stop 42). 10 per process: 100
# processes, ~8 GiB.
PODS_PER_CHILD = 100
BOUNCER_POOL = 20
BOUNCER_INI = """[databases]
bench = host=127.0.0.1 port={pg_port} dbname={db} user=postgres password={password}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
auth_type = plain
auth_file = {auth}
admin_users = postgres
pool_mode = transaction
default_pool_size = {pool}
max_client_conn = 4000
max_db_connections = {pool}
ignore_startup_parameters = extra_float_digits,options,application_name
logfile = {log}
pidfile = {pid}
"""


class Bouncer:
    def __init__(self, server: env.Server, db: str) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise SystemExit("pgbouncer is not installed (apt-get install pgbouncer)")
        self.work = Path(tempfile.mkdtemp(prefix="bench-idle-bouncer-"))
        self.port = free_port()
        password = server.pg.password
        (self.work / "users.txt").write_text(f'"postgres" "{password}"\n')
        (self.work / "pgbouncer.ini").write_text(BOUNCER_INI.format(
            pg_port=server.pg.port, db=db, password=password, port=self.port,
            auth=self.work / "users.txt", pool=BOUNCER_POOL, log=self.work / "pgbouncer.log",
            pid=self.work / "pgbouncer.pid"))
        user_args: list[str] = []
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            for f in [self.work, *self.work.iterdir()]:
                shutil.chown(f, PG_USER, PG_USER)
            user_args = ["-u", PG_USER]
        self.proc = subprocess.Popen([binary, *user_args, str(self.work / "pgbouncer.ini")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.admin = f"postgresql://postgres:{password}@127.0.0.1:{self.port}/pgbouncer"
        self.dsn = f"postgresql://postgres:{password}@127.0.0.1:{self.port}/bench"
        env.wait_until(self._up, 30, 0.1, "pgbouncer")

    def _up(self) -> bool:
        try:
            psycopg.connect(self.admin, autocommit=True, connect_timeout=2,
                            prepare_threshold=None).close()
            return True
        except psycopg.OperationalError:
            return False

    def clients(self) -> int:
        with psycopg.connect(self.admin, autocommit=True, prepare_threshold=None) as c:
            return sum(1 for r in c.execute("SHOW CLIENTS").fetchall() if r[2] == "bench")

    def cpu(self) -> float:
        return env.tree_cpu(self.proc.pid)

    def stop(self) -> None:
        env.stop_processes([self.proc])
        shutil.rmtree(self.work, ignore_errors=True)


class Fleet:
    """One system's pods: its children, how to reach it, its database."""

    def __init__(self, label: str, system: str, db: str, dsn: str, *,
                 listen_dsn: str | None = None, tree: Path | None = None,
                 pooled: bool = False, wake: bool = False) -> None:
        self.label, self.system, self.db, self.dsn = label, system, db, dsn
        self.listen_dsn, self.tree, self.pooled, self.wake = listen_dsn, tree, pooled, wake

    def start(self, pods: int, logdir: Path, per_process: int = PODS_PER_CHILD
              ) -> list[subprocess.Popen]:
        extra = {}
        if self.pooled:
            extra = {"JOBRUNNER_TRANSACTION_POOLING": "1", "JOBRUNNER_PREPARED_STATEMENTS": "0"}
        pythonpath = str(env.REPO) if self.tree is None else os.pathsep.join(
            [str(self.tree), str(env.REPO)])
        child = env.child_env(PYTHONPATH=pythonpath, **extra)
        procs = []
        left = pods
        while left > 0:
            n = min(per_process, left)
            left -= n
            args = [sys.executable, "-m", "bench.fleet_child", self.system, "--pods", str(n),
                    "--dsn", self.dsn, "--handler", "bench.handlers:stamp_or_fail_first"]
            if self.listen_dsn:
                args += ["--listen-dsn", self.listen_dsn]
            log = logdir / f"{self.label.replace(' ', '_')}-{pods}-{len(procs)}.log"
            log.unlink(missing_ok=True)
            procs.append(env.spawn(args, env=child, log=log, cwd=self.tree or env.REPO))
            procs[-1].log = log  # type: ignore[attr-defined]
        return procs


def _backends(monitor: psycopg.Connection, db: str) -> int:
    return monitor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
                           "backend_type = 'client backend' AND pid <> pg_backend_pid()",
                           (db,)).fetchone()[0]


def _gone(monitor: psycopg.Connection, fleet: Fleet, bouncer: Bouncer) -> bool:
    """The fleet's connections are closed (PgBouncer keeps its own server connections)."""
    if fleet.pooled:
        return bouncer.clients() == 0 and monitor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
            "application_name LIKE 'jobrunner-notifier%%'", (fleet.db,)).fetchone()[0] == 0
    return _backends(monitor, fleet.db) == 0


def _ready(procs: list[subprocess.Popen]) -> bool:
    for p in procs:
        if p.poll() is not None:
            raise RuntimeError(f"a fleet process exited: {p.log.read_text()[-2000:]}")  # type: ignore[attr-defined]
    return all("ready" in p.log.read_text() for p in procs)  # type: ignore[attr-defined]


def _steady(monitor: psycopg.Connection, db: str, timeout: float = 300) -> int:
    """Wait until the database's backends stop changing for 3 s; their count."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = _backends(monitor, db)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= 3:
            return n
        time.sleep(0.5)
    return last


def server_cores(server: env.Server, monitor_pid: int, window: float,
                 bouncer: Bouncer | None, procs: list | None = None
                 ) -> tuple[float, float, float]:
    """Cores used over `window` by the server, PgBouncer and the fleet's own processes
    (`procs`: the pods' CPU on their side, which a real fleet spends on its nodes)."""
    exclude = frozenset({monitor_pid})

    def fleet() -> float:
        return sum(env.tree_cpu(p.pid) for p in procs or [])

    cpu0, b0, f0, t0 = (server.cpu_seconds(exclude), bouncer.cpu() if bouncer else 0.0,
                        fleet(), time.monotonic())
    time.sleep(window)
    dt = time.monotonic() - t0
    return ((server.cpu_seconds(exclude) - cpu0) / dt,
            ((bouncer.cpu() - b0) / dt) if bouncer else 0.0, (fleet() - f0) / dt)


# Seconds between wake-up samples. "waiting": longer than a worker's fast polls after a
# note or a claim last (WorkerConfig.idle_warm, 2 s, then idle_poll's 0.5 s), so that each
# enqueue finds the fleet waiting, as the figure asks. "busy": an enqueue every
# 0.3-0.6 s, the fleet still busy with the previous one's wake-up (the only cadence
# before stop 42: its 80-87 ms were a fleet that never stopped claiming).
WAKE_GAPS = {"waiting": (3.0, 4.0), "busy": (0.3, 0.6)}


def wake_samples(dsn: str, samples: int, gap: tuple[float, float], server: env.Server,
                 exclude: frozenset[int], idle_cores: float) -> tuple[list[float], float]:
    """Enqueue commit -> handler start (ms), one task at a time, `gap` seconds apart; and
    the server CPU each wake-up cost (ms): the server's CPU over the samples, less the
    waiting fleet's own (`idle_cores`) and this harness's connections, per enqueue."""
    out = []
    with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
        q = Queue(conn)
        mine = exclude | {conn.execute("SELECT pg_backend_pid() AS p").fetchone()["p"]}
        cpu0, t0 = server.cpu_seconds(mine), time.monotonic()
        for i in range(samples):
            time.sleep(random.uniform(*gap))
            key = f"wake-{time.monotonic_ns()}-{i}"
            enqueued = time.time()  # (before the call: its commit is inside it)
            q.enqueue(BATCH, TENANT, [TaskSpec(key=key, payload={})])
            row = env.wait_until(lambda k=key: conn.execute(
                "SELECT result FROM agent_work_queue WHERE batch_id = %s AND task_key = %s"
                " AND status = 'done'", (BATCH, k)).fetchone(), 60, 0.002, "wake-up task")
            out.append(max(0.0, (row["result"]["started"] - enqueued) * 1000))
        time.sleep(gap[1])  # (the last wake-up's claims and looks are counted too)
        cpu = server.cpu_seconds(mine) - cpu0 - idle_cores * (time.monotonic() - t0)
    return out, cpu / samples * 1000


def retry_samples(dsn: str, samples: int) -> list[float]:
    """A first attempt fails (backoff base 1 s): its run_after -> the retry's start (ms)."""
    out = []
    with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
        q = Queue(conn)
        for i in range(samples):
            key = f"retry-{time.monotonic_ns()}-{i}"
            q.enqueue(BATCH, TENANT, [TaskSpec(key=key, payload={"fail_first": True})])
            due = env.wait_until(lambda k=key: conn.execute(
                "SELECT extract(epoch FROM run_after)::float8 AS due FROM agent_work_queue"
                " WHERE batch_id = %s AND task_key = %s AND status = 'pending'"
                " AND attempts = 1", (BATCH, k)).fetchone(), 60, 0.005, "the failed attempt")
            row = env.wait_until(lambda k=key: conn.execute(
                "SELECT result FROM agent_work_queue WHERE batch_id = %s AND task_key = %s"
                " AND status = 'done'", (BATCH, k)).fetchone(), 60, 0.005, "the retry")
            out.append((row["result"]["started"] - due["due"]) * 1000)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="an older tree (git archive), e.g. main")
    parser.add_argument("--label", default="main", help="what --before is, for the tables")
    parser.add_argument("--before-listen", action="store_true",
                        help="run --before as this tree runs (a direct notifier per pod), "
                        "not with --no-listen: for a tree that has the notifier")
    parser.add_argument("--pods", default="200,1000")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--wake", type=int, default=40)
    parser.add_argument("--retries", type=int, default=15)
    parser.add_argument("--systems", default="jobrunner,before,pgqueuer,procrastinate")
    parser.add_argument("--pods-per-process", type=int, default=PODS_PER_CHILD)
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.pods.split(",")]
    chosen = args.systems.split(",")
    if args.before is None:
        chosen = [s for s in chosen if s != "before"]
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    logdir = Path(tempfile.mkdtemp(prefix="bench-idle-fleet-"))
    server = env.Server()
    server.start()
    with psycopg.connect(server.admin_dsn, autocommit=True) as c:
        c.execute("ALTER SYSTEM SET max_connections = 2600")
    server.pg.restart()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = env.load()
    runs: list[dict] = []
    bouncer = None
    try:
        jr, pgq, proc = Jobrunner(server), PgQueuer(server), Procrastinate(server)
        jr.setup()
        bouncer = Bouncer(server, jr.db)
        fleets = {
            "jobrunner": Fleet("this tree", "jobrunner", jr.db, bouncer.dsn,
                               listen_dsn=jr.dsn, pooled=True, wake=True),
            "before": Fleet(args.label, "jobrunner", jr.db, bouncer.dsn,
                            tree=args.before.resolve() if args.before else None,
                            listen_dsn=jr.dsn if args.before_listen else None,
                            pooled=True, wake=True),
            "pgqueuer": Fleet("pgqueuer", "pgqueuer", pgq.db, pgq.dsn),
            "procrastinate": Fleet("procrastinate", "procrastinate", proc.db, proc.dsn),
        }
        systems = {"jobrunner": jr, "before": jr, "pgqueuer": pgq, "procrastinate": proc}
        for name in chosen:
            systems[name].setup()
        with psycopg.connect(server.admin_dsn, autocommit=True) as monitor:
            monitor_pid = monitor.execute("SELECT pg_backend_pid()").fetchone()[0]
            for rep in range(args.reps):
                base, _, _ = server_cores(server, monitor_pid, args.window, None)
                runs.append({"kind": "baseline", "rep": rep, "server_cores": base})
                print(f"baseline: {base:.4f} cores", flush=True)
                for pods in sizes:
                    for name in (chosen if rep % 2 == 0 else list(reversed(chosen))):
                        fleet, system = fleets[name], systems[name]
                        system.reset()
                        if getattr(system, "_conn", None) is not None:
                            system._conn.close()  # (only the fleet's connections count)
                        procs = fleet.start(pods, logdir, args.pods_per_process)
                        try:
                            env.wait_until(lambda p=procs: _ready(p), 600, 0.5,
                                           f"{fleet.label} pods")
                            backends = _steady(monitor, fleet.db)
                            time.sleep(args.settle)
                            cores, bouncer_cores, fleet_cores = server_cores(
                                server, monitor_pid, args.window,
                                bouncer if fleet.pooled else None, procs)
                            run = {"kind": "idle", "system": fleet.label, "pods": pods,
                                   "rep": rep, "server_cores": cores, "baseline": base,
                                   "pgbouncer_cores": bouncer_cores,
                                   "fleet_cores": fleet_cores,
                                   "backends": _backends(monitor, fleet.db),
                                   "backends_steady": backends,
                                   "pgbouncer_clients": bouncer.clients()
                                   if fleet.pooled else 0}
                            if fleet.wake and pods == max(sizes):
                                exclude = frozenset({monitor_pid})
                                run["wake_ms"], run["wake_cpu_ms"] = wake_samples(
                                    jr.dsn, args.wake, WAKE_GAPS["waiting"], server,
                                    exclude, cores - base)
                                run["wake_busy_ms"], run["wake_busy_cpu_ms"] = wake_samples(
                                    jr.dsn, args.wake, WAKE_GAPS["busy"], server, exclude,
                                    cores - base)
                                run["retry_ms"] = retry_samples(jr.dsn, args.retries)
                            runs.append(run)
                            per = (cores - base) / pods * 1000
                            print(f"{fleet.label:>14} {pods:5d} pods: {cores:.4f} cores "
                                  f"({per:.4f} ms/s per pod; the pods' own "
                                  f"{fleet_cores:.3f} cores), {run['backends']} backends, "
                                  f"{run['pgbouncer_clients']} bouncer clients"
                                  + (f", wake p50 {pct(run['wake_ms'], 50):.1f} ms p99 "
                                     f"{pct(run['wake_ms'], 99):.1f} ms (busy fleet p50 "
                                     f"{pct(run['wake_busy_ms'], 50):.1f} p99 "
                                     f"{pct(run['wake_busy_ms'], 99):.1f}); server ms per "
                                     f"wake-up {run['wake_cpu_ms']:.0f} (busy "
                                     f"{run['wake_busy_cpu_ms']:.0f}), retry p50 "
                                     f"{pct(run['retry_ms'], 50):.1f} ms max "
                                     f"{max(run['retry_ms']):.1f} ms"
                                     if "wake_ms" in run else ""), flush=True)
                        finally:
                            env.stop_processes(procs, timeout=60)
                            env.wait_until(lambda f=fleet: _gone(monitor, f, bouncer),
                                           120, 0.5, "the pods' connections to close")
    finally:
        if bouncer is not None:
            bouncer.stop()
        server.stop()
    meta = {"started": started, "load_before": load_before, "load_after": env.load(),
            "command": " ".join(["python -m bench.idle_fleet", *(argv or sys.argv[1:])]),
            "machine": env.machine(), "window_s": args.window, "settle_s": args.settle,
            "pods_per_process": args.pods_per_process}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "idle-fleet.json").write_text(json.dumps({"meta": meta, "runs": runs},
                                                         indent=1) + "\n")
    text = report(meta, runs, sizes, [fleets[n].label for n in chosen], args.label,
                  args.before_listen)
    (args.out / "idle-fleet.md").write_text(text)
    print(text)


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fleet_per_pod(rs: list[dict], pods: int) -> str:
    """The pods' own CPU while waiting (their processes, ms per second per pod): what a
    waiting fleet costs its nodes, beside what it costs the server."""
    per = [r["fleet_cores"] / pods * 1000 for r in rs if "fleet_cores" in r]
    return f"{_med(per):.3f}" if per else "-"


def report(meta: dict, runs: list[dict], sizes: list[int], labels: list[str],
           before: str, before_listen: bool = False) -> str:
    idle = [r for r in runs if r["kind"] == "idle"]
    ours: dict[int, float] = {}
    rows = []
    for pods in sizes:
        for label in labels:
            rs = [r for r in idle if r["system"] == label and r["pods"] == pods]
            if not rs:
                continue
            per = [(r["server_cores"] - r["baseline"]) / pods * 1000 for r in rs]
            if label == "this tree":
                ours[pods] = _med(per)
            rows.append([label, pods, f"{_med(per):.4f} ({min(per):.4f}-{max(per):.4f})",
                         f"{_med([r['server_cores'] for r in rs]):.3f}",
                         f"{_med([r['pgbouncer_cores'] for r in rs]):.3f}",
                         _fleet_per_pod(rs, pods),
                         int(_med([r["backends"] for r in rs])),
                         int(_med([r["pgbouncer_clients"] for r in rs]))])
    for row in rows:
        mine = ours.get(row[1])
        per = float(row[2].split()[0])
        row.append("1" if row[0] == "this tree" else
                   (f"{per / mine:,.1f}x" if mine and mine > 0 else "-"))
    wake_rows = []
    for label in labels:
        rs = [r for r in idle if r["system"] == label and "wake_ms" in r]
        if not rs:
            continue
        wake = [x for r in rs for x in r["wake_ms"]]
        busy = [x for r in rs for x in r.get("wake_busy_ms", [])]
        retry = [x for r in rs for x in r["retry_ms"]]
        wake_rows.append([label, rs[0]["pods"], len(wake), f"{pct(wake, 50):.1f}",
                          f"{pct(wake, 99):.1f}", f"{max(wake):.1f}",
                          f"{pct(busy, 50):.1f} / {pct(busy, 99):.1f}" if busy else "-",
                          " / ".join(f"{_med([r[k] for r in rs]):.0f}" if k in rs[0] else "-"
                                     for k in ("wake_cpu_ms", "wake_busy_cpu_ms")),
                          len(retry), f"{pct(retry, 50):.1f}", f"{pct(retry, 99):.1f}",
                          f"{max(retry):.1f}"])
    base = [r["server_cores"] for r in runs if r["kind"] == "baseline"]
    return "\n".join([
        "# A waiting fleet: its cost to the database and how fast it wakes (issue 30)\n",
        f"`{meta['command']}` at {meta['started']}; load average before "
        f"{' '.join(f'{x:.2f}' for x in meta['load_before'])}, after "
        f"{' '.join(f'{x:.2f}' for x in meta['load_after'])}. Every pod waits (nothing to "
        f"do); server CPU over {meta['window_s']:.0f} s after {meta['settle_s']:.0f} s of "
        f"settling, minus the idle server's own ({_med(base):.4f} cores, no pods), per "
        "waiting pod per second: median of the repetitions (min-max). Pods are simulated "
        f"{meta.get('pods_per_process', PODS_PER_CHILD)} to a process "
        "(bench/fleet_child.py), each with its own "
        "connections, threads and timers.\n",
        table(["system", "pods", "server ms/s per waiting pod", "server cores",
               "PgBouncer cores", "pods' own ms/s per waiting pod", "server connections",
               "PgBouncer clients", "per pod vs this tree"], rows) + "\n",
        "Wake-up: a task enqueued -> its handler's start (ms), with every pod waiting "
        f"(enqueues {WAKE_GAPS['waiting'][0]:.0f}-{WAKE_GAPS['waiting'][1]:.0f} s apart) and, "
        "as a second figure, with the fleet still busy with the previous enqueue's "
        f"wake-up ({WAKE_GAPS['busy'][0]}-{WAKE_GAPS['busy'][1]} s apart); a retry's "
        "run_after -> its second attempt's start (ms). Server ms per wake-up: the "
        "server's CPU over the samples, less the waiting fleet's own and the harness's, "
        "per enqueue (what one note's herd of claims and looks costs).\n",
        table(["system", "pods", "wake samples", "p50", "p99", "max",
               "busy fleet p50 / p99", "server ms per wake-up (waiting / busy)",
               "retry samples", "p50", "p99", "max"],
              wake_rows) + "\n",
        f"`{before}` is the older tree given with --before, run "
        + ("as this tree is (a direct notifier per pod)" if before_listen else
           "with --no-listen through the same PgBouncer, as its docs/scaling.md told a "
           "fleet to run") + ".\n"])


if __name__ == "__main__":
    main()
