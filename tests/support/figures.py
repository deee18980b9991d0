"""Figure lines: what a test measured, for the CI log (collected in tests/conftest.py)."""

from __future__ import annotations

from typing import Any


def show(capsys: Any, line: str) -> None:
    """Print `line` past pytest's capture (seen at once without pytest-xdist) and attach it
    to the test's report, which the summary at the end of the run prints either way."""
    with capsys.disabled():
        print("\n" + line, flush=True)
    capsys.request.node.user_properties.append(("figure", line))
