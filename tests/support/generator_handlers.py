"""Generators for the tests (tests/test_generators.py, tests/e2e/test_sources_e2e.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from jobrunner import Task

# A file the generator appends its pid to at each start (tests that kill it find it there).
PID_FILE_ENV = "JOBRUNNER_TEST_GENERATOR_PIDS"


def count(task: Task, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """args.count cheap tasks t000000.., pausing args.pause seconds every args.every
    tasks (so a test can catch it mid-way)."""
    pids = os.environ.get(PID_FILE_ENV)
    if pids:
        with open(pids, "a") as f:
            f.write(f"{os.getpid()} {task.attempt}\n")
    n, every, pause = int(args["count"]), int(args.get("every") or 0), float(
        args.get("pause") or 0)
    for i in range(n):
        if every and i and i % every == 0:
            time.sleep(pause)
        yield {"key": f"t{i:06d}", "payload": {}}


def boom(task: Task, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yields args.before tasks, then raises."""
    for i in range(int(args.get("before") or 0)):
        yield {"key": f"b{i:03d}", "payload": {"i": i}}
    raise RuntimeError(f"the ticket source is unreachable (attempt {task.attempt})")


def bad_item(task: Task, args: dict[str, Any]) -> Iterator[Any]:
    yield {"key": "ok", "payload": {}}
    yield {"key": "bad", "payload": "not an object"}


def one_arg(args: dict[str, Any]) -> Iterator[dict[str, Any]]:  # (refused: takes one argument)
    yield {"key": "x"}
