"""``python -m bench.rls``: what row-level security costs the claim (issue 29).

The throughput stage's workload (4 worker processes, 20,000 no-op tasks with 1,000 shard
keys, claim batch 1 and 10), interleaved, on one embedded server, each variant on its own
database set up by `jobrunner db grant` (so every worker is a non-superuser: a superuser
bypasses row-level security and would measure nothing):

- ``no RLS``: the tables' row-level security disabled (the schema before migration
  0022), the worker a tenant's login role;
- ``RLS, tenant``: the policies on, the worker a login role bound to the batch's tenant
  (`jobrunner tenant create`): each protected table's RESTRICTIVE policy TO that role
  (migration 0026, sql/grants/tenant_policies.sql) compares tenant_id with a constant on
  every row it reads;
- ``RLS, unbound``: the policies on, the worker a login role of the worker component
  bound to no tenant (what a single-DSN install's owner pays too: FORCE): the only
  policy that applies is jobrunner_all, USING (true), which the planner drops.

Writes ``bench/results/rls.md`` and ``rls.json``: per variant and claim batch the median
rate, server and worker CPU per task, and the paired ratio of each RLS variant to
``no RLS`` (each repetition's runs are next to each other: the ratio of a pair is taken,
then the median of the pairs).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql

from jobrunner.store import roles

from . import env
from .report import spread, table
from .systems import TENANT, Jobrunner
from .throughput import measure

VARIANTS = ("no RLS", "RLS, tenant", "RLS, unbound")


class Variant(Jobrunner):
    """jobrunner on a database of its own, its workers logging in as a login role."""

    def __init__(self, server: env.Server, label: str, db: str) -> None:
        super().__init__(server)
        self.label, self.db, self.name = label, db, db
        self.worker_dsn = ""

    def install(self) -> None:
        prefix = self.db
        with psycopg.connect(self.dsn) as conn:
            roles.grant(conn, prefix)
        tenants = () if self.label == "RLS, unbound" else (TENANT,)
        with psycopg.connect(self.dsn) as conn:
            login = roles.create_login(conn, self.dsn, f"{prefix}_w", "worker", tenants)
        self.worker_dsn = login.dsn
        if self.label == "no RLS":
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for (name,) in conn.execute("SELECT relname FROM pg_class"
                                            " WHERE relrowsecurity").fetchall():
                    conn.execute(sql.SQL("ALTER TABLE {} NO FORCE ROW LEVEL SECURITY, "
                                         "DISABLE ROW LEVEL SECURITY").format(
                                             sql.Identifier(name)))

    def worker_args(self, batch_size: int) -> list[str]:
        args = super().worker_args(batch_size)
        args[args.index("--dsn") + 1] = self.worker_dsn
        return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rls", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # clean up
    server = env.Server()
    server.start()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = env.load()
    runs = []
    try:
        systems = [Variant(server, label, f"bench_rls_{i}") for i, label in enumerate(VARIANTS)]
        for system in systems:
            system.setup()
        for rep in range(args.reps):
            for batch in (1, 10):
                # (the order turns with the repetition: no variant always runs first)
                for system in systems[rep % 3:] + systems[:rep % 3]:
                    r = measure(server, system, args.workers, batch, args.tasks, 60)
                    runs.append({**r.as_dict(), "variant": system.label, "rep": rep})
                    print(f"  {system.label:>13} b{batch:<2}: {r.rate:8.1f}/s  pg "
                          f"{r.pg_cpu_s / max(1, r.done) * 1e6:.0f} us/task, worker "
                          f"{r.worker_cpu_s / max(1, r.done) * 1e6:.0f} us/task", flush=True)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"started": started, "load_before": load_before, "load_after": env.load(),
            "command": " ".join(["python -m bench.rls", *sys.argv[1:]]),
            "machine": env.machine()}
    (args.out / "rls.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1)
                                       + "\n")
    print(report(runs, meta, args))


PLANS = """## The plans: what each protected reference costs

