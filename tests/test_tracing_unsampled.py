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

import random
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
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    AlwaysRecordSampler,
    Decision,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    StaticSampler,
    TraceIdRatioBased,
)
from psycopg.rows import dict_row

from jobrunner.model.types import Lease
from jobrunner.model.validation import TaskSpec
from jobrunner.observability import tracing
from jobrunner.observability.sampling import LOW_64, PresetTraceIds, root_bound
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

    def use(sampler, *, ids: str = "sdk") -> InMemorySpanExporter:
        """`ids`: "sdk", the SDK's RandomIdGenerator (the SDK's start_span decides every
        attempt), or "jobrunner", configure()'s (start_attempt decides first when it can)."""
        exported = InMemorySpanExporter()
        provider = TracerProvider(sampler=sampler, id_generator=(
            PresetTraceIds() if ids == "jobrunner" else RandomIdGenerator()))
        provider.add_span_processor(SimpleSpanProcessor(exported))
        tracing.use(provider)
        used.append(provider)
        return exported

    yield use
    tracing.use(None)
    for provider in used:
        provider.shutdown()


@pytest.mark.parametrize("ids", ["sdk", "jobrunner"])
def test_an_unsampled_attempt_parses_nothing_and_records_nothing(traced, ids):
    exported = traced(ParentBased(ALWAYS_OFF), ids=ids)
    assert (tracing._sdk is not None) == (ids == "jobrunner")
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
    # jobrunner's own code on the path: the two calls, the sampler's attributes (when the
    # SDK's start_span decides), the state, and the span when start_attempt decided first,
    # whose SpanContext nothing made (not _extract: its stored context is not parsed)
    assert sorted(calls) == sorted(
        ["start_attempt", "__init__", "end_attempt", "finish_attempt"]
        + (["_for_sampler"] if ids == "sdk" else ["__init__"])), calls
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


@pytest.mark.parametrize("ids", ["sdk", "jobrunner"])
def test_a_sampled_attempt_records_it_all(traced, ids):
    exported = traced(ParentBased(ALWAYS_ON), ids=ids)
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


