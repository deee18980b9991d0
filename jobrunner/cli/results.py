"""`jobrunner results` and the top errors of `jobrunner status` (registered by cli.py)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, TextIO

import psycopg
import typer

from jobrunner.cli.options import BatchOpt, DsnOpt, app, err
from jobrunner.cli.render import print_result_preview, top_errors_table  # noqa: F401
from jobrunner.features.reduce import batch_result
from jobrunner.features.reduce import state as reduce_state
from jobrunner.features.results import export
from jobrunner.model.errors import BadInput, JobrunnerError, UnknownBatch
from jobrunner.queue.client import Queue
from jobrunner.store import db

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
    reduce: Annotated[bool, typer.Option(
        "--reduce", help="The batch's result (its reduce step's return value) instead: "
        "text as it is, anything else as JSON.")] = False,
    dsn: DsnOpt = None,
) -> None:
    """Stream a batch's results (done tasks), or its errors, keyed by task key."""
    if reduce and (errors or fmt != ExportFormat.jsonl):
        raise BadInput("--reduce writes the batch's result as it is: without --errors "
                       "or --format")
    # (imported here: the local runner and its embedded server are not a worker's imports)
    from jobrunner.local.runner import existing_database

    with existing_database(dsn) as url, db.connect(url, purpose="jobrunner-results") as conn:
        try:
            with _destination(output) as out:
                if reduce:
                    count = _write_batch_result(conn, batch, out)
                else:
                    count = export(conn, batch, out, fmt=fmt.value, errors=errors)
        except BrokenPipeError:
            # The reader went away (`jobrunner results ... | head`): not an error.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
    if output is not None:
        what = ("the result (bytes)" if reduce else "error(s)" if errors else "result(s)")
        err.print(f"wrote {count} {what} of batch {batch} to {output}", markup=False,
                  highlight=False)


def _write_batch_result(conn: psycopg.Connection, batch: str, out: TextIO) -> int:
    """The batch's result; an error (exit 1, nothing written) while there is none."""
    found = batch_result(conn, batch)
    if found is None:
        raise UnknownBatch(batch)
    if not found.stored or found.text is None:
        st = reduce_state(conn, batch)
        why = st.describe(Queue(conn).counts(batch)) if st else "no reduce step"
        raise JobrunnerError(f"batch {batch} has no result: reduce {why}")
    value = json.loads(found.text) if found.text.startswith('"') else None
    text = value if isinstance(value, str) else found.text
    out.write(text if text.endswith("\n") else text + "\n")
    return found.size or 0



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


