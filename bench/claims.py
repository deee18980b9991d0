"""``python -m bench.claims``: why batch claims come back short (issue 33).

N real worker processes drain a batch, as in the throughput stage, with three
instruments on:

- every worker counts its claim statements: rows asked for, rows leased, claims that
  came back short, the second claim an ack that released a shard triggers, busy acks;
- jobrunner_shard_take is replaced, in this run's database only, by a copy that
  reports each shard it refuses and why (a NOTICE the worker counts): 'locked' (the
  advisory try-lock failed: another claim is taking the shard right now) or 'leased'
  (a task of the shard is leased, as seen after the lock);
- pg_stat_activity and pg_locks are sampled every few ms: the workers' backends' wait
  events, the lock waits (not granted) by lock type, and any autovacuum at work;
- pg_stat_user_indexes before and after: index scans and entries read per task, by index
  (the leased index's entries per task are the issue-33 symptom);
- the WAL the run wrote and flushed (pg_stat_wal, pg_stat_io's WAL rows, with
  track_wal_io_timing on): flushes per second, bytes per flush, time in fsync;
- CPU per task of the server's processes (less the harness's and the sampler's backends)
  and of the worker processes, and the cores busy.

With --commit sync,off the workers run twice, interleaved: as they are, and with
synchronous_commit = off for every transaction of theirs (``options`` in their DSN):
is the fall at 16 workers the commit's wait for the WAL flush?  --sample-every 0 turns the
sampler off (it costs a share of a core on a two-core machine).

With --stale-stats each run starts as a worker that connects after an autovacuum
ANALYZE would: column statistics taken in the middle of a batch (half done, 80 leased),
then the table emptied by the harness's reset (whose ANALYZE of the empty table keeps
the column statistics). The workers' generic plans are made from those.

The instruments cost CPU (the NOTICEs, the sampler): the rates are for comparing the
settings of one invocation, not the throughput table's.

    python -m bench.claims --workers 1,4,8 --batch 10 --shards 1000,0 [--stale-stats]
    python -m bench.claims --workers 4,16 --shards 1000,0 --commit sync,off --reps 2
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

from .env import Server, child_env, machine, running, spawn, tree_cpu, wait_until
from .systems import Jobrunner

SAMPLE_EVERY = 0.005

# The copy of jobrunner_shard_take that says why it refuses a shard (same logic).
NOISY_SHARD_TAKE = """
CREATE OR REPLACE FUNCTION jobrunner_shard_take(p_tenant text, p_shard text)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(1246970229, hashtext(p_tenant || '/' || p_shard)) THEN
        RAISE NOTICE 'jobrunner-shard-refused locked';
        RETURN false;
    END IF;
    IF EXISTS (SELECT 1 FROM agent_work_queue l
               WHERE l.tenant_id = p_tenant AND l.shard_key = p_shard
                 AND l.status = 'leased') THEN
        RAISE NOTICE 'jobrunner-shard-refused leased';
        RETURN false;
    END IF;
    RETURN true;
END
$$;
"""


# -- inside a worker process ----------------------------------------------------------------
def _install_counters(out: Path) -> None:
    """Wrap the Queue so that each claim statement is counted (run in the worker)."""
    from jobrunner import queue as q

    stats: Counter = Counter()
    lock = threading.Lock()

    def dump() -> None:
        with lock:
            out.write_text(json.dumps(dict(stats)))

    atexit.register(dump)
    original_init = q.Queue.__init__

    def init(self, conn, *args, **kwargs):
        original_init(self, conn, *args, **kwargs)

        def notice(diag) -> None:
            text = diag.message_primary or ""
            if text.startswith("jobrunner-shard-refused"):
                with lock:
                    stats["refused " + text.split()[-1]] += 1

        conn.add_notice_handler(notice)

    q.Queue.__init__ = init
    original_run = q.Queue._run_completion

    def run_completion(self, failures, steps):
        kept, busy, leases = original_run(self, failures, steps)
        params = steps[-1][1] if steps else None
        if isinstance(params, dict) and params.get("limit"):
            with lock:
                stats["claims"] += 1
                stats["asked"] += int(params["limit"])
                stats["leased"] += len(leases)
                stats["short"] += len(leases) < int(params["limit"])
                stats["empty"] += not leases
                stats["after_position"] += params.get("after_id", 0) != 0
                if params["ids"] == "{}":
                    stats["claim_only"] += 1
        if busy:
            with lock:
                stats["busy_acks"] += len(busy)
        with lock:
            stats["statements"] += 1
            if stats["statements"] % 20 == 0:  # (SIGTERM may skip atexit)
                out.write_text(json.dumps(dict(stats)))
        return kept, busy, leases

    q.Queue._run_completion = run_completion


def worker_main() -> None:
    _install_counters(Path(os.environ["BENCH_CLAIM_STATS"]))
    from jobrunner.cli import main

    sys.argv = ["jobrunner", *sys.argv[2:]]
    main()


# -- the harness ------------------------------------------------------------------------
class Sampler:
    def __init__(self, server: Server, db: str, every: float = SAMPLE_EVERY) -> None:
        self.server, self.db, self.every = server, db, every
        self.pid = 0
        self.events: Counter = Counter()
        self.locks: Counter = Counter()
        self.vacuums: Counter = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        if self.every > 0:
            self._started = threading.Event()
            self._thread.start()
            self._started.wait(10)
        return self

    def reset(self) -> None:
        """Count from now on (the sampler starts before the harness's pause)."""
        with self._lock:
            self.events.clear()
            self.locks.clear()
            self.vacuums.clear()
            self.samples = 0

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self.every > 0:
            self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(self.server.admin_dsn, autocommit=True) as conn:
            self.pid = conn.info.backend_pid
            self._started.set()
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event FROM pg_stat_activity"
                    " WHERE datname = %s AND application_name LIKE 'jobrunner-worker %%'"
                    " AND query NOT LIKE 'LISTEN%%'",
                    (self.db,), prepare=True).fetchall()
                locks = conn.execute(
                    "SELECT l.locktype, l.mode FROM pg_locks l JOIN pg_stat_activity a"
                    " ON a.pid = l.pid WHERE NOT l.granted AND a.datname = %s",
                    (self.db,), prepare=True).fetchall()
                vacuums = conn.execute(
                    "SELECT datname, query FROM pg_stat_activity"
                    " WHERE backend_type = 'autovacuum worker' AND state = 'active'",
                    prepare=True).fetchall()
                with self._lock:
                    self._count(rows, locks, vacuums)
                time.sleep(self.every)

    def _count(self, rows: list, locks: list, vacuums: list) -> None:
        self.samples += 1
        for datname, text in vacuums:
            self.vacuums[f"{datname}: {text[:60]}"] += 1
        for state, wt, we in rows:
            self.events[f"{state} {wt or '-'}:{we or '-'}"] += 1
        for locktype, mode in locks:
            self.locks[f"{locktype} {mode}"] += 1


