"""Handlers of the metrics tests (tests/test_dashboard.py): work that takes a moment and
reports usage, with the payload asking for a retry, a dead end or a rate-limited answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from jobrunner import PermanentError, RateLimited, Task

_throttled: set[str] = set()  # (one worker process serves the batch that asks for it)


def work(task: Task) -> dict[str, Any]:
    p = task.payload
    time.sleep(float(p.get("sleep", 0.3)))
    if p.get("rate_limited") and task.key not in _throttled:
        _throttled.add(task.key)
        raise RateLimited(retry_after=2, limit="llm")
    if p.get("poison"):
        raise PermanentError("this ticket cannot be graded")
    if p.get("fail_once") and task.attempt == 1:
        raise RuntimeError("the model's answer did not parse")
    task.report_usage(input_tokens=100 + len(task.key), output_tokens=20, cost="0.0012")
    return {"graded": task.key}


def rows(task: Task, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A generator: args.count tasks, a pause every 5 so that it is seen running."""
    for i in range(int(args["count"])):
        if i and i % 5 == 0:
            time.sleep(0.5)
        yield {"key": f"row{i:04d}", "payload": {"sleep": 0.4}}


def count(task: Task, results: Iterator[dict[str, Any]]) -> int:
    """A reduce step."""
    time.sleep(0.5)
    return sum(1 for _ in results)
