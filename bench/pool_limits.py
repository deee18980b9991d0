"""``python -m bench.pool_limits``: what flow control costs a pool's claim (issue 26 item
8, issue 27 item 4; docs/pools.md, "Flow control").

The steady measurement of bench.pools' ``--one-client``: one connection running the
worker's ack+claim loop at claim batch 1 (no worker processes) over ``--tasks`` no-op
tasks with 1,000 shard keys, enqueued, vacuumed and checkpointed beforehand, each variant
in a process of its own importing jobrunner from its tree, on its own database; the
server process's CPU, wall time and WAL per task. Variants, interleaved round by round
(the order reversed every other round), ratios paired per round:

- ``pool`` with ``--before``'s tree and this one: a pool without flow control, which
  claims with the unchanged plain statement (the change is the once-a-second
  pool_flow_control read);
- ``pool, limit``: every task names a limit that never binds (10^6 requests/s, 8 lanes):
  task_ack_and_claim_pool_limited;
- ``pool, limit + budget``: the same, each batch with a budget it never reaches;
- ``batch, limit``: the same tasks in one batch outside pools (task_ack_and_claim_limited),
  the single batch's flow control this is compared with.

Each pool variant has ``--tenants`` tenants, one batch each. Prints a table; writes
nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from . import env

# One client's loop, importing jobrunner from argv[1]: argv[2] dsn, argv[3] tenants (0: one
# batch outside pools), argv[4] tasks, argv[5] "limit", "budget" or "" (none).
_ONE_CLIENT = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import psycopg
from psycopg.rows import dict_row
from jobrunner.store.migrate import migrate
from jobrunner.queue.client import Queue
from jobrunner.model.types import Outcome
from jobrunner.model.validation import TaskSpec
dsn, tenants, n, mode = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
limits = ("bench",) if mode else None
specs = [TaskSpec(f"t{i}", {}, shard_key=f"s{i % 1000}", limits=limits) for i in range(n)]
with psycopg.connect(dsn, row_factory=dict_row) as conn:
    migrate(conn)
    if mode:
        from jobrunner.store import flowcontrol
        flowcontrol.set_limit(conn, "bench", requests=10**6, per=1)
    q = Queue(conn)
    with conn.transaction():
        if not tenants:
            q.enqueue("b", "T", specs)
        per = -(-n // max(1, tenants))
        for k in range(tenants):
            q.enqueue(f"b{k}", f"T{k}", specs[k * per:(k + 1) * per], pool="bench")
            conn.execute("DROP TABLE jobrunner_enqueue_stage")
    if mode == "budget":
        for k in range(max(1, tenants)):
            q.set_budget(f"b{k}" if tenants else "b", tokens=10**12)
with psycopg.connect(dsn, autocommit=True) as conn:
    conn.execute("VACUUM ANALYZE agent_work_queue")
    conn.execute("CHECKPOINT")
    pid = conn.info.backend_pid
    def cpu():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    def lsn():
        return conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()[0]
    q = Queue(conn)
    kw = {"pool": "bench"} if tenants else {}
    batch = None if tenants else "b"
    c0, w0, t0, done = cpu(), lsn(), time.perf_counter(), 0
    leases = q.complete_and_claim("w", (), batch, 1, **kw)[1]
    while leases:
        leases = q.complete_and_claim("w", [Outcome(x, True, None) for x in leases],
                                      batch, 1, **kw)[1]
        done += len(leases)
    wall, pg, w1 = time.perf_counter() - t0, cpu() - c0, lsn()
    print(done, pg, wall, int(w1 - w0))
"""


def run_one(server: env.Server, name: str, tree: Path, tenants: int, tasks: int,
            mode: str) -> dict:
    dsn = server.create_db(name)
    out = subprocess.run([sys.executable, "-c", _ONE_CLIENT, str(tree), dsn, str(tenants),
                          str(tasks), mode], capture_output=True, text=True, cwd=tree,
                         env=env.child_env(PYTHONPATH=os.pathsep.join([str(tree),
                                                                       str(env.REPO)])))
    if out.returncode:
        raise RuntimeError(f"one client ({tree}, {mode}): {out.stderr[-2000:]}")
    done_s, pg_s, wall_s, wal_s = out.stdout.split()
    done = int(done_s)
    return {"done": done, "pg_us": float(pg_s) / done * 1e6,
            "wall_us": float(wall_s) / done * 1e6, "wal": int(wal_s) / done}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pool_limits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--before", type=Path, required=True,
                        help="an older tree (its jobrunner/, sql/): `git archive main "
                             "jobrunner sql | tar -x -C DIR`")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    before = args.before.resolve()
    variants = [("pool (before)", before, args.tenants, ""),
                ("pool", env.REPO, args.tenants, ""),
                ("pool, limit", env.REPO, args.tenants, "limit"),
                ("pool, limit + budget", env.REPO, args.tenants, "budget"),
                ("batch, limit", env.REPO, 0, "limit")]
    server = env.Server()
    server.start()
    load_before = env.load()
    results: dict[str, list[dict]] = {label: [] for label, *_ in variants}
    try:
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else list(reversed(variants))
            for i, (label, tree, tenants, mode) in enumerate(order):
                r = run_one(server, f"bench_pl_{rnd}_{i}", tree, tenants, args.tasks, mode)
                results[label].append(r)
                print(f"  round {rnd} {label:>22}: pg {r['pg_us']:5.0f} us/task, wall "
                      f"{r['wall_us']:5.0f} us/task, WAL {r['wal']:5.0f} B/task", flush=True)
    finally:
        server.stop()

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"

    def ratio(label: str, base: str, key: str) -> str:
        xs = [a[key] / b[key] for a, b in zip(results[label], results[base], strict=True)]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    lines = [f"`python -m bench.pool_limits --rounds {args.rounds} --tasks {args.tasks} "
             f"--tenants {args.tenants} --before DIR`; load average before "
             f"{' '.join(f'{x:.2f}' for x in load_before)}, after "
             f"{' '.join(f'{x:.2f}' for x in env.load())}; one client, claim batch 1; "
             "median (min-max) over rounds, ratios paired per round.", "",
             "| variant | server µs/task | vs pool (before) | vs pool | wall µs/task "
             "| wall vs pool | WAL B/task |", "|---|---|---|---|---|---|---|"]
    for label, *_ in variants:
        rs = results[label]
        lines.append(f"| {label} | {med([r['pg_us'] for r in rs])} | "
                     f"{ratio(label, 'pool (before)', 'pg_us')} | "
                     f"{ratio(label, 'pool', 'pg_us')} | {med([r['wall_us'] for r in rs])} | "
                     f"{ratio(label, 'pool', 'wall_us')} | {med([r['wal'] for r in rs])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