INDEX_STATS = ("SELECT indexrelname, idx_scan, idx_tup_read, idx_tup_fetch"
               " FROM pg_stat_user_indexes WHERE relname = 'agent_work_queue'")


def stale_statistics(system: Jobrunner) -> None:
    """Column statistics of a batch in progress, kept over the reset (see the docstring)."""
    system.reset()
    system.enqueue(20_000)
    system.sql("UPDATE agent_work_queue SET status = 'done' WHERE id %% 2 = 0")
    system.sql("UPDATE agent_work_queue SET status = 'leased', attempts = 1"
               " WHERE id IN (SELECT min(id) FROM agent_work_queue WHERE status = 'pending'"
               " GROUP BY shard_key LIMIT 80)")
    system.sql("ANALYZE agent_work_queue")


# The WAL written and flushed, by every process (backends at commit, the WAL writer).
# PostgreSQL 18 counts writes and fsyncs of WAL in pg_stat_io (object 'wal').
WAL_STATS = ("SELECT w.wal_records, w.wal_bytes, w.wal_buffers_full,"
             " coalesce(sum(i.writes), 0), coalesce(sum(i.write_bytes), 0),"
             " coalesce(sum(i.write_time), 0), coalesce(sum(i.fsyncs), 0),"
             " coalesce(sum(i.fsync_time), 0)"
             " FROM pg_stat_wal w LEFT JOIN pg_stat_io i ON i.object = 'wal'"
             " GROUP BY w.wal_records, w.wal_bytes, w.wal_buffers_full")
WAL_FIELDS = ("records", "bytes", "buffers_full", "writes", "write_bytes", "write_ms",
              "fsyncs", "fsync_ms")


def wal_stats(server: Server) -> dict[str, float]:
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(WAL_STATS).fetchone()
    return dict(zip(WAL_FIELDS, (float(v) for v in row), strict=True))


def wal_summary(w0: dict[str, float], w1: dict[str, float], seconds: float, done: int,
                commits: int) -> dict[str, float]:
    d = {k: w1[k] - w0[k] for k in WAL_FIELDS}
    fsyncs = max(d["fsyncs"], 1)
    return {"fsyncs_per_s": round(d["fsyncs"] / seconds), "commits_per_fsync":
            round(commits / fsyncs, 2), "bytes_per_fsync": round(d["write_bytes"] / fsyncs),
            "fsync_ms_each": round(d["fsync_ms"] / fsyncs, 3),
            "fsync_busy": round(d["fsync_ms"] / 1000 / seconds, 2),
            "write_ms_each": round(d["write_ms"] / max(d["writes"], 1), 3),
            "bytes_per_task": round(d["bytes"] / max(done, 1)),
            "buffers_full": int(d["buffers_full"])}


