"""`jobrunner run MANIFEST`: a whole batch on one machine, with a live progress bar.

It is the operator's shape in miniature: enqueue the manifest's shards idempotently,
start N worker processes that claim until the batch is drained (restarting a crashed
one, as a Job would), and report. Re-running the same manifest resumes the batch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from . import db
from .embedded import EmbeddedPostgres
from .manifest import BatchRunSpec, load_manifest
from .migrate import migrate
from .queue import Queue

MAX_RESTARTS_PER_WORKER = 6
console = Console(stderr=False)


@dataclass
class _Proc:
    index: int
    popen: subprocess.Popen
    restarts: int = 0


def run_local(manifest: Path, *, workers: int | None, batch: str | None, data_dir: Path | None,
              dsn: str | None) -> int:
    spec = load_manifest(manifest)
    batch_id = batch or spec.batch_id or f"local/{spec.name}"
    server = None
    if not dsn:
        server = EmbeddedPostgres(data_dir)
        with console.status("starting embedded PostgreSQL…"):
            dsn = server.start()
        console.print(f"[dim]embedded PostgreSQL on 127.0.0.1:{server.port} "
                      f"(data: {server.root})[/]")
    try:
        return _run(spec, manifest, batch_id, dsn, workers or spec.workers)
    finally:
        if server is not None:
            server.stop()


def _run(spec: BatchRunSpec, manifest: Path, batch_id: str, dsn: str, n_workers: int) -> int:
    with db.connect(dsn, purpose="jobrunner-run") as conn:
        migrate(conn)
        queue = Queue(conn)
        if spec.tasks is not None:
            result = queue.enqueue(batch_id, spec.tenant, spec.tasks,
                                   max_attempts=spec.max_attempts)
            console.print(f"batch [bold]{batch_id}[/]: {result.new} task(s) enqueued, "
                          f"{result.existing} already there")
        else:
            queue.batch(batch_id)
        start = time.monotonic()
        done_before = queue.counts(batch_id)["done"]
        procs = [_Proc(i, _spawn(spec, manifest, batch_id, dsn, i)) for i in range(n_workers)]
        interrupted = False
        try:
            _watch(queue, batch_id, procs, spec, manifest, dsn)
        except KeyboardInterrupt:
            interrupted = True
            console.print("[yellow]interrupted: workers are giving their tasks back…[/]")
            for p in procs:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.popen.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
        elapsed = time.monotonic() - start
        return _summary(queue, batch_id, elapsed, n_workers, procs, interrupted, done_before)


def _spawn(spec: BatchRunSpec, manifest: Path, batch_id: str, dsn: str, index: int
           ) -> subprocess.Popen:
    env = dict(os.environ)
    env["JOBRUNNER_DATABASE_URL"] = dsn  # never on the command line, where ps shows it
    env["JOBRUNNER_WORKER_ID"] = f"local-{index}"
    # The manifest's folder and its parent are importable, so `handler: mymodule:fn` next
    # to the manifest (or `examples.mymodule:fn` from the repository) works.
    folder = manifest.resolve().parent
    paths = [str(folder), str(folder.parent), os.getcwd(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    args = [sys.executable, "-m", "jobrunner", "worker", "--batch", batch_id,
            "--exit-when-drained", "--log-level", "warning", *spec.worker_args()]
    log_dir = Path(os.environ.get("JOBRUNNER_LOG_DIR", "")) if os.environ.get(
        "JOBRUNNER_LOG_DIR") else None
    stderr = open(log_dir / f"worker-{index}.log", "ab") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                            start_new_session=True)


def _watch(queue: Queue, batch_id: str, procs: list[_Proc], spec: BatchRunSpec,
           manifest: Path, dsn: str) -> None:
    columns = [BarColumn(bar_width=24), MofNCompleteColumn(),
               TextColumn("dead [red]{task.fields[dead]}[/] · in flight {task.fields[leased]} · "
                          "retrying {task.fields[retrying]} · {task.fields[rate]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    started = time.monotonic()
    with Progress(*columns, console=console, transient=False, refresh_per_second=8) as progress:
        bar = progress.add_task("", total=None, dead=0, leased=0, retrying=0, rate="")
        first_done: int | None = None
        while True:
            counts = queue.counts(batch_id)
            total = sum(counts.values())
            finished = counts["done"] + counts["dead"] + counts["cancelled"]
            first_done = counts["done"] if first_done is None else first_done
            elapsed = max(time.monotonic() - started, 1e-6)
            rate = (counts["done"] - first_done) / elapsed
            health = queue.health(batch_id)
            retrying = counts["pending"] - health["ready"]
            progress.update(bar, total=total, completed=finished, dead=counts["dead"],
                            leased=counts["leased"], retrying=retrying,
                            rate=f"{rate:.1f}/s")
            alive = [p for p in procs if p.popen.poll() is None]
            for p in procs:
                code = p.popen.poll()
                if code not in (None, 0) and p.restarts < MAX_RESTARTS_PER_WORKER:
                    p.restarts += 1
                    p.popen = _spawn(spec, manifest, batch_id, dsn, p.index)
                    alive.append(p)
            if not alive:
                counts = queue.counts(batch_id)
                progress.update(bar, total=sum(counts.values()),
                                completed=counts["done"] + counts["dead"] + counts["cancelled"],
                                dead=counts["dead"], leased=counts["leased"])
                return
            time.sleep(0.25)


def _summary(queue: Queue, batch_id: str, elapsed: float, n_workers: int, procs: list[_Proc],
             interrupted: bool, done_before: int) -> int:
    counts = queue.counts(batch_id)
    stats = queue.conn.execute(
        "SELECT coalesce(sum(attempts), 0) AS attempts, count(*) AS tasks,"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at))"
        "   FILTER (WHERE status = 'done') AS p50_latency"
        " FROM agent_work_queue WHERE batch_id = %s", (batch_id,)).fetchone()
    queue.conn.rollback()
    total = sum(counts.values())
    retries = int(stats["attempts"]) - counts["done"] - counts["dead"]
    table = Table(title=f"batch {batch_id}", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    rows = [
        ("tasks", total), ("done", counts["done"]), ("dead", counts["dead"]),
        ("cancelled", counts["cancelled"]), ("still pending", counts["pending"]),
        ("still leased", counts["leased"]), ("retries", max(retries, 0)),
        ("workers", n_workers),
        ("worker restarts", sum(p.restarts for p in procs)),
        ("done in this run", counts["done"] - done_before),
        ("elapsed", f"{elapsed:.1f}s"),
        ("throughput", f"{(counts['done'] - done_before) / elapsed:.1f} tasks/s"
         if elapsed else "-"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    if counts["dead"]:
        dead = queue.list_dead(batch_id, limit=5)
        console.print("[red]dead tasks[/] (first 5; see `jobrunner dead list --batch "
                      f"{batch_id}`):")
        for row in dead:
            console.print(f"  {row['task_key']}: {(row['last_error'] or '')[:160]}")
    if total and counts["done"] == done_before == total:
        console.print(f"batch {batch_id} was already complete: nothing to do. Run it again "
                      "under a new id with --batch NEW-ID.")
    if interrupted:
        return 130
    if counts["pending"] or counts["leased"]:
        return 1
    return 3 if counts["dead"] else 0
