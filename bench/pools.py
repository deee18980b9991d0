"""``python -m bench.pools``: what claiming across a pool's batches, fair across tenants,
costs against today's per-batch claim (issue 18, point 5).

One embedded server; ``--workers`` worker processes draining no-op tasks with 1,000 shard
keys per tenant (the workload of bench.compare and bench.limits), claim batch 1 and 10,
variants interleaved round by round (the order reversed every other round), each on its
own database:

- ``per batch (today)``: one batch, ``jobrunner worker --batch`` (ack_and_claim);
- ``pool, 1 tenant``: the same tasks as one batch of a pool, ``worker --pool``
  (ack_and_claim_pool: the pool's index, tasks in virtual-time order);
- ``pool, 1,000 tenants``: the same number of tasks spread over 1,000 tenants, one batch
  each, all in one pool (enqueued in one transaction, so the workers find them all at
  once): fair share on, every tenant active.

Ratios are per round (paired), then the median over rounds. ``--one-client N`` adds N
rounds of the steadier measurement: one connection running the worker's ack+claim loop
(no worker processes) over 10,000 tasks enqueued and checkpointed beforehand, with the CPU
of its server process and the WAL per task. WAL bytes per task come from
the server's WAL position before the enqueue and after the last task (the enqueue's WAL
included, as in the other benchmarks). With ``--waldump`` the one-client rounds also
break each variant's WAL down by record type (``pg_waldump --stats=record``, first round).

``--before DIR`` (e.g. ``git archive main jobrunner sql | tar -x -C DIR``) runs each
variant a second time with DIR's workers and schema, interleaved with this tree's, and
takes the ratios against DIR's per-batch claim: today's claim, side by side with the
change, in one run. Writes ``bench/results/pools.md`` and ``pools.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from . import env
from .compare import Before
from .report import spread, table
from .systems import Jobrunner
from .throughput import measure

POOL = "bench"
PER_BATCH = "per batch"


class PerBatch(Jobrunner):
    """Today's claim. The enqueue is one transaction whose WAL is read just before it
    commits (after the commit the workers are already claiming), to tell the claims' and
    acks' WAL from the enqueue's."""

    enqueue_wal = 0
    tenants = 1

    def enqueue(self, n: int) -> None:
        queue, timing, _ = self.api()
        specs = self.specs(n)
        per = -(-n // self.tenants)
        before = self._wal_inserted()
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            q = queue(conn, timing())
            with conn.transaction():  # (each enqueue a savepoint: all visible at once)
                for k in range(self.tenants):
                    part = specs[k * per:(k + 1) * per]
                    if part:
                        self._enqueue_one(q, k, part)
                        # (the staging table goes at commit: the next savepoint makes its own)
                        conn.execute("DROP TABLE jobrunner_enqueue_stage")
                self.enqueue_wal = self._wal_inserted() - before

    def _wal_inserted(self) -> int:
        # (the insert position: WAL of a transaction not yet committed is not yet written)
        with psycopg.connect(self.server.admin_dsn, autocommit=True) as conn:
            return int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn"
                                    ).fetchone()[0])

    def _enqueue_one(self, q, k: int, part: list) -> None:
        from .systems import BATCH, TENANT

        q.enqueue(BATCH, TENANT, part)


class Pooled(PerBatch):
    """The same no-op tasks in one pool, over `tenants` tenants (one batch each)."""

    def __init__(self, server: env.Server, name: str, db: str, tenants: int) -> None:
        super().__init__(server)
        self.name = name
        self.db = db
        self.tenants = tenants

    def reset(self) -> None:
        super().reset()
        self.sql("TRUNCATE agent_pool, agent_pool_tenant, agent_pool_stream")

    def _enqueue_one(self, q, k: int, part: list) -> None:
        q.enqueue(f"b{k}", f"tenant{k}", part, pool=POOL)

    def done(self, total: int) -> int:
        # (the pool's task count minus its unfinished rows, as the status counts do)
        return int(self.sql(
            "SELECT coalesce((SELECT sum(tasks) FROM agent_batch WHERE pool = %(pool)s), 0)"
            " - (SELECT count(*) FROM agent_work_queue WHERE pool = %(pool)s"
            "    AND status = 'pending')"
            " - (SELECT count(*) FROM agent_work_queue q WHERE q.status = 'leased'"
            "    AND q.pool = %(pool)s)", {"pool": POOL})[0][0])

    def worker_args(self, batch_size: int) -> list[str]:
        args = super().worker_args(batch_size)
        i = args.index("--batch")
        return [*args[:i], "--pool", POOL, *args[i + 2:]]


class PerBatchIn(Before, PerBatch):
    """Today's claim with another tree's workers and schema (bench.compare.Before)."""

    def __init__(self, server: env.Server, tree: Path, name: str, db: str) -> None:
        super().__init__(server, tree)
        self.name = name
        self.db = db


class PooledIn(Before, Pooled):
    """A pool with another tree's workers and schema."""

    def __init__(self, server: env.Server, tree: Path, name: str, db: str,
                 tenants: int) -> None:
        Pooled.__init__(self, server, name, db, tenants)
        self.tree = tree
        self.name = name
        self.db = db
        self.tenants = tenants

    def done(self, total: int) -> int:
        return Pooled.done(self, total)


