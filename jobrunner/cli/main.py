"""The `jobrunner` command line. Other tools depend on these names: keep them stable."""

from __future__ import annotations

import json
import logging
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import psycopg
import typer
from rich.table import Table

from jobrunner.cli.batch_api import register as register_batch_api
from jobrunner.cli.flowcontrol import register as register_flow_control
from jobrunner.cli.metrics import register as register_metrics
from jobrunner.cli.options import BatchOpt, DsnOpt, _fail, _queue, app, dead_app, out
from jobrunner.cli.render import print_result_preview, top_errors_table
from jobrunner.cli.roles import register as register_roles
from jobrunner.cli.workerpools import register as register_pools
from jobrunner.model.errors import BadInput, JobrunnerError
from jobrunner.model.logs import setup_logging
from jobrunner.model.usage import BatchUsage
from jobrunner.observability import metrics, tracing
from jobrunner.queue.client import Queue
from jobrunner.store import db
from jobrunner.store.migrate import migrate as apply_migrations

app.add_typer(dead_app, name="dead")
register_flow_control(app)  # limit, usage, budget (jobrunner/cli/flowcontrol.py)
register_pools(app)  # pool set-weight, pool show (jobrunner/cli/workerpools.py)
register_batch_api(app)  # serve, api-key (jobrunner/cli/batch_api.py)
register_roles(app)  # db grant|login, tenant create|list (jobrunner/cli/roles.py)
register_metrics(app)  # metrics (jobrunner/cli/metrics.py)


class InputFormat(StrEnum):
    jsonl = "jsonl"
    openai_batch = "openai-batch"



