"""`jobrunner pool`: a worker pool's tenants and their weights (docs/pools.md).

Other tools depend on these names: keep them stable. Registered on the main app by
`register(app)` (jobrunner/cli/main.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from jobrunner.store import db
from jobrunner.store import workerpools as pools

pool_app = typer.Typer(no_args_is_help=True,
                       help="Worker pools: tenants' weights and their share of the work.")
out = Console()

DsnOpt = Annotated[str | None, typer.Option(
    "--dsn", help="PostgreSQL connection string (default: $JOBRUNNER_DATABASE_URL).",
    show_default=False)]


@pool_app.command("set-weight")
def set_weight(
    pool: Annotated[str, typer.Argument(help="Pool name.")],
    tenant: Annotated[str, typer.Argument(help="Tenant id.")],
    weight: Annotated[float, typer.Argument(help="Its weight (default of every tenant: 1).")],
    dsn: DsnOpt = None,
) -> None:
    """Set a tenant's weight in a pool; its pending tasks follow from the next claim."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli") as conn:
        streams = pools.set_weight(conn, pool, tenant, weight)
    out.print(f"pool {pool}: tenant {tenant} weight {weight:g} ({streams} stream(s) re-laid)",
              highlight=False)


@pool_app.command("show")
def show(
    pool: Annotated[str, typer.Argument(help="Pool name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    dsn: DsnOpt = None,
) -> None:
    """A pool's tenants: weight, batches, pending and leased tasks."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli") as conn:
        shares = pools.show(conn, pool)
    if as_json:
        print(json.dumps([asdict(s) for s in shares]))
        return
    table = Table("tenant", "weight", "batches", "pending", "leased")
    for s in shares:
        table.add_row(s.tenant_id, f"{s.weight:g}", str(s.batches), str(s.pending),
                      str(s.leased))
    out.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(pool_app, name="pool")