# One client's ack+claim loop in a process that imports jobrunner from a tree (argv[1]):
# enqueue (argv[4] tenants, 0: one batch outside pools), vacuum, checkpoint, then the loop;
# prints done, the server process's CPU seconds, wall seconds, and the WAL positions.
_ONE_CLIENT = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import psycopg
from psycopg.rows import dict_row
from jobrunner.migrate import migrate
from jobrunner.queue import Outcome, Queue
from jobrunner.validation import TaskSpec
dsn, pool, tenants, n = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
specs = [TaskSpec(f"t{i}", {}, shard_key=f"s{i % 1000}") for i in range(n)]
with psycopg.connect(dsn, row_factory=dict_row) as conn:
    migrate(conn)
    q = Queue(conn)
    with conn.transaction():
        if not tenants:
            q.enqueue("b", "T", specs)
        per = -(-n // max(1, tenants))
        for k in range(tenants):
            q.enqueue(f"b{k}", f"T{k}", specs[k * per:(k + 1) * per], pool=pool)
            conn.execute("DROP TABLE jobrunner_enqueue_stage")
with psycopg.connect(dsn, autocommit=True) as conn:
    conn.execute("VACUUM ANALYZE agent_work_queue")
    conn.execute("CHECKPOINT")
    pid = conn.info.backend_pid
    def cpu():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    def lsn():
        return conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
    q = Queue(conn)
    kw = {"pool": pool} if tenants else {}
    batch = None if tenants else "b"
    c0, w0, t0, done = cpu(), lsn(), time.perf_counter(), 0
    leases = q.complete_and_claim("w", (), batch, 1, **kw)[1]
    while leases:
        leases = q.complete_and_claim("w", [Outcome(x, True, None) for x in leases],
                                      batch, 1, **kw)[1]
        done += len(leases)
    wall, pg, w1 = time.perf_counter() - t0, cpu() - c0, lsn()
    print(done, pg, wall, w0, w1)
"""


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def waldump_stats(server: env.Server, start: str, end: str) -> dict[str, int]:
    """Bytes of WAL (records and full-page images) by record type between two positions."""
    out = subprocess.run([str(server.pg.bin / "pg_waldump"), "--stats=record", "-p",
                          str(server.pg.data / "pg_wal"), "-s", start, "-e", end],
                         capture_output=True, text=True, check=True).stdout
    stats = {}
    for line in out.splitlines():
        # Type  N (%)  Record size (%)  FPI size (%)  Combined size (%)
        m = re.match(r"^(\S+/\S+)\s+(\d+) \(.*\)\s+(\d+) \(.*\)\s+(\d+) \(.*\)\s+(\d+) "
                     r"\(", line)
        if m:
            stats[m.group(1)] = int(m.group(5))
    return stats


def one_client(server: env.Server, rounds: int, tenants: int,
               trees: list[tuple[str, Path]], waldump: bool = False) -> list[dict]:
    """The ack+claim loop of one connection, each in a process of its own importing
    jobrunner from its tree: server CPU, wall time and WAL per task, for the per-batch
    claim and a pool of 1 and of `tenants` tenants."""
    rows = []
    for rnd in range(rounds):
        counts = [0, 1, tenants] if rnd % 2 == 0 else [tenants, 1, 0]
        runs = [(suffix, tree, n) for n in counts for suffix, tree in trees]
        for suffix, tree, n_tenants in (runs if rnd % 2 == 0 else list(reversed(runs))):
            tag = "before" if suffix else "after"
            dsn = server.create_db(f"bench_one_{rnd}_{n_tenants}_{tag}")
            out = subprocess.run([sys.executable, "-c", _ONE_CLIENT, str(tree), dsn, POOL,
                                  str(n_tenants), "10000"], capture_output=True, text=True,
                                 cwd=tree, env=env.child_env(
                                     PYTHONPATH=os.pathsep.join([str(tree), str(env.REPO)])))
            if out.returncode:
                raise RuntimeError(f"one client ({tree}): {out.stderr[-2000:]}")
            done_s, pg_s, wall_s, w0, w1 = out.stdout.split()
            done, pg, wall = int(done_s), float(pg_s), float(wall_s)
            label = (PER_BATCH if not n_tenants else
                     "pool, 1 tenant" if n_tenants == 1 else f"pool, {n_tenants:,} tenants")
            label = label + suffix
            rows.append({"variant": label, "rep": rnd, "done": done,
                         "pg_us": pg / done * 1e6, "wall_us": wall / done * 1e6,
                         "wal_bytes": (_lsn(w1) - _lsn(w0)) / done})
            if waldump and rnd == 0:
                rows[-1]["waldump"] = {k: v / done for k, v in
                                       waldump_stats(server, w0, w1).items()}
            print(f"  one client {label:>30}: pg {rows[-1]['pg_us']:4.0f} us/task, wall "
                  f"{rows[-1]['wall_us']:4.0f} us/task, WAL {rows[-1]['wal_bytes']:5.0f} B/task",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--one-client", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--waldump", action="store_true",
                        help="break the one-client WAL down by record type (pg_waldump)")
    parser.add_argument("--before", type=Path, help="an older tree (its jobrunner/, sql/)")
    parser.add_argument("--label", default="before", help="what --before is, for the table")
    parser.add_argument("--no-throughput", action="store_true",
                        help="only the one-client rounds")
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
    many = f"pool, {args.tenants:,} tenants"
    # (suffix of the labels, tree): this checkout, and the older tree if given
    trees: list[tuple[str, Path]] = [("" if not args.before else " (this tree)", env.REPO)]
    if args.before:
        trees.insert(0, (f" ({args.label})", args.before.resolve()))
    baseline = PER_BATCH + (f" ({args.label})" if args.before else " (today)")
    variants: list[tuple[str, PerBatch]] = []
    for suffix, tree in trees:
        if tree == env.REPO:
            tag = "" if not args.before else " (this tree)"
            variants += [
                (PER_BATCH + (tag or " (today)"), PerBatch(server)),
                ("pool, 1 tenant" + tag, Pooled(server, "pool-1", "bench_pool_1", 1)),
                (many + tag, Pooled(server, "pool-many", "bench_pool_many", args.tenants)),
            ]
        else:
            variants += [
                (PER_BATCH + suffix, PerBatchIn(server, tree, "before", "bench_before")),
                ("pool, 1 tenant" + suffix,
                 PooledIn(server, tree, "pool-1-before", "bench_pool_1_before", 1)),
                (many + suffix, PooledIn(server, tree, "pool-many-before",
                                         "bench_pool_many_before", args.tenants)),
            ]
    single: list[dict] = []
    try:
        if args.one_client:
            single = one_client(server, args.one_client, args.tenants,
                                [(s if args.before else "", t) for s, t in trees],
                                args.waldump)
            if not args.before:  # (the labels of the table without --before)
                for r in single:
                    if r["variant"] == PER_BATCH:
                        r["variant"] = baseline
        if not args.no_throughput:
            for _, system in variants:
                system.setup()
        for rep in range(0 if args.no_throughput else args.reps):
            order = variants if rep % 2 == 0 else list(reversed(variants))
            for label, system in order:
                for batch in (1, 10):
                    r = measure(server, system, args.workers, batch, args.tasks, 120)
                    # (the WAL of the claims and acks alone: the run's minus the enqueue's,
                    # which for 1,000 tenants is 1,000 batches' rows and staging tables)
                    runs.append({**r.as_dict(), "variant": label, "rep": rep,
                                 "claim_wal_bytes": r.wal_bytes - system.enqueue_wal})
                    print(f"  {label:>32} b{batch:<2}: {r.rate:8.1f}/s  pg "
                          f"{r.pg_cpu_s / max(1, r.done) * 1e6:.0f} us/task, WAL "
                          f"{r.wal_bytes / max(1, r.done):.0f} B/task (claims and acks "
                          f"{runs[-1]['claim_wal_bytes'] / max(1, r.done):.0f})", flush=True)
    finally:
        server.stop()
    meta = {"started": started, "load_before": load_before, "load_after": env.load(),
            "command": " ".join(["python -m bench.pools", *(argv or sys.argv[1:])]),
            "machine": env.machine(), "tasks": args.tasks, "workers": args.workers,
            "reps": args.reps, "tenants": args.tenants, "baseline": baseline}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pools.json").write_text(json.dumps({"meta": meta, "runs": runs,
                                                     "one_client": single}, indent=1) + "\n")
    labels = [label for label, _ in variants]
    text = render(meta, runs, labels, single)
    (args.out / "pools.md").write_text(text)
    print(text)


def render(meta: dict, runs: list[dict], labels: list[str], single: list[dict]) -> str:
    def of(label: str, batch: int) -> list[dict]:
        return sorted((r for r in runs if r["variant"] == label and r["batch"] == batch),
                      key=lambda r: r["rep"])

    def paired(rs: list[dict], base: list[dict], key: str) -> str:
        by_rep = {r["rep"]: r[key] / max(1, r["done"]) if key != "rate" else r["rate"]
                  for r in base}
        ratios = [(r[key] / max(1, r["done"]) if key != "rate" else r["rate"]) / by_rep[r["rep"]]
                  for r in rs if r["rep"] in by_rep and by_rep[r["rep"]]]
        if not ratios:
            return "-"
        return f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"

    rows = []
    for label in labels:
        for batch in (1, 10):
            rs = of(label, batch)
            if not rs:
                continue
            base = of(meta["baseline"], batch)
            rows.append([label, batch, spread([r["rate"] for r in rs]),
                         "-" if label == meta["baseline"] else paired(rs, base, "rate"),
                         spread([r["pg_cpu_s"] / r["done"] * 1e6 for r in rs]),
                         spread([r["wal_bytes"] / r["done"] for r in rs]),
                         spread([r["claim_wal_bytes"] / r["done"] for r in rs]),
                         "-" if label == meta["baseline"]
                         else paired(rs, base, "claim_wal_bytes")])
    load = " ".join(f"{x:.2f}" for x in meta["load_before"])
    load_after = " ".join(f"{x:.2f}" for x in meta["load_after"])
    return "\n".join([
        "# Worker pools: claims across batches, fair across tenants (one run)\n",
        f"`{meta['command']}` at {meta['started']}; load average before {load}, after "
        f"{load_after}. {meta['workers']} worker processes, {meta['tasks']:,} no-op tasks "
        "with 1,000 shard keys per run, claim batch 1 and 10, "
        f"{meta['reps']} rounds, variants interleaved; median (min-max). \"vs today\" is the "
        "ratio to the per-batch run of the same round and batch (median and range over "
        "rounds). WAL bytes/task: the whole run, enqueue included; claims+acks: without the "
        "enqueue's WAL (measured around it: one transaction, which no claim can see "
        "before it commits).\n",
        table(["variant", "claim batch", "tasks/s", "tasks/s vs today", "PostgreSQL µs/task",
               "WAL bytes/task", "claims+acks WAL bytes/task", "claims+acks WAL vs today"],
              rows) + "\n",
        *(_one_client_table(single, labels, meta["baseline"]) if single else []),
        *(_waldump_table(single) if any("waldump" in r for r in single) else [])])


def _one_client_table(single: list[dict], labels: list[str], baseline: str) -> list[str]:
    rows = []
    for label in labels:
        rs = sorted((r for r in single if r["variant"] == label), key=lambda r: r["rep"])
        base = {r["rep"]: r for r in single if r["variant"] == baseline}

        def ratio(key: str, rs: list[dict] = rs, label: str = label,
                  base: dict = base) -> str:
            if label == baseline:
                return "-"
            xs = [r[key] / base[r["rep"]][key] for r in rs if r["rep"] in base]
            return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

        rows.append([label, spread([r["pg_us"] for r in rs]), ratio("pg_us"),
                     spread([r["wall_us"] for r in rs]), spread([r["wal_bytes"] for r in rs]),
                     ratio("wal_bytes")])
    rounds = max(r["rep"] for r in single) + 1
    return ["## One client: server CPU and WAL per task\n",
            f"One connection running the ack+claim loop alone over 10,000 tasks (1,000 shard "
            f"keys, claim batch 1, enqueued, vacuumed and checkpointed before), {rounds} "
            "rounds interleaved: the CPU of its server process, wall time and WAL per task, "
            "median (min-max), and ratios to today's claim of the same round.\n",
            table(["variant", "PostgreSQL µs/task", "vs today", "wall µs/task",
                   "WAL bytes/task", "WAL vs today"], rows) + "\n"]


def _waldump_table(single: list[dict]) -> list[str]:
    """Bytes per task by WAL record type (records and their full-page images), one column
    per variant, the record types that make up at least 1 % of any variant's WAL."""
    dumped = [r for r in single if "waldump" in r]
    kinds = sorted({k for r in dumped for k, v in r["waldump"].items()
                    if v >= 0.01 * sum(r["waldump"].values())},
                   key=lambda k: -max(r["waldump"].get(k, 0) for r in dumped))
    rows = [[k, *(f"{r['waldump'].get(k, 0):,.0f}" for r in dumped)] for k in kinds]
    rows.append(["total", *(f"{sum(r['waldump'].values()):,.0f}" for r in dumped)])
    return ["## Where one client's WAL goes\n",
            "`pg_waldump --stats=record` over the first one-client round of each variant: "
            "bytes per task by record type (the record and its full-page images).\n",
            table(["record type", *(r["variant"] for r in dumped)], rows) + "\n"]


if __name__ == "__main__":
    main()