@app.command()
def migrate(dsn: DsnOpt = None) -> None:
    """Apply pending schema migrations (safe to run concurrently)."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-migrate") as conn:
        applied = apply_migrations(conn)
    out.print(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied
                                                       else "; schema is up to date"))


@app.command()
def enqueue(
    file: Annotated[str, typer.Argument(help="JSON lines file, or - for standard input.")],
    batch: BatchOpt,
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant id.")],
    max_attempts: Annotated[int, typer.Option(min=1, max=1000,
                                              help="Default attempts per task.")] = 8,
    fmt: Annotated[InputFormat, typer.Option(
        "--format", help="jsonl, or openai-batch: the OpenAI Batch input format "
        "({custom_id, method, url, body} per line; key = custom_id).")
    ] = InputFormat.jsonl,
    pool: Annotated[str | None, typer.Option(
        "--pool", help="Worker pool the batch belongs to (set at its first enqueue): "
        "`jobrunner worker --pool` serves it, fair across tenants.")] = None,
    priority: Annotated[int, typer.Option(
        "--priority", min=-3, max=3, help="Pool batches: weight multiplier 10^priority "
        "(set at the batch's first enqueue).")] = 0,
    handler: Annotated[str | None, typer.Option(
        "--handler", help="Pool batches: the handler (module:function) its tasks run with, "
        "for pool workers that serve several (set at the batch's first enqueue that names "
        "one).")] = None,
    dsn: DsnOpt = None,
) -> None:
    """Enqueue tasks: one JSON object per line, {"key", "shard_key"?, "payload", "max_attempts"?}.

    Idempotent: keys already in the batch are left untouched. Nothing is written if any
    line is invalid.
    """
    from jobrunner.model.validation import parse_jsonl

    parse = parse_jsonl
    if fmt == InputFormat.openai_batch:
        from jobrunner.features.openai_batch import parse_input as parse
    if file == "-":
        tasks = parse(sys.stdin, "stdin")
    else:
        try:
            with open(file, encoding="utf-8") as handle:
                tasks = parse(handle, file)
        except OSError as exc:
            raise BadInput(f"cannot read {file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise BadInput(f"{file} is not UTF-8 text: {exc.reason}") from None
    q = _queue(dsn)
    result = q.enqueue(batch, tenant, tasks, max_attempts=max_attempts, pool=pool,
                       priority=priority, handler=handler)
    out.print(f"{result.new} new, {result.existing} already existed (batch {batch})")


@app.command()
def worker(
    batch: Annotated[str | None, typer.Option(
        "--batch", help="Batch id (or --pool).")] = None,
    pool: Annotated[str | None, typer.Option(
        "--pool", help="Serve every open batch of this worker pool, fair across tenants "
        "(instead of --batch).")] = None,
    handler: Annotated[list[str] | None, typer.Option(
        help="Python handler, module:function. With --pool, repeat it to serve several: "
        "each task runs with its batch's handler (recorded at enqueue).")] = None,
    handler_cmd: Annotated[str | None, typer.Option(
        "--handler-cmd", help="Shell command handler: payload on stdin; exit 0 done, 75 retry.")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, max=1000,
                                             help="Tasks run at once.")] = 1,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, max=1000,
                                            help="Tasks claimed per round trip.")] = 1,
    visibility_timeout: Annotated[float, typer.Option(
        "--visibility-timeout", min=1, max=7 * 86400, help="Lease length in seconds.")] = 600,
    heartbeat: Annotated[float | None, typer.Option(
        min=0.01, help="Lease renewal interval (default: a third of the lease).")] = None,
    backoff_base: Annotated[float, typer.Option("--backoff-base", min=0.001, max=3600,
                                                help="Retry delay base: base * 2^attempt s.")
                            ] = 1.0,
    backoff_cap: Annotated[float, typer.Option("--backoff-cap", min=0.001, max=7 * 86400,
                                               help="Longest retry delay in seconds.")] = 3600,
    worker_id: Annotated[str | None, typer.Option(
        "--worker-id", help="Owner name (default: $JOBRUNNER_WORKER_ID or host-pid); a "
        "random suffix is always added.")] = None,
    exit_when_drained: Annotated[bool, typer.Option(
        "--exit-when-drained", help="Exit 0 once nothing is pending or leased.")] = False,
    grace_period: Annotated[float, typer.Option("--grace-period", min=0, max=86400,
                                                help="SIGTERM: seconds to finish tasks.")] = 30,
    listen: Annotated[bool, typer.Option(help="LISTEN for enqueue notifications.")] = True,
    listen_dsn: Annotated[str | None, typer.Option(
        "--listen-dsn", envvar="JOBRUNNER_LISTEN_DATABASE_URL",
        help="A direct PostgreSQL DSN for the process's LISTEN connection and maintenance "
             "election, for workers whose --dsn goes through PgBouncer in transaction mode "
             "(default: --dsn, unless JOBRUNNER_TRANSACTION_POOLING=1).",
        show_envvar=False)] = None,
    poll_interval: Annotated[float, typer.Option(
        "--poll-interval", min=0.01, max=3600,
        help="Longest idle sleep between polls (jitter down to 40 %% of it).")] = 0.5,
    max_tasks: Annotated[int | None, typer.Option("--max-tasks", min=1, hidden=True)] = None,
    lost_lease_grace: Annotated[float, typer.Option(
        "--lost-lease-grace", min=0, max=3600,
        help="Seconds a sync handler may ignore the loss of its lease before the worker exits "
             "(code 70) to get rid of it.")] = 10,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: Annotated[str, typer.Option("--log-format", help="text or json")] = "text",
    metrics_port: Annotated[int, typer.Option(
        "--metrics-port", envvar="JOBRUNNER_METRICS_PORT", min=0, max=65535,
        help="Serve Prometheus metrics at this port's /metrics (0: none; "
             "docs/observability.md).", show_envvar=False)] = 0,
    dsn: DsnOpt = None,
) -> None:
    """Claim and run tasks of one batch, or of every batch of a pool, until stopped (or
    drained)."""
    from jobrunner.features.reduce import check_batch as check_reduce
    from jobrunner.runtime.taskhandlers import make_handler
    from jobrunner.worker.config import WorkerConfig, default_worker_id
    from jobrunner.worker.process import run_worker

    setup_logging(log_level, log_format)
    if (batch is None) == (pool is None):
        raise BadInput("give exactly one of --batch and --pool")
    if pool is not None:
        from jobrunner.model.workerpools import check_pool
        check_pool(pool)
    dsn_value = db.resolve_dsn(dsn)
    handlers = list(dict.fromkeys(handler or []))
    if len(handlers) > 1 and pool is None:
        raise BadInput("several --handler options need --pool (a batch's workers run one)")
    if pool is not None and handlers and not handler_cmd:
        from jobrunner.runtime.taskhandlers import PythonHandler
        from jobrunner.worker.batch_handlers import PoolHandlers

        run_task: Any = PoolHandlers({h: PythonHandler(h) for h in handlers}, dsn_value)
    else:
        run_task = make_handler(handlers[0] if handlers else None, handler_cmd)
    config = WorkerConfig(
        dsn=dsn_value, batch_id=batch, pool=pool, handler=run_task,
        worker_id=default_worker_id(worker_id), concurrency=concurrency,
        batch_size=batch_size, visibility_timeout=visibility_timeout,
        heartbeat_interval=heartbeat, backoff_base=backoff_base, backoff_cap=backoff_cap,
        exit_when_drained=exit_when_drained, grace_period=grace_period, listen=listen,
        listen_dsn=listen_dsn,
        max_tasks=max_tasks, lost_lease_grace=lost_lease_grace,
        idle_poll=(poll_interval * 0.4, poll_interval))
    def check_batch() -> None:
        with db.connect(dsn_value, purpose="jobrunner-worker") as conn:
            if batch is not None:
                Queue(conn).batch(batch)  # unknown batch: a clear error before any thread starts
                check_reduce(conn, batch)  # so is a reduce step that does not load

    # A worker started while the server restarts, or while PgBouncer refuses logins after
    # one (server_login_retry), waits for it as its claim loop would, for a while, instead
    # of exiting; a DSN that never works still fails with its error.
    db.retrying(check_batch, attempts=8)
    try:
        metrics.serve(metrics_port)
    except OSError as exc:  # (a port taken, e.g. two hostNetwork pods on a node): work anyway
        logging.getLogger("jobrunner.worker").warning(
            "metrics: port %d could not be opened (%s); this worker serves none",
            metrics_port, exc)
    code = run_worker(config)
    tracing.shutdown()  # (os._exit runs no atexit hook: the last spans are sent here)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # A handler thread that ignored its lost lease cannot be joined: leave without it.
    os._exit(code)


@app.command()
def status(batch: BatchOpt,
           as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")
                              ] = False,
           dsn: DsnOpt = None) -> None:
    """Counts per status, oldest pending age, stuck leases, the most frequent errors, and
    the reduce step with the batch's result."""
    from jobrunner.features import generators
    from jobrunner.features import status as batch_status
    from jobrunner.features.reduce import STATUS_RESULT_BYTES, batch_result
    from jobrunner.local.runner import existing_database

    with existing_database(dsn) as url:
        q = _queue(url)
        q.batch(batch)
        found = batch_status.read(q, batch)
        counts, health = found.counts, found.health or {}
        reduce, gen = found.reduce, found.generator
        top = batch_status.top_errors(q, batch) if found.has_errors else []
        used = q.usage(batch, by_status=False)  # tokens and cost (jobrunner/store/flowcontrol.py)
        result = batch_result(q.conn, batch, STATUS_RESULT_BYTES) if reduce and (
            reduce.reduced) else None
        q.conn.close()
    if as_json:
        step = reduce.as_json(counts) if reduce else None
        if step is not None:
            # (as small as a BatchRun's status: a larger one with `results --reduce`)
            step["result"] = result.value() if result and result.text is not None else None
        print(json.dumps({**counts, "total": sum(counts.values()), **health,
                          "top_errors": [group.as_json() for group in top],
                          "tokens": used.tokens, "cost": float(used.cost),
                          "budget": {"tokens": used.budget_tokens,
                                     "cost": None if used.budget_cost is None
                                     else float(used.budget_cost)},
                          "budget_exhausted": used.exhausted, "reduce": step,
                          "generator": generators.status_json(gen)}))
        return
    table = Table(title=f"batch {batch}", show_header=True)
    for name in ("pending", "leased", "done", "dead", "cancelled", "total"):
        table.add_column(name, justify="right")
    table.add_row(*[str(counts[s]) for s in counts], str(sum(counts.values())))
    out.print(table)
    oldest = health["oldest_pending_seconds"]
    out.print(f"oldest pending: {'-' if oldest is None else f'{oldest:.1f}s'}   "
              f"stuck leases: {health['stuck']}   tokens: {used.tokens:,}   cost: {used.cost:g}"
              + _budget_text(used))
    if top:
        out.print(top_errors_table(top))
    if gen is not None and gen.configured:
        out.print(gen.describe(), markup=False, highlight=False)
    if reduce is not None and reduce.configured:
        out.print(f"reduce: {reduce.describe(counts)}", markup=False, highlight=False)
        if result is not None and result.stored:
            print_result_preview(batch, result)