# -- deciding first (jobrunner/observability/sampling.py) -------------------------------
class ByAttributes(TraceIdRatioBased):
    """A ratio sampler of someone's that also reads the attributes: not the SDK's rule."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                      links=None, trace_state=None) -> SamplingResult:
        if (attributes or {}).get("messaging.destination.name") == "audit":
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return super().should_sample(parent_context, trace_id, name, kind, attributes,
                                     links, trace_state)


RULED = [TraceIdRatioBased(0.25), ParentBasedTraceIdRatio(0.01), ParentBased(
    TraceIdRatioBased(0.5)), TraceIdRatioBased(0.0), TraceIdRatioBased(1.0), ALWAYS_ON,
    ALWAYS_OFF, DEFAULT_ON, DEFAULT_OFF]


@pytest.mark.parametrize("sampler", RULED, ids=lambda s: s.get_description()[:60])
def test_the_rule_decides_as_the_sampler(sampler):
    """root_bound's rule and the sampler's own should_sample agree on an attempt's span
    (a root: tracing._ROOT), on random trace ids and those either side of the bound."""
    bound = root_bound(sampler)
    assert bound is not None
    draw = random.Random(32).getrandbits
    trace_ids = [draw(128) or 1 for _ in range(2000)]
    for edge in (bound - 1, bound):
        if 0 < edge <= LOW_64:
            trace_ids += [edge, (draw(64) << 64) | edge]
    for trace_id in trace_ids:
        decision = sampler.should_sample(
            tracing._ROOT, trace_id, "process", trace.SpanKind.CONSUMER,
            tracing._for_sampler("b")).decision
        assert decision in (Decision.DROP, Decision.RECORD_AND_SAMPLE)
        assert (trace_id & LOW_64 < bound) == (decision is Decision.RECORD_AND_SAMPLE), (
            f"{trace_id:032x}")


@pytest.mark.parametrize("sampler", [
    DropAttempts(), ParentBased(DropAttempts()), ByAttributes(0.5),
    ParentBased(ByAttributes(0.5)), StaticSampler(Decision.RECORD_ONLY),
    AlwaysRecordSampler(TraceIdRatioBased(0.5))], ids=lambda s: type(s).__name__)
def test_any_other_sampler_decides_every_attempt(traced, sampler):
    """A sampler that reads more than the trace id, or records what it drops: the SDK's
    start_span and the sampler itself, for every attempt."""
    assert root_bound(sampler) is None
    traced(sampler, ids="jobrunner")
    assert tracing.enabled() and tracing._sdk is None


def test_deciding_first_samples_the_rules_fraction(traced, monkeypatch):
    """At ratio 0.25, a quarter of the attempts are sampled, each as the SDK's sampler
    decides it on its trace id; none is lost between the two decisions."""
    exported = traced(ParentBasedTraceIdRatio(0.25), ids="jobrunner")
    assert tracing._sdk is not None
    monkeypatch.setattr(tracing, "_getrandbits", random.Random(32).getrandbits)
    attempts, unsampled = 4000, []
    for task_id in range(attempts):
        attempt = tracing.start_attempt(lease(task_id, trace_context=None))
        tracing.finish_attempt(attempt)
        if not attempt.recording:
            assert not attempt.span.get_span_context().trace_flags.sampled
            unsampled.append(attempt.span.get_span_context().trace_id)
    sampled = [span.context.trace_id for span in exported.get_finished_spans()]
    # Binomial(4000, 0.25): mean 1000, standard deviation sqrt(4000 * 0.25 * 0.75) = 27.4;
    # 5 of them either side (137): a right rule is outside once in ~1.7 million draws
    # (the draws are seeded here, so the count is the same on every run).
    assert abs(len(sampled) - attempts * 0.25) <= 137, len(sampled)
    assert len(sampled) + len(unsampled) == attempts
    assert len(set(sampled) | set(unsampled)) == attempts
    bound = TraceIdRatioBased.get_bound_for_rate(0.25)
    assert all(trace_id & LOW_64 < bound for trace_id in sampled)
    assert all(trace_id & LOW_64 >= bound for trace_id in unsampled)


class FixedIds(RandomIdGenerator):
    def __init__(self, trace_id: int, span_id: int) -> None:
        self.ids = trace_id, span_id

    def generate_trace_id(self) -> int:
        return self.ids[0]

    def generate_span_id(self) -> int:
        return self.ids[1]


def test_a_sampled_attempt_has_the_trace_id_decided(traced, monkeypatch):
    """The SDK starts a sampled attempt's span with the trace id start_attempt drew and
    decided on; an unsampled one is the span the SDK would have made of its ids."""
    sampler = ParentBasedTraceIdRatio(0.25)
    exported = traced(sampler, ids="jobrunner")
    bound = TraceIdRatioBased.get_bound_for_rate(0.25)
    chosen = (0x0AF7651916CD43DD << 64) | (bound - 1)  # (its low 64 bits: just sampled)
    dropped = (0x8448EB211C80319C << 64) | bound  # (just not)
    draws = iter([0, chosen, dropped, 0xB7AD6B7169203331])  # (0: an invalid id, drawn again)
    monkeypatch.setattr(tracing, "_getrandbits", lambda bits: next(draws))
    attempt = tracing.start_attempt(lease(trace_context=None))
    tracing.finish_attempt(attempt)
    assert attempt.recording
    (span,) = exported.get_finished_spans()
    assert span.context.trace_id == chosen and span.context.trace_flags.sampled
    # (taken: the next root span of this thread has an id of its own)
    other = tracing.tracer().start_span("other", context=tracing._ROOT)
    assert other.get_span_context().trace_id != chosen

    attempt = tracing.start_attempt(lease(trace_context=None))
    tracing.finish_attempt(attempt)
    assert not attempt.recording
    sdk = TracerProvider(sampler=sampler, id_generator=FixedIds(dropped, 0xB7AD6B7169203331))
    made = sdk.get_tracer("jobrunner").start_span(
        "process", context=tracing._ROOT, kind=trace.SpanKind.CONSUMER,
        attributes=tracing._for_sampler("b"))
    assert not made.is_recording()
    assert attempt.span.get_span_context() == made.get_span_context()
    assert repr(attempt.span) == repr(made)
    sdk.shutdown()


def test_the_handler_inherits_a_decision_made_first(traced):
    """An attempt decided unsampled without the SDK is still the current span: the
    handler's spans are its children, not sampled (not roots of their own at 50 %), and its
    calls pass the decision on."""
    exported = traced(ParentBasedTraceIdRatio(0.5), ids="jobrunner")
    assert tracing._sdk is not None
    for task_id in range(100):  # (the first unsampled one: 1 in 2**100 to find none)
        attempt = tracing.start_attempt(lease(task_id, trace_context=None))
        if not attempt.recording:
            break
        tracing.finish_attempt(attempt)
    try:
        children = [tracing.tracer().start_span("http call") for _ in range(20)]
        for child in children:
            child.end()
        headers = tracing.headers()
    finally:
        tracing.finish_attempt(attempt)
    assert not attempt.recording
    ctx = attempt.span.get_span_context()
    for child in children:
        assert not child.is_recording()
        assert child.get_span_context().trace_id == ctx.trace_id
    traceparent, flags = headers["traceparent"].rsplit("-", 1)
    assert traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"
    assert int(flags, 16) & 1 == 0
    assert [span.name for span in exported.get_finished_spans()] == ["process"] * task_id


def test_configure_decides_first(monkeypatch):
    """configure() gives the SDK jobrunner's ids, so that OTEL_TRACES_SAMPLER's ratio is
    decided first."""
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    installed: list[TracerProvider] = []
    monkeypatch.setattr(trace, "set_tracer_provider", installed.append)  # (not global)
    try:
        assert tracing.configure("jobrunner-test", force=True)
        (provider,) = installed
        assert isinstance(provider.id_generator, PresetTraceIds)
        assert tracing._sdk is not None
        assert tracing._bound == TraceIdRatioBased.get_bound_for_rate(0.01)
    finally:
        tracing.use(None)
        for provider in installed:
            provider.shutdown()


@pytest.mark.parametrize("path", ["prepared", "cursor"])
@pytest.mark.parametrize("claim", ["batch", "batch with limits", "pool", "pool with limits"])
def test_a_sampled_attempt_links_to_its_enqueue_without_a_statement(traced, dsn, monkeypatch,
                                                                    claim, path):
    """Every claim statement returns the context the enqueue stored with the task, so a
    sampled attempt's span links to the enqueue's PRODUCER span and the attempt itself
    sends nothing to the database: no statement, no connection of the handler's pool
    taken (the handler here uses none). On either path of the claim (libpq's prepared
    statement, the cursor)."""
    exported = traced(ParentBased(ALWAYS_ON), ids="jobrunner")  # (configure()'s ids)
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
