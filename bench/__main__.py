"""``python -m bench [--quick] [--only ...]``: every benchmark, one server, one run.

Starts a dedicated embedded PostgreSQL, measures jobrunner, pgqueuer, procrastinate
and pgbench on it, and writes ``bench/results/`` (results.json, one markdown file with a
table per benchmark, PNG plots). ``--quick`` is a smoke test with small sizes (about
three minutes); the full run takes about half an hour on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from . import controller, env, scenarios, waits
from .report import write_report
from .systems import Jobrunner, PgBench, PgQueuer, Procrastinate
from .throughput import measure, pgbench_run

ALL = ["throughput", "waits", "history", "shards", "enqueue", "latency", "recovery", "footprint",
       "controller", "pgbouncer"]


@dataclass
class Plan:
    tasks: int = 20_000
    reps: int = 5
    workers: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    cap: float = 8.0
    pgbench_seconds: float = 5.0
    history_sizes: list[int] = field(default_factory=lambda: [0, 1_000_000, 5_000_000])
    history_pending: int = 100_000
    history_probes: int = 2000
    history_window: float = 6.0
    shard_tasks: int = 10_000
    shard_reps: int = 3
    enqueue_tasks: int = 1_000_000
    latency_samples: int = 30
    recovery_visibility: float = 5.0
    recovery_trials: int = 3
    bouncer_workers: int = 200
    bouncer_pool: int = 20
    bouncer_tasks: int = 20_000
    retention_rows: int = 200_000
    controller_runs: int = 100
    controller_window: float = 30.0


QUICK = Plan(tasks=3000, reps=1, workers=[1, 4], cap=5.0, pgbench_seconds=2.0,
             history_sizes=[0, 100_000, 300_000], history_pending=20_000, history_probes=300,
             history_window=2.0, shard_tasks=2000, shard_reps=1, enqueue_tasks=50_000,
             latency_samples=6, recovery_visibility=3.0, recovery_trials=1, bouncer_workers=12,
             bouncer_pool=4, bouncer_tasks=2000, retention_rows=20_000,
             controller_runs=20, controller_window=15.0)


class AsyncCommitJobrunner(Jobrunner):
    """jobrunner workers logging in as a role with synchronous_commit = off (the
    guidance in docs/performance.md: claims and acks may be lost in a crash, which
    at-least-once already absorbs; enqueues stay durable under the normal role)."""

    name = "jobrunner (workers' role: synchronous_commit=off)"
    role = "bench_async_worker"

    def setup(self) -> None:
        super().setup()
        password = self.server.pg.password
        with psycopg.connect(self.server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {self.role}")
            conn.execute(f"CREATE ROLE {self.role} LOGIN SUPERUSER PASSWORD '{password}'")
            conn.execute(f"ALTER ROLE {self.role} SET synchronous_commit = off")

    def worker_args(self, batch_size: int) -> list[str]:
        args = super().worker_args(batch_size)
        dsn = self.server.dsn(self.db).replace("postgresql://postgres:",
                                               f"postgresql://{self.role}:")
        args[args.index(self.dsn)] = dsn
        return args


class PlainJobrunner(Jobrunner):
    """jobrunner with tasks that carry no shard key: the workload pgqueuer,
    procrastinate and pgbench run (none of them excludes anything). Heartbeats, fencing
    and LISTEN/NOTIFY stay on; only the shard leases are not taken."""

    name = "jobrunner, tasks without shard keys"
    db = "bench_jobrunner_plain"

    def __init__(self, server: env.Server) -> None:
        super().__init__(server, shards=0)


def run(plan: Plan, only: list[str], out: Path) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix="jobrunner-bench-logs-"))
    server = env.Server()
    started = time.monotonic()
    results: dict = {"meta": {"machine": env.machine(), "load_before": env.load(),
                              "busy_before": env.busy_processes(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "plan": plan.__dict__,
                              "command": " ".join(["python -m bench", *sys.argv[1:]])}}
    print(f"bench: load {env.load()}; logs in {logdir}", flush=True)
    try:
        server.start()
        results["meta"]["postgres"] = server.version()
        results["meta"]["settings"] = server.settings()

        def stage(name: str) -> bool:
            if name not in only:
                return False
            results["meta"].setdefault("load", {})[name] = env.load()
            print(f"== {name} (load {env.load()[0]:.2f}, {time.monotonic() - started:.0f}s)",
                  flush=True)
            return True

        if stage("throughput"):
            results["throughput"], results["pgbench"] = throughput(server, plan, logdir)
        if stage("waits"):
            results["waits"] = wait_events(server, plan, logdir)
        if stage("shards"):
            results["shards"] = shards(server, plan, logdir)
        if stage("history"):
            results["history"] = scenarios.history(
                server, plan.history_sizes, plan.history_pending, plan.history_probes, 4,
                plan.history_window, logdir)
            results["retention"] = scenarios.retention(server, plan.retention_rows)
        if stage("enqueue"):
            results["enqueue"] = scenarios.bulk_enqueue(server, plan.enqueue_tasks)
        if stage("latency"):
            results["latency"] = scenarios.latency(server, plan.latency_samples, logdir)
        if stage("recovery"):
            results["recovery"] = scenarios.recovery(server, plan.recovery_visibility,
                                                     plan.recovery_trials, logdir)
        if stage("footprint"):
            results["footprint"] = scenarios.footprint(server, logdir)
        if stage("controller"):
            results["controller"] = controller.controller(
                server, plan.controller_runs, plan.controller_window, logdir)
        if stage("pgbouncer"):
            results["pgbouncer"] = scenarios.pgbouncer(
                server, plan.bouncer_workers, plan.bouncer_pool, plan.bouncer_tasks, 1, logdir)
    finally:
        results["meta"]["load_after"] = env.load()
        results["meta"]["busy_after"] = env.busy_processes()
        results["meta"]["duration_s"] = round(time.monotonic() - started)
        server.stop()
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    shutil.rmtree(logdir, ignore_errors=True)
    return results


def throughput(server: env.Server, plan: Plan, logdir: Path) -> tuple[list[dict], list[dict]]:
    jr, pgq, pro = Jobrunner(server), PgQueuer(server), Procrastinate(server)
    fast, plain = AsyncCommitJobrunner(server), PlainJobrunner(server)
    bench = PgBench(server)
    for system in (jr, pgq, pro, fast, plain):
        system.setup()
    bench.setup()
    configs = [(jr, 1), (jr, 10), (pgq, 10), (pgq, 1), (pro, 1), (plain, 1), (plain, 10)]
    runs: list[dict] = []
    limits: list[dict] = []
    for rep in range(plan.reps):
        for n in plan.workers:
            limit = pgbench_run(server, bench, n, plan.pgbench_seconds)
            limits.append({**limit, "rep": rep})
            print(f"  rep {rep} N={n}: pgbench {limit['tps']:.0f} tps", flush=True)
            for system, batch in configs:
                result = measure(server, system, n, batch, plan.tasks, plan.cap, logdir)
                runs.append({**result.as_dict(), "rep": rep})
                print(f"    {system.name[:24]:>24} b{batch:<2}: {result.rate:8.1f}/s"
                      f" ({result.done}/{result.tasks} in {result.seconds:.1f}s)", flush=True)
        n = 4 if 4 in plan.workers else plan.workers[-1]
        for batch in (1, 10):
            result = measure(server, fast, n, batch, plan.tasks, plan.cap, logdir)
            runs.append({**result.as_dict(), "rep": rep, "system": fast.name})
            print(f"    sync-off b{batch}: {result.rate:8.1f}/s", flush=True)
    return runs, limits


def wait_events(server: env.Server, plan: Plan, logdir: Path) -> list[dict]:
    jr, plain, pgq = Jobrunner(server), PlainJobrunner(server), PgQueuer(server)
    n = 4 if 4 in plan.workers else plan.workers[-1]
    return waits.waits(server, [(jr, 1), (plain, 1), (jr, 10), (pgq, 10)], PgBench(server), n,
                       plan.tasks, plan.cap, plan.pgbench_seconds, logdir)


def shards(server: env.Server, plan: Plan, logdir: Path) -> list[dict]:
    runs = []
    n = 4 if 4 in plan.workers else plan.workers[-1]
    for rep in range(plan.shard_reps):
        for keys in (0, 1000, 200, 5):
            system = Jobrunner(server, shards=keys)
            for batch in (1, 10):
                result = measure(server, system, n, batch, plan.shard_tasks, plan.cap, logdir)
                runs.append({**result.as_dict(), "rep": rep, "shard_keys": keys})
                print(f"    {keys:>4} shard keys b{batch:<2}: {result.rate:8.1f}/s", flush=True)
    return runs


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: workers stopped, server destroyed


def _merged(previous: dict, rerun: dict, stages: list[str]) -> dict:
    """The previous run with `stages` replaced by a re-run's, recorded in meta.rerun."""
    merged = dict(previous)
    keys = {"history": ("history", "retention"), "throughput": ("throughput", "pgbench")}
    for stage in stages:
        for key in keys.get(stage, (stage,)):
            if key in rerun:
                merged[key] = rerun[key]
        merged["meta"].setdefault("rerun", {})[stage] = {
            "started": rerun["meta"]["started"], "command": rerun["meta"]["command"],
            "load": rerun["meta"].get("load", {}).get(stage),
            "postgres": rerun["meta"].get("postgres")}
    return merged


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--only", default=",".join(ALL),
                        help=f"comma-separated subset of: {','.join(ALL)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default: bench/results; with --quick a "
                             "new temporary directory)")
    parser.add_argument("--workers", default=None,
                        help="throughput: comma-separated worker counts (default 1,2,4,8,16)")
    parser.add_argument("--reps", type=int, default=None,
                        help="throughput: repetitions (default 5)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from an existing results.json")
    parser.add_argument("--merge", action="store_true",
                        help="with --only: re-run those stages and replace them in the "
                             "existing results.json; the report says which stages were "
                             "re-run, when, and on which (other) server")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="jobrunner-bench-quick-")) if args.quick
                       else env.REPO / "bench" / "results")
    if args.report_only:
        results = json.loads((out / "results.json").read_text())
    else:
        only = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = set(only) - set(ALL)
        if unknown:
            parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        previous = json.loads((out / "results.json").read_text()) if args.merge else None
        plan = QUICK if args.quick else Plan()
        if args.workers:
            plan.workers = [int(n) for n in args.workers.split(",")]
        if args.reps:
            plan.reps = args.reps
        results = run(plan, only, out)
        if previous is not None:
            results = _merged(previous, results, only)
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    path = write_report(results, out)
    print(f"report: {path}")


if __name__ == "__main__":
    main()