@dead_app.command("list")
def dead_list(batch: BatchOpt,
              as_json: Annotated[bool, typer.Option("--json")] = False,
              dsn: DsnOpt = None) -> None:
    """List dead tasks with their last error."""
    rows = _queue(dsn).list_dead(batch)
    if as_json:
        print(json.dumps([{**r, "finished_at": r["finished_at"] and r["finished_at"].isoformat()}
                          for r in rows]))
        return
    table = Table(title=f"dead tasks in {batch}")
    for col in ("key", "shard", "attempts", "last error"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["task_key"], r["shard_key"] or "", f"{r['attempts']}/{r['max_attempts']}",
                      (r["last_error"] or "")[:200])
    out.print(table)


@dead_app.command("requeue")
def dead_requeue(batch: BatchOpt,
                 key: Annotated[list[str] | None, typer.Option(
                     "--key", help="Only these task keys (repeatable).")] = None,
                 dsn: DsnOpt = None) -> None:
    """Send dead tasks back to pending with fresh attempts."""
    count = _queue(dsn).requeue_dead(batch, key)
    out.print(f"requeued {count} dead task(s) in batch {batch}")


@app.command()
def cancel(batch: BatchOpt, dsn: DsnOpt = None) -> None:
    """Cancel a batch: its pending tasks become cancelled; running ones finish."""
    count = _queue(dsn).cancel(batch)
    out.print(f"cancelled {count} pending task(s) in batch {batch}")


