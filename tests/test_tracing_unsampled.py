"""An attempt's span at low sampling (jobrunner/observability/tracing.py, issue 32's cost).

At 1 % sampling 99 % of the attempts are not sampled, and whatever tracing does for them
is paid on every task: an unsampled attempt is the sampler's decision and a non-recording
span made current (so that the handler's own spans and calls inherit the decision), and
nothing more: no parse of its enqueue's stored context, no attributes, no event, no
context variable. A sampled one gets all of it, and its link needs no statement: the
claim returned the stored context with the lease. An in-memory exporter and the SDK's own
samplers; the last test claims from a real PostgreSQL and runs the attempt as a worker.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from psycopg.rows import dict_row

from jobrunner.model.types import Lease
from jobrunner.model.validation import TaskSpec
from jobrunner.observability import tracing
from jobrunner.queue.client import Queue
from jobrunner.runtime.effects import Effects
from jobrunner.runtime.task import Task
from jobrunner.store import flowcontrol
from jobrunner.worker.executor import Executor

STORED = ('{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",'
          ' "baggage": "team=search"}')


def lease(task_id: int = 7, trace_context: str | None = STORED) -> Lease:
    now = datetime.now(UTC)
    return Lease(id=task_id, batch_id="b", key=f"k{task_id}", tenant_id="acme",
                 shard_key="s1", payload={}, attempt=1, max_attempts=3,
                 locked_until=now + timedelta(minutes=10), run_after=now - timedelta(seconds=2),
                 trace_context=trace_context)


@pytest.fixture
def traced():
    """tracing.use() a provider with `sampler`; its finished spans."""
    used: list[TracerProvider] = []

    def use(sampler) -> InMemorySpanExporter:
        exported = InMemorySpanExporter()
        provider = TracerProvider(sampler=sampler)
        provider.add_span_processor(SimpleSpanProcessor(exported))
        tracing.use(provider)
        used.append(provider)
        return exported

    yield use
    tracing.use(None)
    for provider in used:
        provider.shutdown()


def test_an_unsampled_attempt_parses_nothing_and_records_nothing(traced):
    exported = traced(ParentBased(ALWAYS_OFF))
    calls: list[str] = []

    def count(frame, event, _arg) -> None:
        if event == "call" and "jobrunner" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        attempt = tracing.start_attempt(lease())
        current = trace.get_current_span()
        tracing.end_attempt(attempt, "done")
        tracing.finish_attempt(attempt)
    finally:
        sys.setprofile(None)
    # jobrunner's own code on the path: the two calls, the sampler's attributes, the state
    # (not _extract: its stored context is not parsed)
    assert sorted(calls) == ["__init__", "_for_sampler", "end_attempt", "finish_attempt",
                             "start_attempt"], calls
    assert not attempt.recording and current is attempt.span
    ctx = current.get_span_context()
    assert ctx.is_valid and not ctx.trace_flags.sampled
    assert trace.get_current_span() is trace.INVALID_SPAN  # the context before it again
    assert exported.get_finished_spans() == ()


class DropAttempts(Sampler):
    """Samples every root span but the attempts' (as a ratio sampler may, by chance)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                      links=None, trace_state=None) -> SamplingResult:
        return SamplingResult(Decision.DROP if name == "process" else
                              Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return "DropAttempts"


def test_the_handler_inherits_an_unsampled_attempts_decision(traced):
    """Its spans are not sampled as roots of traces of their own, and its calls pass the
    decision on (a traceparent with the sampled flag off)."""
    exported = traced(ParentBased(DropAttempts()))
    attempt = tracing.start_attempt(lease(trace_context=None))
    try:
        child = tracing.tracer().start_span("http call")
        child.end()
        headers = tracing.headers()
    finally:
        tracing.finish_attempt(attempt)
    assert not attempt.recording and not child.is_recording()
    ctx = attempt.span.get_span_context()
    traceparent, flags = headers["traceparent"].rsplit("-", 1)
    assert traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"
    assert int(flags, 16) & 1 == 0  # (not sampled; 02 is the SDK's random trace id flag)
    assert exported.get_finished_spans() == ()
    # (the sampler does sample a root of another name)
    tracing.tracer().start_span("http call").end()
    assert len(exported.get_finished_spans()) == 1


def test_a_sampled_attempt_records_it_all(traced):
    exported = traced(ParentBased(ALWAYS_ON))
    attempt = tracing.start_attempt(lease())
    try:
        assert trace.get_current_span() is attempt.span and attempt.recording
        tracing.record_usage(10, 4, 6, 0.25)
        tracing.end_attempt(attempt, "retry", "boom")
    finally:
        tracing.finish_attempt(attempt)
    assert trace.get_current_span() is trace.INVALID_SPAN
    (span,) = exported.get_finished_spans()
    assert span.kind == trace.SpanKind.CONSUMER and span.parent is None
    assert dict(span.attributes) == {
        "messaging.system": "jobrunner", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": "b",
        "messaging.message.id": "7", "messaging.consumer.group.name": "b",
        "jobrunner.batch": "b", "jobrunner.task.key": "k7", "jobrunner.tenant": "acme",
        "jobrunner.attempt": 1, "jobrunner.max_attempts": 3, "jobrunner.shard": "s1",
        "jobrunner.outcome": "retry", "error.type": "retry",
        "jobrunner.usage.tokens": 10, "jobrunner.usage.cost": 0.25}
    (link,) = span.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (
        "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    (pending,) = [e for e in span.events if e.name == "pending"]
    assert 1.5 < pending.attributes["jobrunner.pending.seconds"] < 60
    assert span.status.status_code == trace.StatusCode.ERROR


@pytest.mark.parametrize("path", ["prepared", "cursor"])
@pytest.mark.parametrize("claim", ["batch", "batch with limits", "pool", "pool with limits"])
def test_a_sampled_attempt_links_to_its_enqueue_without_a_statement(traced, dsn, monkeypatch,
                                                                    claim, path):
    """Every claim statement returns the context the enqueue stored with the task, so a
    sampled attempt's span links to the enqueue's PRODUCER span and the attempt itself
    sends nothing to the database: no statement, no connection of the handler's pool
    taken (the handler here uses none). On either path of the claim (libpq's prepared
    statement, the cursor)."""
    exported = traced(ParentBased(ALWAYS_ON))
    pool = "p" if claim.startswith("pool") else None
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        if path == "cursor":
            conn.prepare_threshold = None  # (prepared statements off: the cursor path)
        queue = Queue(conn)
        assert queue.session.direct() == (path == "prepared")
        limits = None
        if claim.endswith("limits"):
            flowcontrol.set_limit(conn, "llm", requests=1000, per=1)
            limits = ["llm"]
        queue.enqueue("b", "acme", [TaskSpec("t", {})], limits=limits, pool=pool)
        (producer,) = exported.get_finished_spans()
        assert producer.kind == trace.SpanKind.PRODUCER and producer.name == "enqueue b"
        exported.clear()
        _, (claimed,) = queue.complete_and_claim("w", (), None if pool else "b", 1, pool=pool)
    assert claimed.trace_context is not None, "the claim did not return the stored context"

    effects = Effects(dsn, max_connections=1)
    executor = Executor(state=None, completer=None,  # type: ignore[arg-type]
                        handler=lambda task: {"ok": True}, concurrency=1, lost_lease_grace=60)
    statements: list[str] = []
    real_execute, real_connection = psycopg.Cursor.execute, Effects._connection

    def execute(cur, query, *args, **kwargs):
        statements.append(str(query))
        return real_execute(cur, query, *args, **kwargs)

    def connection(self):
        statements.append("(a connection of the handler's pool)")
        return real_connection(self)

    try:
        monkeypatch.setattr(psycopg.Cursor, "execute", execute)
        monkeypatch.setattr(Effects, "_connection", connection)
        outcome = executor.outcome(claimed, Task.from_lease(claimed, "w", effects))
        monkeypatch.undo()
    finally:
        executor.shutdown()
        effects.close()
    assert outcome.ok
    assert statements == [], "the attempt sent statements of its own"
    (span,) = exported.get_finished_spans()
    assert span.name == "process" and span.attributes["jobrunner.outcome"] == "done"
    (link,) = span.links
    made = producer.get_span_context()
    assert (link.context.trace_id, link.context.span_id) == (made.trace_id, made.span_id)
    assert link.attributes == {"jobrunner.link": "enqueue"}
