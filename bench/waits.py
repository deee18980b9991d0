"""Where the backends of a 4-worker run spend their time: wait events, sampled.

Throughput at batch 1 is bounded by more than CPU: every task ends in a commit, and a
commit waits for its WAL to reach the disk. This samples pg_stat_activity every few
milliseconds during one run of each configuration (and during pgbench at the same
client count) and reports the share of backend time in each state, grouped:

- running: active, no wait event (on a CPU, or waiting for one)
- WAL flush: waiting for the commit's WAL write and fdatasync (LWLock WALWrite, IO
  WalSync/WalWrite): group commit shares one flush between the commits waiting for it;
  the rare wait to insert WAL (LWLock WALInsert) is counted here too
- waiting for the client: idle between statements (the worker or pgbench is working,
  or waiting for a CPU, or the network)
- row or lock waits: Lock / LWLock other than WAL (contention between workers)

The sampler's own queries cost the server some CPU (a few per cent of one core), so
these runs' rates are not the throughput section's; they are reported only to show
how long each state lasts per task.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

from .env import Server
from .systems import PgBench, System
from .throughput import measure, pgbench_run

SAMPLE_EVERY = 0.004  # seconds between samples

GROUPS = ("running", "WAL flush", "waiting for the client", "row or lock waits", "other")


def group(state: str, wait_type: str | None, wait_event: str | None) -> str:
    if state != "active":
        return "waiting for the client" if state.startswith("idle") else "other"
    if wait_type is None:
        return "running"
    if (wait_type, wait_event) in {("LWLock", "WALWrite"), ("IO", "WalSync"),
                                   ("IO", "WalWrite"), ("LWLock", "WALInsert")}:
        return "WAL flush"
    if wait_type == "Client":
        return "waiting for the client"
    if wait_type in ("Lock", "LWLock"):
        return "row or lock waits"
    return "other"


class Sampler:
    """Samples the states of the backends whose application_name matches `pattern`, on
    its own connection and thread, until stopped; each sample is timestamped so that
    only those inside a run's measured window are counted."""

    def __init__(self, server: Server, pattern: str) -> None:
        self.server, self.pattern = server, pattern
        self.samples: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(self.server.admin_dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event FROM pg_stat_activity"
                    " WHERE application_name LIKE %s AND pid <> pg_backend_pid()",
                    (self.pattern,), prepare=True).fetchall()
                now = time.monotonic()
                for state, wait_type, wait_event in rows:
                    self.samples.append((now, group(state or "", wait_type, wait_event),
                                         f"{state} {wait_type or '-'}:{wait_event or '-'}"))
                time.sleep(SAMPLE_EVERY)

    def summary(self, start: float, end: float) -> dict:
        inside = [(g, e) for t, g, e in self.samples if start <= t <= end]
        groups = Counter(g for g, _ in inside)
        total = len(inside) or 1
        return {"shares": {g: round(groups[g] / total, 4) for g in GROUPS},
                "samples": len(inside),
                "events": dict(Counter(e for _, e in inside).most_common(8))}


def waits(server: Server, configs: list[tuple[System, int]], pgbench: PgBench,
          workers: int, tasks: int, cap: float, pgbench_seconds: float,
          logdir: Path) -> list[dict]:
    pgbench.setup()
    for system, _ in configs:
        system.setup()
    # fdatasync timings in pg_stat_io (for this stage only: a clock read per flush)
    server.configure(track_wal_io_timing="on")
    try:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")  # WAL by record type
            return _waits(server, conn, configs, pgbench, workers, tasks, cap,
                          pgbench_seconds, logdir)
    finally:
        server.configure(track_wal_io_timing=None)


def _wal(conn: psycopg.Connection) -> tuple[str, float, float]:
    """WAL position, WAL fsyncs and their total time (ms), server-wide."""
    time.sleep(1.0)  # backends report their I/O statistics when idle or exiting
    lsn, fsyncs, fsync_ms = conn.execute(
        "SELECT pg_current_wal_lsn()::text,"
        " (SELECT coalesce(sum(fsyncs), 0) FROM pg_stat_io WHERE object = 'wal'),"
        " (SELECT coalesce(sum(fsync_time), 0) FROM pg_stat_io WHERE object = 'wal')"
    ).fetchone()
    return lsn, float(fsyncs), float(fsync_ms)


def _flushes(conn: psycopg.Connection, before: tuple[str, float, float],
             after: tuple[str, float, float], units: int) -> dict:
    (lsn0, fsyncs0, ms0), (lsn1, fsyncs1, ms1) = before, after
    fsyncs = fsyncs1 - fsyncs0
    wal = conn.execute("SELECT %s::pg_lsn - %s::pg_lsn", (lsn1, lsn0)).fetchone()[0]
    records = conn.execute(
        'SELECT "resource_manager/record_type", count, combined_size'
        " FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, per_record => true)"
        " WHERE count > 0 ORDER BY combined_size DESC LIMIT 10", (lsn0, lsn1)).fetchall()
    units = max(units, 1)  # (a run that finished nothing still reports its WAL)
    return {"wal_bytes_per_unit": round(float(wal) / units), "units": units,
            "fsyncs_per_unit": round(fsyncs / units, 3),
            "fsync_us": round((ms1 - ms0) / fsyncs * 1000) if fsyncs else None,
            "wal_records": {name: {"per_unit": round(count / units, 2),
                                   "bytes_per_unit": round(size / units)}
                            for name, count, size in records}}


def _waits(server: Server, conn: psycopg.Connection, configs: list[tuple[System, int]],
           pgbench: PgBench, workers: int, tasks: int, cap: float, pgbench_seconds: float,
           logdir: Path) -> list[dict]:
    rows = []
    before = _wal(conn)
    with Sampler(server, "pgbench%") as sampler:
        started = time.monotonic()
        limit = pgbench_run(server, pgbench, workers, pgbench_seconds)
        ended = time.monotonic()
    # (the middle of the run: pgbench's clients connect at its start, exit at its end)
    margin = min(1.0, pgbench_seconds / 4)
    rows.append({"system": "pgbench (1-row UPDATE per transaction)", "batch": None,
                 "workers": workers, "rate": limit["tps"],
                 **sampler.summary(started + margin, ended - margin),
                 **_flushes(conn, before, _wal(conn), limit["transactions"]
                            or round(limit["tps"] * pgbench_seconds))})
    for system, batch in configs:
        before = _wal(conn)
        with Sampler(server, system.app_pattern) as sampler:
            result = measure(server, system, workers, batch, tasks, cap, logdir)
        # (the run's own window: measure() returns only after its workers stopped)
        summary = sampler.summary(result.ended - result.seconds, result.ended)
        # (WAL and flushes over the whole measurement: the enqueue's share is included)
        rows.append({"system": system.name, "batch": batch, "workers": workers,
                     "rate": result.rate, **summary,
                     **_flushes(conn, before, _wal(conn), result.done)})
        print(f"    {system.name[:24]:>24} b{batch:<2}: {result.rate:8.1f}/s "
              f"{summary['shares']} {rows[-1]['fsync_us']} µs/fsync", flush=True)
    return rows
