"""`jobrunner results` and the top errors of `jobrunner status` (registered by cli.py)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.table import Table

from . import db
from .cli import BatchOpt, DsnOpt, app, err
from .errors import BadInput
from .results import ErrorGroup, export

_BUFFER = 1 << 20  # written in large blocks: a million small writes cost more than the export


class ExportFormat(StrEnum):
    jsonl = "jsonl"
    csv = "csv"
    openai = "openai"


@app.command()
def results(
    batch: BatchOpt,
    errors: Annotated[bool, typer.Option(
        "--errors", help="The dead and cancelled tasks with their last error, instead of "
        "the results.")] = False,
    fmt: Annotated[ExportFormat, typer.Option(
        "--format", help="jsonl: {key, status, result, attempts, finished_at} per line; csv; "
        "openai: the OpenAI Batch output file (with --errors, its error file).")
    ] = ExportFormat.jsonl,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write here (replaced only once the export is complete) "
        "instead of standard output.")] = None,
    dsn: DsnOpt = None,
) -> None:
    """Stream a batch's results (done tasks), or its errors, keyed by task key."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-results") as conn:
        try:
            with _destination(output) as out:
                count = export(conn, batch, out, fmt=fmt.value, errors=errors)
        except BrokenPipeError:
            # The reader went away (`jobrunner results ... | head`): not an error.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
    if output is not None:
        what = "error(s)" if errors else "result(s)"
        err.print(f"wrote {count} {what} of batch {batch} to {output}", markup=False,
                  highlight=False)


@contextlib.contextmanager
def _destination(output: Path | None) -> Iterator[TextIO]:
    """Standard output, or the file: a regular file is written beside it and renamed
    over it at the end, so a failed export never leaves half a file behind; anything
    else (/dev/null, a pipe) is written directly."""
    if output is None:
        sys.stdout.flush()
        with open(sys.stdout.fileno(), "w", encoding="utf-8", newline="\n",
                  buffering=_BUFFER, closefd=False) as stream:
            yield stream
        return
    try:
        special = output.exists() and not stat.S_ISREG(output.stat().st_mode)
    except OSError as exc:
        raise BadInput(f"cannot write {output}: {exc.strerror}") from None
    target = output if special else output.with_name(f".{output.name}.{os.getpid()}.partial")
    try:
        handle = open(target, "w", encoding="utf-8", newline="\n", buffering=_BUFFER)  # noqa: SIM115
    except OSError as exc:
        raise BadInput(f"cannot write {output}: {exc.strerror}") from None
    try:
        with handle:
            yield handle
        if not special:
            os.replace(target, output)
    finally:
        if not special:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)


def top_errors_table(groups: list[ErrorGroup]) -> Table:
    table = Table(title="most frequent errors of dead tasks", title_justify="left")
    table.add_column("count", justify="right")
    table.add_column("example key")
    table.add_column("error")
    for group in groups:
        table.add_row(str(group.count), group.example_key, group.message)
    return table
