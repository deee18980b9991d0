"""What every command shares: the Typer apps, the consoles, the common options and
the error exit."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from jobrunner.queue.client import Queue
from jobrunner.store import db

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run batches of agent tasks from a PostgreSQL lease queue.")


dead_app = typer.Typer(no_args_is_help=True, help="Inspect and requeue dead tasks.")


err = Console(stderr=True)


out = Console()


DsnOpt = Annotated[str | None, typer.Option(
    "--dsn", help="PostgreSQL connection string (default: $JOBRUNNER_DATABASE_URL).",
    show_default=False)]


BatchOpt = Annotated[str, typer.Option("--batch", help="Batch id.")]


def _fail(message: str, code: int) -> None:
    err.print("[bold red]error:[/] ", end="", highlight=False)
    err.print(message, markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def _queue(dsn: str | None) -> Queue:
    return Queue(db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli"))