The policies since migration 0026 (docs/security.md "Tenants in the rows"): every
protected table carries `jobrunner_all`, permissive, `TO PUBLIC`, `USING (true)`; a login
role bound to tenants also has a restrictive policy `TO` it per table, its tenants as
constants (`sql/grants/tenant_policies.sql`).

- **RLS, unbound** (and the owner, operator, API, read-only, a single-DSN install): the
  only policy is `USING (true)`, which the planner drops. The claim's generic plan is
  the plan without row-level security, node for node and estimate for estimate
  (`tests/test_claim_plans.py` compares them for the four claim statements); the one
  difference is the order of the conditions of the pending-index scan's filter (the
  query's own quals are a level above the dropped policy's, and the planner puts the
  cheap leakproof ones first): `status = 'pending'` before `limits <@ ...` in the
  limited claims. Leakproofness stops nothing: every index condition is where it was.
- **RLS, tenant**: each reference of a protected table gets `tenant_id = ANY
  ('{t}'::text[])`, a comparison with a constant, as a filter on the rows it reads
  (lockable, acked, the candidates from the pending index, claimed, the busy check) or,
  in the shard pre-filter's probe of the leased index, as one more index condition. No
  InitPlan, no SubPlan, nothing read of the bindings (0022's policies added an InitPlan
  per reference for everyone, and a hashed SubPlan over the bindings for bound roles).
  The one change of node: the busy check's pkey probe is an index scan instead of an
  index-only scan (it reads tenant_id from the row). Tables without a tenant column
  (effects, usage, task keys, chunks; not read by the claim) add a hashed SubPlan over
  the tenant's batches or files, built once per statement.
"""


def _ratios(values: list[float]) -> str:
    """The median of the paired ratios, and their spread (min-max)."""
    if len(values) < 2:
        return f"{statistics.median(values):.3f}"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _per_task(r: dict, key: str) -> float:
    return r[key] / max(1, r["done"]) * 1e6


def report(runs: list[dict], meta: dict, args: argparse.Namespace) -> str:
    rows = []
    for batch in (1, 10):
        base = {r["rep"]: r for r in runs if r["variant"] == "no RLS" and r["batch"] == batch}
        for label in VARIANTS:
            rs = [r for r in runs if r["variant"] == label and r["batch"] == batch]
            pairs = [(r, base[r["rep"]]) for r in rs if r["rep"] in base]
            ratio = _ratios([a["rate"] / b["rate"] for a, b in pairs])
            pg_ratio = _ratios([_per_task(a, "pg_cpu_s") / _per_task(b, "pg_cpu_s")
                                for a, b in pairs])
            rows.append([label, batch, spread([r["rate"] for r in rs]),
                         f"{statistics.median(_per_task(r, 'pg_cpu_s') for r in rs):,.0f}",
                         f"{statistics.median(_per_task(r, 'worker_cpu_s') for r in rs):,.0f}",
                         ratio, pg_ratio])
    text = "\n".join([
        "# What row-level security costs the claim (one run)\n",
        f"`{meta['command']}` at {meta['started']}; load average before "
        f"{' '.join(f'{x:.2f}' for x in meta['load_before'])}, after "
        f"{' '.join(f'{x:.2f}' for x in meta['load_after'])}. {args.workers} worker "
        f"processes logging in as non-superuser roles, {args.tasks:,} no-op tasks with "
        f"1,000 shard keys, median of {args.reps} (min-max); ratios are the median (min-max) "
        "of the paired ratios to `no RLS` (same repetition and claim batch, run next to "
        "each other).\n",
        table(["variant", "claim batch", "tasks/s", "PostgreSQL µs/task", "worker µs/task",
               "rate / no RLS", "PostgreSQL µs / no RLS"], rows) + "\n", PLANS])
    (args.out / "rls.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