@app.command()
def expire(dsn: DsnOpt = None) -> None:
    """Rescue expired leases now (workers do this on their own every second)."""
    rows = _queue(dsn).expire(limit=100000)
    out.print(f"rescued {len(rows)} expired lease(s)")


@app.command()
def retention(
    older_than_days: Annotated[float, typer.Option("--older-than-days", min=0)],
    include_dead: Annotated[bool, typer.Option("--include-dead")] = False,
    archive: Annotated[bool, typer.Option(
        "--archive", help="Copy rows to agent_work_queue_archive before deleting.")] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, max=100000)] = 1000,
    dsn: DsnOpt = None,
) -> None:
    """Delete finished tasks older than N days, in small batches (keeps the hot table small)."""
    count = _queue(dsn).retention(older_than_days * 86400, include_dead=include_dead,
                                  archive=archive, batch_size=batch_size)
    out.print(f"{'archived and deleted' if archive else 'deleted'} {count} finished task(s)")


@app.command()
def run(
    manifest: Annotated[Path, typer.Argument(help="BatchRun manifest (YAML).")],
    workers: Annotated[int | None, typer.Option(
        min=1, max=256, help="Worker processes (default: spec.workers).")] = None,
    batch: Annotated[str | None, typer.Option(
        "--batch", help="Batch id (default: spec.batchId or local/<name>).")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="Embedded PostgreSQL data directory.")] = None,
    console: Annotated[bool, typer.Option(
        "--console", help="Serve the web console while the run lasts and print its "
        "address (docs/console.md).")] = False,
    console_port: Annotated[int, typer.Option(
        min=0, max=65535, help="The console's port on 127.0.0.1 (0: a free one).")] = 0,
    dsn: DsnOpt = None,
) -> None:
    """Run a whole BatchRun locally: embedded PostgreSQL (unless --dsn), workers, progress."""
    from jobrunner.cli.batch_api import console_beside_run
    from jobrunner.local.runner import run_local

    beside = (lambda found: console_beside_run(found, console_port)) if console else None
    raise typer.Exit(run_local(manifest, workers=workers, batch=batch, data_dir=data_dir,
                               dsn=dsn or os.environ.get(db.DSN_ENV), beside=beside))




def main() -> None:
    # Traces, if the OTEL_* environment asks for them (docs/observability.md).
    tracing.configure("jobrunner")
    try:
        app(standalone_mode=True, prog_name="jobrunner")
    except BadInput as exc:
        _fail(str(exc), 2)
    except JobrunnerError as exc:
        _fail(str(exc), 1)
    except psycopg.errors.UndefinedTable as exc:
        # A database jobrunner never migrated (or an older schema): say what to run
        # instead of a traceback.
        _fail(f"the database has no jobrunner schema ({exc.diag.message_primary}): run "
              "`jobrunner migrate --dsn ...` first (the controller and `jobrunner run` "
              "do it themselves)", 1)
    except psycopg.errors.InsufficientPrivilege as exc:
        # A component's role doing what it was not granted (docs/security.md).
        _fail(f"permission denied: {exc.diag.message_primary} (this command needs a role "
              "that may do it: see docs/security.md, \"Who can do what\")", 1)


if __name__ == "__main__":
    main()


def _budget_text(used: BatchUsage) -> str:
    """The budget beside the usage, when the batch has one."""
    parts = ([f"{used.budget_tokens:,} tokens"] if used.budget_tokens is not None else []) + (
        [f"cost {used.budget_cost:g}"] if used.budget_cost is not None else [])
    if not parts:
        return ""
    return f"   budget: {', '.join(parts)}" + (" (exhausted)" if used.exhausted else "")
