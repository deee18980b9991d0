"""An attempt's span at low sampling (jobrunner/observability/tracing.py, issue 32's cost).

At 1 % sampling 99 % of the attempts are not sampled, and whatever tracing does for them
is paid on every task: an unsampled attempt is the sampler's decision and a non-recording
span made current (so that the handler's own spans and calls inherit the decision), and
nothing more: no read of its enqueue's stored context (a statement), no attributes, no
event, no context variable. A sampled one gets all of it, its read in one statement. An
in-memory exporter and the SDK's own samplers; the read is a recorded callable but in the
last test, on a real PostgreSQL.
"""

from __future__ import annotations

import json
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
from psycopg.pq import TransactionStatus

from jobrunner.model.types import Lease
from jobrunner.model.validation import TaskSpec
from jobrunner.observability import tracing
from jobrunner.queue.client import Queue
from jobrunner.runtime.effects import Effects
from jobrunner.store import tasks as task_store

STORED = ('{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",'
          ' "baggage": "team=search"}')


def lease(task_id: int = 7) -> Lease:
    now = datetime.now(UTC)
    return Lease(id=task_id, batch_id="b", key=f"k{task_id}", tenant_id="acme",
                 shard_key="s1", payload={}, attempt=1, max_attempts=3,
                 locked_until=now + timedelta(minutes=10), run_after=now - timedelta(seconds=2))


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


def test_an_unsampled_attempt_reads_nothing_and_records_nothing(traced):
    exported = traced(ParentBased(ALWAYS_OFF))
    reads: list[int] = []
    calls: list[str] = []

    def count(frame, event, _arg) -> None:
        if event == "call" and "jobrunner" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        attempt = tracing.start_attempt(lease(), lambda: reads.append(1) or STORED)
        current = trace.get_current_span()
        tracing.end_attempt(attempt, "done")
        tracing.finish_attempt(attempt)
    finally:
        sys.setprofile(None)
    assert reads == [], "an unsampled attempt read its stored context"
    # jobrunner's own code on the path: the two calls, the sampler's attributes, the state
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
    attempt = tracing.start_attempt(lease(), lambda: None)
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


def test_a_sampled_attempt_reads_its_context_once_and_records_it_all(traced):
    exported = traced(ParentBased(ALWAYS_ON))
    reads: list[int] = []
    attempt = tracing.start_attempt(lease(), lambda: reads.append(1) or STORED)
    try:
        assert trace.get_current_span() is attempt.span and attempt.recording
        tracing.record_usage(10, 4, 6, 0.25)
        tracing.end_attempt(attempt, "retry", "boom")
    finally:
        tracing.finish_attempt(attempt)
    assert reads == [1]
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


def test_a_sampled_attempts_context_read_is_one_statement(dsn, conn):
    """Outside a transaction (autocommit), so no BEGIN and COMMIT around it; the pool's
    connection goes back as it came (the effects' own transactions need it so)."""
    Queue(conn).enqueue("b", "acme", [TaskSpec("t", {})])
    conn.execute("UPDATE agent_work_queue SET trace_context = %s::jsonb", (STORED,))
    task_id = conn.execute("SELECT id FROM agent_work_queue").fetchone()["id"]
    conn.commit()
    effects = Effects(dsn, max_connections=1)  # (one connection: the same one both times)
    seen: list[tuple[object, ...]] = []

    def read(c: psycopg.Connection) -> str | None:
        stored = task_store.trace_context(c, task_id)
        seen.append((c.info.transaction_status, c.autocommit))
        return stored

    try:
        assert json.loads(effects.read(read) or "") == json.loads(STORED)
        effects.run(lambda c: seen.append((c.autocommit,)))
    finally:
        effects.close()
    assert seen == [(TransactionStatus.IDLE, True), (False,)]
