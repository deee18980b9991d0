"""The `jobrunner` command: one module per command family, all on one Typer app.

The order of the imports is the order of `jobrunner --help`."""

from jobrunner.cli.main import main

# isort: split
from jobrunner.cli import results  # noqa: F401  (registers `results` and `usage` after main's)

__all__ = ["main"]
