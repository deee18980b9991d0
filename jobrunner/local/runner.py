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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import psycopg
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

from jobrunner.features import generators
from jobrunner.features import reduce as reduce_step
from jobrunner.features import status as batch_status
from jobrunner.features.manifest import BatchRunSpec, load_manifest
from jobrunner.features.reduce import check_loadable
from jobrunner.local.embedded import EmbeddedPostgres
from jobrunner.model.errors import JobrunnerError, UnknownBatch
from jobrunner.model.validation import RESERVED_KEYS
from jobrunner.queue.client import Queue
from jobrunner.store import db, tasks
from jobrunner.store.migrate import migrate

MAX_RESTARTS_PER_WORKER = 6
console = Console(stderr=False)


@dataclass
class _Proc:
    index: int
    popen: subprocess.Popen
    restarts: int = 0


# Something that runs beside the workers while the batch runs, given the database's DSN
# (the CLI's `--console`: `jobrunner serve` on the run's database; cli/batch_api.py).
Beside = Callable[[str], AbstractContextManager[object]]


def run_local(manifest: Path, *, workers: int | None, batch: str | None, data_dir: Path | None,
              dsn: str | None, beside: Beside | None = None) -> int:
    spec = load_manifest(manifest)
    batch_id = batch or spec.batch_id or f"local/{spec.name}"
    if spec.reduce is not None:
        # Loaded as the workers will load it: a reduce step that does not load is refused
        # before anything is written (not discovered once every task has run).
        check_loadable(spec.reduce, _import_paths(manifest))
    if spec.generator is not None:
        generators.check_loadable(spec.generator, _import_paths(manifest))
    server = None
    if not dsn:
        server = EmbeddedPostgres(data_dir)
        with console.status("starting embedded PostgreSQL…"):
            dsn = server.start()
        console.print(f"[dim]embedded PostgreSQL on 127.0.0.1:{server.port} "
                      f"(data: {server.root})[/]")
    try:
        return _run(spec, manifest, batch_id, dsn, workers or spec.workers,
                    dsn_given=server is None, beside=beside)
    finally:
        if server is not None:
            server.stop()


@contextmanager
def existing_database(dsn: str | None) -> Iterator[str]:
    """The database to read a batch from: --dsn or $JOBRUNNER_DATABASE_URL; without
    either, the embedded PostgreSQL that `jobrunner run` used (started for the command and
    stopped after it, unless it was running already)."""
    if dsn or os.environ.get(db.DSN_ENV):
        yield db.resolve_dsn(dsn)
        return
    try:
        server = EmbeddedPostgres()
        found = (server.data / "PG_VERSION").exists()
    except ImportError:  # (no [local] extra: there is no embedded server to read)
        found = False
    if not found:
        yield db.resolve_dsn(dsn)  # the usual error: no database
        return
    was_running = server.is_running()
    url = server.start()
    try:
        yield url
    except UnknownBatch as exc:
        # Say where we looked: the user may have meant another database.
        raise JobrunnerError(f"{exc} in the embedded database of `jobrunner run` (no --dsn "
                             f"and no {db.DSN_ENV} given)") from None
    finally:
        if not was_running:
            server.stop()


def _import_paths(manifest: Path) -> list[str]:
    """What the workers can import from: the manifest's folder and its parent, so
    `handler: mymodule:fn` next to the manifest (or `examples.mymodule:fn` from the
    repository) works, and the current directory."""
    folder = manifest.resolve().parent
    return [str(folder), str(folder.parent), os.getcwd()]


def _run(spec: BatchRunSpec, manifest: Path, batch_id: str, dsn: str, n_workers: int, *,
         dsn_given: bool, beside: Beside | None = None) -> int:
    with db.connect(dsn, purpose="jobrunner-run") as conn, \
            _beside(beside, dsn, conn):
        queue = Queue(conn)
        step = spec.reduce.as_json() if spec.reduce else None
        if spec.tasks is not None:
            result = queue.enqueue(batch_id, spec.tenant, spec.tasks,
                                   max_attempts=spec.max_attempts, reduce=step,
                                   limits=list(spec.limits) if spec.limits else None,
                                   tokens=spec.tokens)
            console.print(f"batch [bold]{batch_id}[/]: {result.new} task(s) enqueued, "
                          f"{result.existing} already there"
                          + (f"; reduce: {spec.reduce.describe()}" if spec.reduce else ""))
        elif spec.generator is not None:
            new = generators.start(conn, batch_id, spec.tenant, spec.generator, reduce=step)
            console.print(f"batch [bold]{batch_id}[/]: generator {spec.generator.describe()} "
                          + ("enqueued: its tasks are enqueued as it runs" if new
                             else "was enqueued before (it does not run again)")
                          + (f"; reduce: {spec.reduce.describe()}" if spec.reduce else ""))
        else:
            queue.batch(batch_id)
            reduce_step.attach(conn, batch_id, spec.reduce)
        if spec.budget_tokens is not None or spec.budget_cost is not None:
            queue.set_budget(batch_id, tokens=spec.budget_tokens,
                             cost=str(spec.budget_cost) if spec.budget_cost else None)
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
        return _summary(queue, batch_id, elapsed, n_workers, procs, interrupted, done_before,
                        dsn_given)


@contextmanager
def _beside(beside: Beside | None, dsn: str, conn: psycopg.Connection) -> Iterator[None]:
    # Migrated first: what runs beside (the console) reads the schema from its start.
    migrate(conn)
    with beside(dsn) if beside is not None else nullcontext():
        yield


