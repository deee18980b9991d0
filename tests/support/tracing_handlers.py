"""Handlers of the trace tests (tests/test_tracing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

from jobrunner.runtime.task import Task


def count(task: Task, results: Iterator[dict[str, Any]]) -> int:
    """A reduce step whose own span (an API tracer, as a user's code would use) must nest
    under its attempt's `process` span."""
    with trace.get_tracer("tests.tracing").start_as_current_span("count results") as span:
        n = sum(1 for _ in results)
        span.set_attribute("results", n)
    return n
