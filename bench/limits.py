"""``python -m bench.limits``: what flow control costs in the claim (issue 16, point 9).

One embedded server; 4 worker processes draining no-op tasks with 1,000 shard keys (the
workload of bench.compare), claim batch 1 and 10, variants interleaved round by round,
each on its own database:

- ``no limits``: tasks that name no limit (the claim's fast path);
- ``requests, never binds``: every task names a limit of 10^9 requests per second;
- ``all three, never bind``: a limit of 10^9 requests and 10^12 tokens per second and
  100,000 concurrent leases, every task with a token estimate of 100;
- ``before`` (with ``--before DIR``): an older tree's workers and schema, e.g. the
  commit before flow control (``git archive <commit> jobrunner sql | tar -x -C DIR``);
- ``binding``: a limit of ``--binding-rate`` requests per second, about a third of the
  unlimited batch-1 rate: achieved rate, and server and worker CPU per task (what the
  claims that find the limit full cost).

Ratios are per round (paired: the runs of one round are minutes apart at most), then
the median over rounds.

``--one-client N`` adds N rounds of the steadier measurement: one connection running
the worker's ack+claim loop in a process of its own (no worker, no handler threads),
and the CPU of its server process per task, for the same variants, interleaved; on a
shared machine whose speed moves by half from one minute to the next, this is what
tells a 10 % difference in the claim statement. Writes ``bench/results/limits.md`` and
``limits.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from . import env
from .report import spread, table
from .systems import Jobrunner
from .throughput import measure

LIMIT = "bench-limit"


class Limited(Jobrunner):
    """Tasks that all name one limit (created on install, its state reset per run)."""

    def __init__(self, server: env.Server, name: str, db: str, *, requests: int | None,
                 tokens: int | None = None, max_concurrent: int | None = None,
                 estimate: int | None = None) -> None:
        super().__init__(server)
        self.name = name
        self.db = db
        self.limit = {"requests": requests, "tokens": tokens, "max_concurrent": max_concurrent}
        self.estimate = estimate

    def install(self) -> None:
        super().install()
        from jobrunner.store import flowcontrol as limits

        with psycopg.connect(self.dsn) as conn:
            limits.set_limit(conn, LIMIT, per=1.0, **self.limit)

    def reset(self) -> None:
        super().reset()
        self.sql("TRUNCATE agent_limit_lease, agent_task_usage, agent_batch_usage")
        self.sql("UPDATE agent_limit_lane SET request_tat = '-infinity',"
                 " token_tat = '-infinity', acquired = 0")
        self.sql("UPDATE agent_limit SET blocked_until = NULL")

    def specs(self, n: int, prefix: str = "t") -> list:
        spec = self.api()[2]
        return [spec(key=f"{prefix}{i}", payload={},
                     shard_key=f"s{i % self.shards}" if self.shards else None,
                     limits=(LIMIT,), tokens=self.estimate) for i in range(n)]


# One client's ack+claim loop, in a process that imports jobrunner from TREE: prints the
# CPU of its server process and the wall time, per task.
_ONE_CLIENT = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import psycopg
from psycopg.rows import dict_row
from jobrunner.queue import Queue, Outcome
from jobrunner.validation import TaskSpec
dsn, batch, limit = sys.argv[2], sys.argv[3], sys.argv[6]
n, size = int(sys.argv[4]), int(sys.argv[5])
with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
    q = Queue(conn)
    extra = {"limits": (limit,), "tokens": 100} if limit else {}
    q.enqueue(batch, "bench", [TaskSpec(f"k{i}", {}, shard_key=f"s{i % 1000}", **extra)
                               for i in range(n)])
    pid = conn.info.backend_pid
    def cpu():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    leases = q.claim(batch, "w", size)
    for _ in range(100):  # warm: the prepared statement, the caches
        _, leases = q.complete_and_claim("w", [Outcome(x, True, None) for x in leases], batch, size)
    c0, t0, done = cpu(), time.perf_counter(), 0
    while leases:
        _, leases = q.complete_and_claim("w", [Outcome(x, True, None) for x in leases], batch, size)
        done += len(leases)
    print((cpu() - c0) / done * 1e6, (time.perf_counter() - t0) / done * 1e6)
"""