def commits(system: Jobrunner) -> int:
    system.sql("SELECT pg_stat_clear_snapshot()")
    return int(system.sql("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                          (system.db,))[0][0])


def index_stats(system: Jobrunner) -> dict[str, tuple[int, int, int]]:
    system.sql("SELECT pg_stat_clear_snapshot()")
    return {r[0]: tuple(r[1:]) for r in system.sql(INDEX_STATS)}


def one(server: Server, system: Jobrunner, workers: int, batch: int, tasks: int,
        cap: float, tmp: Path, stale: bool = False, commit: str = "sync",
        sample_every: float = SAMPLE_EVERY) -> dict:
    if stale:
        stale_statistics(system)
    system.reset()
    system.sql(NOISY_SHARD_TAKE)
    server.checkpoint()
    stat_files = [tmp / f"w{workers}-{batch}-{system.shards}-{i}.json" for i in range(workers)]
    procs = []
    for f in stat_files:
        f.unlink(missing_ok=True)
        args = system.worker_args(batch)[3:]
        if commit == "off":
            args[args.index(system.dsn)] = server.dsn(
                system.db, options="-c synchronous_commit=off")
        procs.append(spawn([sys.executable, "-m", "bench.claims", "--as-worker", *args],
                           env=child_env(BENCH_CLAIM_STATS=str(f))))
    with running(procs):
        wait_until(lambda: system.connections() >= workers, timeout=120, interval=0.1,
                   what="workers")
        time.sleep(1.0)
        wal0 = server.wal_lsn()
        idx0 = index_stats(system)
        with Sampler(server, system.db, sample_every) as sampler:
            harness = frozenset({system.poll_backend(), sampler.pid})
            time.sleep(1.5)  # (the harness's own statistics reported before the start)
            walstat0, commits0 = wal_stats(server), commits(system)
            pg0 = server.cpu_seconds(harness)
            w0 = sum(tree_cpu(p.pid) for p in procs)
            sampler.reset()
            system.enqueue(tasks)
            start = time.monotonic()
            while True:
                time.sleep(0.05)
                done = system.done(tasks)
                if done >= tasks or time.monotonic() - start > cap:
                    break
            seconds = time.monotonic() - start
            pg = server.cpu_seconds(harness) - pg0
            w = sum(tree_cpu(p.pid) for p in procs) - w0
        wal = server.wal_lsn() - wal0
        time.sleep(1.5)  # (backends report their statistics when idle)
        idx1 = index_stats(system)
        walstat1, commits1 = wal_stats(server), commits(system)
    stats: Counter = Counter()
    for f in stat_files:
        if f.exists():
            stats.update(json.loads(f.read_text()))
    n = max(sampler.samples, 1)
    return {"workers": workers, "batch": batch, "shards": system.shards, "commit": commit,
            "done": done, "rate": round(done / seconds), "wal_per_task": round(wal / max(done, 1)),
            "pg_us_per_task": round(pg / max(done, 1) * 1e6, 1),
            "worker_us_per_task": round(w / max(done, 1) * 1e6, 1),
            "cores_busy": round((pg + w) / seconds, 2),
            "wal": wal_summary(walstat0, walstat1, seconds, done, commits1 - commits0),
            "stale_stats": stale, "claims": dict(stats),
            "index_per_task": {k.removeprefix("agent_work_queue_"): {
                "scans": round((v[0] - idx0.get(k, (0, 0, 0))[0]) / max(done, 1), 2),
                "read": round((v[1] - idx0.get(k, (0, 0, 0))[1]) / max(done, 1), 2),
                "fetched": round((v[2] - idx0.get(k, (0, 0, 0))[2]) / max(done, 1), 2)}
                for k, v in idx1.items() if v != idx0.get(k)},
            "autovacuum_per_sample": {k: round(v / n, 3) for k, v in sampler.vacuums.items()},
            "backends_per_sample": {k: round(v / n, 2) for k, v in sampler.events.most_common(8)},
            "lock_waits_per_sample": {k: round(v / n, 3) for k, v in sampler.locks.most_common(6)}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-worker":
        worker_main()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--batch", default="10")
    ap.add_argument("--shards", default="1000,0")
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--cap", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--stale-stats", action="store_true",
                    help="plan the workers' statements with mid-batch column statistics")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--commit", default="sync",
                    help="the workers' synchronous_commit: sync (as configured), off, or both"
                         " (sync,off: interleaved)")
    ap.add_argument("--sample-every", type=float, default=SAMPLE_EVERY,
                    help="seconds between samples of pg_stat_activity (0: no sampler)")
    ap.add_argument("--worker-args", default="",
                    help="more arguments for every worker (e.g. '--poll-interval 0.02')")
    args = ap.parse_args()
    server = Server()
    server.start()
    server.configure(track_wal_io_timing="on")
    rows = []
    try:
        tmp = Path(tempfile.mkdtemp(prefix="jobrunner-claims-"))
        for shards in [int(s) for s in args.shards.split(",")]:
            system = Jobrunner(server, shards=shards,
                               extra_args=tuple(args.worker_args.split()))
            for batch in [int(b) for b in args.batch.split(",")]:
                for rep in range(args.reps):
                    for commit in args.commit.split(","):
                        for workers in [int(w) for w in args.workers.split(",")]:
                            row = one(server, system, workers, batch, args.tasks, args.cap,
                                      tmp, args.stale_stats, commit, args.sample_every)
                            rows.append({**row, "rep": rep})
                            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
