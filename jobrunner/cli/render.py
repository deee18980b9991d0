"""Tables and previews the commands print."""

from __future__ import annotations

from rich.table import Table

from jobrunner.cli.options import out as console
from jobrunner.features.reduce import BatchResult, preview
from jobrunner.features.results import ErrorGroup


def print_result_preview(batch: str, result: BatchResult, lines: int = 8) -> None:
    """The first lines of a batch's result (a larger one than a status holds: where)."""
    if result.text is None:
        console.print(f"  result: {result.size:,} bytes; the whole of it: jobrunner "
                      f"results --batch {batch} --reduce", markup=False, highlight=False)
        return
    for line in preview(result.value(), lines):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  (the whole result: jobrunner results --batch {batch} --reduce)",
                  markup=False, highlight=False, style="dim")


def top_errors_table(groups: list[ErrorGroup]) -> Table:
    table = Table(title="most frequent errors of dead tasks", title_justify="left")
    table.add_column("count", justify="right")
    table.add_column("example key")
    table.add_column("error")
    for group in groups:
        table.add_row(str(group.count), group.example_key, group.message)
    return table