def one_client(server: env.Server, rounds: int, before: Path | None, label: str) -> list[dict]:
    from jobrunner.store import flowcontrol as limits
    from jobrunner.store.migrate import migrate

    dsn = server.create_db("bench_one_client")
    with psycopg.connect(dsn) as conn:
        migrate(conn)
        limits.set_limit(conn, "never", per=1.0, requests=10**9)
        limits.set_limit(conn, "never3", per=1.0, requests=10**9, tokens=10**12,
                         max_concurrent=100_000)
    variants = [(label, str(before), "")] if before else []
    variants += [("no limits", str(env.REPO), ""),
                 ("requests, never binds", str(env.REPO), "never"),
                 ("all three, never bind", str(env.REPO), "never3")]
    rows, k = [], 0
    for rnd in range(rounds):
        for size in (1, 10):
            order = variants if rnd % 2 == 0 else list(reversed(variants))
            for name, tree, limit in order:
                k += 1
                n = 3000 if size == 1 else 12000
                out = subprocess.run([sys.executable, "-c", _ONE_CLIENT, tree, dsn, f"b{k}",
                                      str(n), str(size), limit], capture_output=True, text=True,
                                     cwd="/", check=True)
                cpu, wall = (float(x) for x in out.stdout.split())
                rows.append({"variant": name, "batch": size, "rep": rnd, "pg_us": cpu,
                             "wall_us": wall})
                print(f"  one client {name:>30} b{size:<2}: pg {cpu:5.0f} us/task, "
                      f"wall {wall:5.0f} us/task", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.limits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="an older tree (its jobrunner/, sql/)")
    parser.add_argument("--label", default="before", help="what --before is, for the table")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--binding-rate", type=int, default=1000)
    parser.add_argument("--binding-tasks", type=int, default=4_000)
    parser.add_argument("--one-client", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.before and not (args.before / "jobrunner" / "worker.py").exists():
        parser.error(f"{args.before} has no jobrunner/worker/process.py")
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # clean up
    server = env.Server()
    server.start()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = env.load()
    runs: list[dict] = []
    single: list[dict] = []
    try:
        if args.one_client:
            single = one_client(server, args.one_client, args.before, args.label)
        variants: list[tuple[str, Jobrunner]] = []
        if args.before:
            from .compare import Before

            variants.append((args.label, Before(server, args.before.resolve())))
        variants += [
            ("no limits", Jobrunner(server)),
            ("requests, never binds", Limited(server, "requests", "bench_requests",
                                              requests=10**9)),
            ("all three, never bind", Limited(server, "all three", "bench_all", requests=10**9,
                                              tokens=10**12, max_concurrent=100_000,
                                              estimate=100)),
        ]
        binding = Limited(server, "binding", "bench_binding", requests=args.binding_rate)
        for _, system in variants:
            system.setup()
        binding.setup()
        for rep in range(args.reps):
            order = variants if rep % 2 == 0 else list(reversed(variants))
            for label, system in order:
                for batch in (1, 10):
                    r = measure(server, system, args.workers, batch, args.tasks, 60)
                    runs.append({**r.as_dict(), "variant": label, "rep": rep})
                    _print(label, batch, r)
            for batch in (1, 10):
                r = measure(server, binding, args.workers, batch, args.binding_tasks, 60)
                runs.append({**r.as_dict(), "variant": "binding", "rep": rep})
                _print("binding", batch, r)
    finally:
        server.stop()
    meta = {"started": started, "load_before": load_before, "load_after": env.load(),
            "command": " ".join(["python -m bench.limits", *(argv or sys.argv[1:])]),
            "machine": env.machine(), "tasks": args.tasks, "workers": args.workers,
            "reps": args.reps, "binding_rate": args.binding_rate}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "limits.json").write_text(json.dumps({"meta": meta, "runs": runs,
                                                      "one_client": single}, indent=1) + "\n")
    text = render(meta, runs, [label for label, _ in variants], single)
    (args.out / "limits.md").write_text(text)
    print(text)