def _spawn(spec: BatchRunSpec, manifest: Path, batch_id: str, dsn: str, index: int
           ) -> subprocess.Popen:
    env = dict(os.environ)
    env["JOBRUNNER_DATABASE_URL"] = dsn  # never on the command line, where ps shows it
    env["JOBRUNNER_WORKER_ID"] = f"local-{index}"
    paths = [*_import_paths(manifest), env.get("PYTHONPATH", "")]
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
                          "retrying {task.fields[retrying]} · {task.fields[rate]}"
                          "{task.fields[reduce]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    started = time.monotonic()
    reducing = spec.reduce is not None
    generating = spec.generator is not None
    budgeted = spec.budget_tokens is not None or spec.budget_cost is not None
    with Progress(*columns, console=console, transient=False, refresh_per_second=8) as progress:
        bar = progress.add_task("", total=None, dead=0, leased=0, retrying=0, rate="",
                                reduce="")
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
            phase = ""
            if generating:
                gen = generators.state(queue.conn, batch_id)
                phase = f" · generator: {gen.phase().lower()}" if gen else ""
            if reducing:
                st = reduce_step.state(queue.conn, batch_id)
                phase += f" · reduce: {st.phase(counts)}" if st else ""
            if budgeted and counts["pending"] and queue.usage(batch_id, by_status=False).exhausted:
                # claims stopped: say why, and how to resume, instead of a frozen bar
                phase += (f" · [yellow]budget exhausted[/]: `jobrunner budget set --batch "
                          f"{batch_id} ...` resumes")
            progress.update(bar, total=total, completed=finished, dead=counts["dead"],
                            leased=counts["leased"], retrying=retrying,
                            rate=f"{rate:.1f}/s", reduce=phase)
            alive = [p for p in procs if p.popen.poll() is None]
            for p in procs:
                code = p.popen.poll()
                if code not in (None, 0) and p.restarts < MAX_RESTARTS_PER_WORKER:
                    p.restarts += 1
                    p.popen = _spawn(spec, manifest, batch_id, dsn, p.index)
                    alive.append(p)
            if not alive:
                counts = queue.counts(batch_id)
                st = reduce_step.state(queue.conn, batch_id) if reducing else None
                progress.update(bar, total=sum(counts.values()),
                                completed=counts["done"] + counts["dead"] + counts["cancelled"],
                                dead=counts["dead"], leased=counts["leased"],
                                reduce=f" · reduce: {st.phase(counts)}" if st else "")
                return
            time.sleep(0.25)


def _summary(queue: Queue, batch_id: str, elapsed: float, n_workers: int, procs: list[_Proc],
             interrupted: bool, done_before: int, dsn_given: bool) -> int:
    found = batch_status.read(queue, batch_id, health=False)
    counts, reduce, gen = found.counts, found.reduce, found.generator
    stats = tasks.stats(queue.conn, batch_id, RESERVED_KEYS)
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
    if reduce is not None and reduce.configured:
        rows.insert(6, ("reduce", reduce.phase(counts)))
    if gen is not None and gen.configured:
        rows.insert(1, ("generator", gen.phase().lower()))
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    if counts["dead"]:
        dead = queue.list_dead(batch_id, limit=5)
        console.print("[red]dead tasks[/] (first 5; see `jobrunner dead list --batch "
                      f"{batch_id}`):")
        for row in dead:
            console.print(f"  {row['task_key']}: {(row['last_error'] or '')[:160]}")
    if total and counts["done"] == done_before == total and (
            reduce is None or not reduce.configured or reduce.reduced):
        console.print(f"batch {batch_id} was already complete: nothing to do. Run it again "
                      "under a new id with --batch NEW-ID.")
    generator_failed = gen is not None and gen.configured and not gen.finished
    if gen is not None and gen.configured:
        style = "green" if gen.finished else "red" if gen.failed else "yellow"
        console.print(f"[{style}]{gen.describe()}[/]", markup=True, highlight=False)
    failed, reduced = _reduce_report(queue, batch_id, reduce, counts)
    dsn_flag = " --dsn DSN" if dsn_given and not os.environ.get(db.DSN_ENV) else ""
    if reduced:
        console.print(f"the whole result:  [bold]jobrunner results --batch {batch_id} "
                      f"--reduce{dsn_flag}[/]", highlight=False)
    if counts["done"]:
        console.print(f"export everything: [bold]jobrunner results --batch {batch_id} "
                      f"--output results.jsonl{dsn_flag}[/]", highlight=False)
    if interrupted:
        return 130
    if found.still_running:
        return 1
    return 3 if counts["dead"] or failed or generator_failed else 0


def _reduce_report(queue: Queue, batch_id: str, reduce: reduce_step.ReduceState | None,
                   counts: dict[str, int]) -> tuple[bool, bool]:
    """The reduce's outcome, and the first lines of the batch's result; returns (the
    reduce failed, there is a result)."""
    if reduce is None or not reduce.configured:
        return False, False
    phase = reduce.phase(counts)
    style = {"done": "green", "failed": "red", "skipped": "red"}.get(phase, "yellow")
    console.print(f"reduce: [{style}]{reduce.describe(counts)}[/]", highlight=False)
    # (a preview of a huge result is not worth reading it whole: its size says enough)
    found = (reduce_step.batch_result(queue.conn, batch_id, max_bytes=1 << 20)
             if reduce.reduced else None)
    if found is None or not found.stored:
        return phase in ("failed", "skipped"), False
    if found.text is None:
        return False, True
    console.print(f"[bold]result of batch {batch_id}[/] (first lines):", highlight=False)
    for line in reduce_step.preview(found.value(), lines=10, width=console.width - 4):
        console.print(f"  {line}", markup=False, highlight=False)
    return False, True
