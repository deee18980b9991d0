"""`jobrunner limit|usage|budget`: flow control from the command line (docs/flow-control.md).

Other tools depend on these names: keep them stable. Registered on the main app by
`register(app)` (jobrunner/cli/main.py); errors are BadInput (exit 2) or JobrunnerError
(exit 1), reported by cli.main like every other command's.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from jobrunner.model.errors import BadInput
from jobrunner.queue.client import Queue
from jobrunner.store import db
from jobrunner.store import flowcontrol as flow

limit_app = typer.Typer(no_args_is_help=True,
                        help="Flow-control limits shared by every worker (rates, concurrency).")
budget_app = typer.Typer(no_args_is_help=True,
                         help="A budget of tokens and cost: a batch's, or a tenant's in a pool.")

out = Console()

DsnOpt = Annotated[str | None, typer.Option(
    "--dsn", help="PostgreSQL connection string (default: $JOBRUNNER_DATABASE_URL).",
    show_default=False)]
BatchOpt = Annotated[str, typer.Option("--batch", help="Batch id.")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _queue(dsn: str | None) -> Queue:
    return Queue(db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli"))


@limit_app.command("set")
def limit_set(
    name: Annotated[str, typer.Argument(help="Limit name (tasks name it in \"limits\").")],
    requests: Annotated[int | None, typer.Option(
        help="Requests (claims of tasks naming it) per --per seconds.")] = None,
    tokens: Annotated[int | None, typer.Option(
        help="Tokens (estimates, corrected by reported usage) per --per seconds.")] = None,
    per: Annotated[float | None, typer.Option(
        help="The period of --requests and --tokens, in seconds (default 60).")] = None,
    max_concurrent: Annotated[int | None, typer.Option(
        "--max-concurrent", help="Live leases of tasks naming it, at once.")] = None,
    dsn: DsnOpt = None,
) -> None:
    """Create a limit, or change the given fields of an existing one."""
    q = _queue(dsn)
    created = flow.set_limit(q.conn, name, requests=requests, tokens=tokens, per=per,
                             max_concurrent=max_concurrent)
    (status,) = flow.list_limits(q.conn, [name])
    out.print(f"{'created' if created else 'updated'} limit {name}: {_describe(status)}",
              highlight=False)


def _describe(s: flow.LimitStatus) -> str:
    parts = []
    if s.requests is not None:
        parts.append(f"{s.requests} requests")
    if s.tokens is not None:
        parts.append(f"{s.tokens} tokens")
    text = " and ".join(parts)
    if text:
        text += f" per {s.per_seconds:g}s"
    if s.max_concurrent is not None:
        text += (", " if text else "") + f"at most {s.max_concurrent} at once"
    return text


@limit_app.command("list")
def limit_list(as_json: AsJson = False, dsn: DsnOpt = None) -> None:
    """Limits and their current use."""
    rows = flow.list_limits(_queue(dsn).conn)
    if as_json:
        print(json.dumps([r.as_dict() for r in rows]))
        return
    table = Table(title="limits")
    for col in ("name", "requests", "tokens", "per", "max concurrent", "in flight",
                "requests used", "tokens used", "blocked for"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for r in rows:
        table.add_row(r.name, _opt(r.requests), _opt(r.tokens), f"{r.per_seconds:g}s",
                      _opt(r.max_concurrent), str(r.in_flight), _opt(r.requests_used),
                      _opt(r.tokens_used),
                      f"{r.blocked_for_seconds:.1f}s" if r.blocked_for_seconds else "-")
    out.print(table)


def _opt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


@limit_app.command("delete")
def limit_delete(name: Annotated[str, typer.Argument(help="Limit name.")],
                 dsn: DsnOpt = None) -> None:
    """Delete a limit (refused while pending or leased tasks name it)."""
    flow.delete_limit(_queue(dsn).conn, name)
    out.print(f"deleted limit {name}", highlight=False)


def usage(batch: BatchOpt, as_json: AsJson = False, dsn: DsnOpt = None) -> None:
    """Tokens and cost a batch used (every attempt, failed ones included), by status and
    in total, and its budget."""
    q = _queue(dsn)
    q.batch(batch)  # unknown batch: a clear error
    u = q.usage(batch)
    if as_json:
        data = u.as_dict()
        data["total"] = {k: data.pop(k) for k in ("tokens", "input_tokens", "output_tokens",
                                                   "cost")}
        data["budget"] = {"tokens": data.pop("budget_tokens"), "cost": data.pop("budget_cost")}
        print(json.dumps(data))
        return
    table = Table(title=f"usage of batch {batch}")
    for col in ("status", "tasks", "attempts", "tokens", "input", "output", "cost"):
        table.add_column(col, justify="left" if col == "status" else "right")
    for status, g in u.by_status.items():
        table.add_row(status, str(g["tasks"]), str(g["attempts"]), f"{g['tokens']:,}",
                      f"{g['input_tokens']:,}", f"{g['output_tokens']:,}", f"{g['cost']:g}")
    table.add_row("total", "", "", f"{u.tokens:,}", f"{u.input_tokens:,}",
                  f"{u.output_tokens:,}", f"{u.cost:g}", style="bold")
    out.print(table)
    if u.budget_tokens is not None or u.budget_cost is not None:
        budget = ", ".join(part for part in (
            f"{u.budget_tokens:,} tokens" if u.budget_tokens is not None else "",
            f"cost {u.budget_cost:g}" if u.budget_cost is not None else "") if part)
        out.print(f"budget: {budget}"
                  + ("  [bold red]exhausted: claims stopped[/]" if u.exhausted else ""))


@budget_app.command("set")
def budget_set(
    batch: Annotated[str | None, typer.Option("--batch", help="Batch id.")] = None,
    pool: Annotated[str | None, typer.Option(
        help="Worker pool: with --tenant, a budget over every batch of the tenant in the "
             "pool (the Batch API's batches of a tenant, for one).")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant (with --pool).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Token budget.")] = None,
    cost: Annotated[str | None, typer.Option(help="Cost budget.")] = None,
    dsn: DsnOpt = None,
) -> None:
    """Set or raise a batch's budget, or a tenant's over all its batches in a pool; their
    claims stop while the usage is at or over it (raising the budget resumes them)."""
    if tokens is None and cost is None:
        raise BadInput("give --tokens and/or --cost")
    if (batch is None) == (pool is None and tenant is None):
        raise BadInput("give either --batch, or --pool and --tenant")
    q = _queue(dsn)
    if batch is None:
        if pool is None or tenant is None:
            raise BadInput("a tenant's budget needs both --pool and --tenant")
        q.set_tenant_budget(pool, tenant, tokens=tokens, cost=cost)
        t = q.tenant_usage(pool, tenant)
        out.print(f"tenant {tenant} in pool {pool}: budget tokens {_opt(t.budget_tokens)}, "
                  f"cost {'-' if t.budget_cost is None else f'{t.budget_cost:g}'}; used "
                  f"{t.tokens:,} tokens, cost {t.cost:g}" + ("; exhausted" if t.exhausted else ""),
                  highlight=False)
        return
    q.batch(batch)
    q.set_budget(batch, tokens=tokens, cost=cost)
    u = q.usage(batch, by_status=False)
    out.print(f"batch {batch}: budget tokens {_opt(u.budget_tokens)}, cost "
              f"{'-' if u.budget_cost is None else f'{u.budget_cost:g}'}; used {u.tokens:,} "
              f"tokens, cost {u.cost:g}" + ("; exhausted" if u.exhausted else ""),
              highlight=False)


def register(app: typer.Typer) -> None:
    """Add `limit`, `usage` and `budget` to the main command line."""
    app.add_typer(limit_app, name="limit")
    app.add_typer(budget_app, name="budget")
    app.command("usage")(usage)