def _print(label: str, batch: int, r) -> None:
    print(f"  {label:>22} b{batch:<2}: {r.rate:8.1f}/s  pg "
          f"{r.pg_cpu_s / max(1, r.done) * 1e6:.0f} us/task, worker "
          f"{r.worker_cpu_s / max(1, r.done) * 1e6:.0f} us/task", flush=True)


def _per_task(rs: list[dict], key: str, scale: float) -> str:
    return f"{statistics.median(r[key] / r['done'] * scale for r in rs):,.0f}"


def render(meta: dict, runs: list[dict], labels: list[str], single: list[dict]) -> str:
    def of(label: str, batch: int) -> list[dict]:
        return sorted((r for r in runs if r["variant"] == label and r["batch"] == batch),
                      key=lambda r: r["rep"])

    rows = []
    for label in [*labels, "binding"]:
        for batch in (1, 10):
            rs = of(label, batch)
            if not rs:
                continue
            base = {r["rep"]: r["rate"] for r in of("no limits", batch)}
            ratios = [r["rate"] / base[r["rep"]] for r in rs if r["rep"] in base]
            ratio = (f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"
                     if ratios and label not in ("no limits", "binding") else "-")
            rows.append([label, batch, spread([r["rate"] for r in rs]), ratio,
                         _per_task(rs, "pg_cpu_s", 1e6), _per_task(rs, "worker_cpu_s", 1e6),
                         _per_task(rs, "wal_bytes", 1)])
    load = " ".join(f"{x:.2f}" for x in meta["load_before"])
    load_after = " ".join(f"{x:.2f}" for x in meta["load_after"])
    return "\n".join([
        "# Flow control in the claim: what it costs (one run)\n",
        f"`{meta['command']}` at {meta['started']}; load average before {load}, after "
        f"{load_after}. {meta['workers']} worker processes, {meta['tasks']:,} no-op tasks "
        f"with 1,000 shard keys per run ({meta['binding_rate']:,} requests/s binding: "
        "fewer tasks), claim batch 1 and 10, "
        f"{meta['reps']} rounds, variants interleaved; median (min-max). \"vs no limits\" is "
        "the ratio of tasks/s to the no-limits run of the same round and batch (median and "
        "range over rounds). Same server; each variant on its own database.\n",
        table(["variant", "claim batch", "tasks/s", "vs no limits", "PostgreSQL µs/task",
               "worker µs/task", "WAL bytes/task"], rows) + "\n",
        *(_one_client_table(single, labels) if single else [])])


def _one_client_table(single: list[dict], labels: list[str]) -> list[str]:
    rows = []
    for label in labels:
        for batch in (1, 10):
            rs = sorted((r for r in single if r["variant"] == label and r["batch"] == batch),
                        key=lambda r: r["rep"])
            base = {r["rep"]: r["pg_us"] for r in single
                    if r["variant"] == "no limits" and r["batch"] == batch}
            ratios = [r["pg_us"] / base[r["rep"]] for r in rs if r["rep"] in base]
            ratio = ("-" if label == "no limits" else
                     f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
            rows.append([label, batch, spread([r["pg_us"] for r in rs]), ratio,
                         spread([r["wall_us"] for r in rs])])
    rounds = max(r["rep"] for r in single) + 1
    return ["## One client, server CPU per task\n",
            f"One connection running the ack+claim loop alone, {rounds} rounds interleaved "
            "(3,000 tasks at batch 1, 12,000 at batch 10): the CPU of its server process per "
            "task, median (min-max), and its ratio to the no-limits run of the same round "
            "(median and range). Claims that charge a limit commit without waiting for the "
            "WAL flush, which lowers their wall time, not their CPU.\n",
            table(["variant", "claim batch", "PostgreSQL µs/task", "vs no limits",
                   "wall µs/task"], rows) + "\n"]


if __name__ == "__main__":
    main()
