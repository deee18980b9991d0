"""Traces (docs/observability.md): a PRODUCER span per enqueue, whose W3C context is stored
with every task it wrote, and per attempt a CONSUMER `process` span LINKED to it (not its
child: an attempt may run hours later, in a trace of its own), with the messaging
semantic conventions' attributes and ours; the handler's spans are children of it.

Only opentelemetry-api is a dependency of the core. Tracing is on when the SDK is there
(the `otel` extra), `configure()` ran (every process of jobrunner calls it at start) and
the standard environment asks for it: OTEL_TRACES_EXPORTER=otlp|console, or an OTLP
endpoint (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT);
OTEL_SDK_DISABLED=true turns it off. Sampling is the SDK's: OTEL_TRACES_SAMPLER and
OTEL_TRACES_SAMPLER_ARG. Off, a traced call costs one test of a module global: no span,
no context stored or parsed.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Protocol

from opentelemetry import baggage, context, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger("jobrunner.tracing")

SYSTEM = "jobrunner"  # messaging.system
_enabled = False
_tracer: trace.Tracer = trace.NoOpTracer()


def enabled() -> bool:
    return _enabled


def configure(service_name: str, *, force: bool = False) -> bool:
    """Set up the SDK from the OTEL_* environment if it asks for traces; whether tracing is
    on. Idempotent; `force` is for tests, which bring their own provider."""
    global _enabled, _tracer
    if _enabled and not force:
        return True
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    wanted = exporter in ("otlp", "console") or (
        exporter == "" and bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")))
    if not wanted:
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        log.warning("OTEL_* asks for traces, but the OpenTelemetry SDK is not installed "
                    "(pip install 'jobrunner[otel]'); tracing stays off")
        return False
    span_exporter: SpanExporter
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        span_exporter = OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
    # (OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over the default name)
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name})
    from jobrunner.observability.sampling import PresetTraceIds

    # (sampler: OTEL_TRACES_SAMPLER(_ARG); the ids: the SDK's random ones, which
    # start_attempt may choose beforehand)
    provider = TracerProvider(resource=resource, id_generator=PresetTraceIds())
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    use(provider)
    return True


def use(provider: trace.TracerProvider | None) -> None:
    """Trace with `provider` (None: off). configure() calls it; tests call it directly."""
    global _enabled, _tracer, _sdk, _bound, _unsampled
    _enabled, _sdk = False, None
    if provider is None:
        _tracer = trace.NoOpTracer()
        return
    _tracer = provider.get_tracer("jobrunner")
    first = _deciding_first(_tracer)
    if first is not None:
        _sdk, _bound, _unsampled = _tracer, *first
    _enabled = True


def _deciding_first(tracer: trace.Tracer) -> tuple[int, trace.TraceFlags] | None:
    """Whether start_attempt can decide an attempt's sampling before the SDK's start_span
    (jobrunner/observability/sampling.py): the bound of its sampler's rule and an unsampled
    span's flags, or None (then every attempt is the SDK's start_span, as any span)."""
    try:
        from opentelemetry.sdk.trace import Tracer

        from jobrunner.observability.sampling import PresetTraceIds, root_bound
    except ImportError:
        return None
    if not isinstance(tracer, Tracer) or not isinstance(tracer.id_generator, PresetTraceIds):
        return None  # (a provider of someone else's: its ids are its own)
    if not hasattr(tracer, "_tracer_config"):
        return None  # (an SDK this was not written against: whether it is on is unknown)
    # The SDK's own metrics (OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED) count every span
    # started, the dropped ones too: with them on, each attempt is the SDK's.
    metrics = getattr(tracer, "_tracer_metrics", None)
    if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
        return None
    bound = root_bound(tracer.sampler)
    if bound is None:
        return None
    # (the flags the SDK gives a span it drops: not sampled, and its random trace id flag
    # when the ids say so, as they do)
    flags = trace.TraceFlags.DEFAULT
    if getattr(tracer.id_generator, "is_trace_id_random", lambda: False)():
        flags |= getattr(trace.TraceFlags, "RANDOM_TRACE_ID", 0)
    return bound, trace.TraceFlags(flags)


def shutdown(timeout_s: float = 5.0) -> None:
    """Send the spans still buffered (before a process leaves with os._exit)."""
    if not _enabled:
        return
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        try:
            flush(int(timeout_s * 1000))
        except Exception as exc:  # a trace store that is down must not hang an exit
            log.debug("tracing: the last spans were not sent: %s", exc)


def tracer() -> trace.Tracer:
    return _tracer


# -- the producer side ----------------------------------------------------------------
@contextlib.contextmanager
def enqueue_span(batch_id: str, tenant_id: str, *, pool: str | None = None,
                 task_key: str | None = None) -> Iterator[trace.Span | None]:
    """The PRODUCER span of one enqueue (None when tracing is off); carrier() inside it is
    the context to store with the tasks. `task_key`: the one task it enqueues, when it is
    one of the batch's own (the reduce's)."""
    if not _enabled:
        yield None
        return
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue", "messaging.destination.name": batch_id,
        "jobrunner.batch": batch_id, "jobrunner.tenant": tenant_id}
    if pool is not None:
        attributes["jobrunner.pool"] = pool
    if task_key is not None:
        attributes["jobrunner.task.key"] = task_key
    with _tracer.start_as_current_span(f"enqueue {batch_id}", kind=SpanKind.PRODUCER,
                                       attributes=attributes) as span:
        yield span


def carrier() -> str | None:
    """The current context as JSON text (traceparent, tracestate, baggage), or None when
    there is nothing to pass on: tracing off, or a span that is not sampled and no baggage.
    An unsampled span is never exported, so its traceparent would link the attempts to a
    span no trace store has; stored anyway it made every task's row some 90 bytes wider
    (WAL and heap for each claim and ack) at 1 % sampling, for nothing."""
    if not _enabled:
        return None
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    out: dict[str, str] = {}
    # (unsampled: the current context without its span, so whatever the propagators,
    # only the baggage is written)
    propagate.inject(out, context=None if span_context.trace_flags.sampled
                     else trace.set_span_in_context(trace.INVALID_SPAN))
    return json.dumps(out, sort_keys=True) if out else None


def headers() -> dict[str, str]:
    """The current context as HTTP headers for an outgoing call (empty when off)."""
    if not _enabled:
        return {}
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def _extract(text: str | None) -> context.Context | None:
    if not text:
        return None
    try:
        fields = json.loads(text)
    except ValueError:
        return None
    return propagate.extract(fields) if isinstance(fields, dict) else None


# -- the consumer side ----------------------------------------------------------------
OUTCOMES = ("done", "retry", "dead", "lease_lost", "rate_limited")


class Attempt:
    """An attempt's span while it runs, and what it gathers (tokens and cost:
    Task.report_usage). `recording`: whether the span is sampled; an unsampled one is
    only the current span (so that the handler's own spans and calls inherit the
    decision), and nothing else is done for it."""

    __slots__ = ("_baggage", "_current", "_state", "cost", "recording", "span", "tokens",
                 "usage_reported")

    def __init__(self, span: trace.Span, current: object, recording: bool = False) -> None:
        self.span, self._current, self.recording = span, current, recording
        self.tokens, self.cost, self.usage_reported = 0, 0.0, False
        self._baggage: object = None
        self._state: contextvars.Token[Attempt | None] | None = None


class Claimed(Protocol):
    """What an attempt's span needs of its lease (jobrunner.model.types.Lease; this
    package is below the model and imports nothing of jobrunner)."""

    @property
    def id(self) -> int: ...
    @property
    def batch_id(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def shard_key(self) -> str | None: ...
    @property
    def attempt(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def run_after(self) -> datetime | None: ...
    @property
    def trace_context(self) -> str | None: ...


_ROOT = context.Context()  # (no parent: each attempt's span starts a trace of its own)
# Deciding first (use()): the SDK's tracer when its sampler's rule for a root span is a
# bound on the trace id's 64 low bits, which start_attempt then applies itself.
_sdk: Any = None
_bound = 0
_unsampled = trace.TraceFlags(trace.TraceFlags.DEFAULT)
_LOW_64 = (1 << 64) - 1  # (sampling.LOW_64: that module needs the SDK)
_getrandbits = random.getrandbits  # (the SDK's RandomIdGenerator's source)
_attempt: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar(
    "jobrunner_attempt", default=None)
# The attributes a sampler is given (the messaging conventions' ones a sampler may decide
# on), per batch: built once, not per attempt. The rest are set only on a sampled span.
_sampling_attributes: dict[str, dict[str, Any]] = {}


def _for_sampler(batch_id: str) -> dict[str, Any]:
    attributes = _sampling_attributes.get(batch_id)
    if attributes is None:
        if len(_sampling_attributes) >= 1000:  # (a pool's worker sees many batches)
            _sampling_attributes.clear()
        attributes = _sampling_attributes[batch_id] = {
            "messaging.system": SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": batch_id}
    return attributes


def start_attempt(lease: Claimed) -> Attempt:
    """Start the CONSUMER span of one attempt and make it current (finish_attempt ends
    it). The span links to the enqueue's stored context, which the claim returned with
    the lease (`lease.trace_context`): a sampled attempt sends no statement of its own.

    An unsampled attempt (99 % of them at 1 % sampling) costs the sampling decision and
    the current span's switch, nothing more: no parse of its stored context, no
    attribute, no event, nothing to end. With configure()'s provider and the SDK's own
    samplers the decision is made here, before the SDK's start_span, on a trace id drawn
    as the SDK draws it (sampling.py); otherwise the SDK's start_span and its sampler
    decide, given the four attributes a sampler may decide on. Each line of Python on
    this path is paid on every task, and cold: between two tasks the worker's caches hold
    the database driver's and other processes' data, and the old path (a generator
    context manager, a dozen attributes, a context variable, the end of a span that
    records nothing) cost 30-52 µs of worker CPU per task
    (bench/results/issue-32-tracing-cost.md)."""
    sdk, pending = _sdk, None
    if sdk is not None and sdk._tracer_config.is_enabled:
        # Deciding first (use()): the trace id drawn as the SDK's RandomIdGenerator does,
        # the sampler's rule applied to it. Unsampled, the span is the one the SDK would
        # make (its ids, the flags of a dropped span), without the SDK: no sampler call,
        # no SamplingResult, no id generator calls. The sampler is not given the four
        # attributes then: only samplers that ignore them (and the name, kind and links)
        # are decided here (sampling.root_bound), so the decision is the one they make.
        trace_id = _getrandbits(128) or _nonzero(128)
        if trace_id & _LOW_64 >= _bound:
            span = _Unsampled(trace_id, _getrandbits(64) or _nonzero(64))
            return Attempt(span, context.attach(trace.set_span_in_context(span)))
        # Sampled: the SDK starts it with that trace id (its sampler decides the same).
        pending = sdk.id_generator.pending
        pending.trace_id = trace_id
    try:
        # A new root: an attempt is not part of its enqueue's trace (it would keep that
        # trace open for hours), it links to it.
        span = _tracer.start_span("process", context=_ROOT, kind=SpanKind.CONSUMER,
                                  attributes=_for_sampler(lease.batch_id),
                                  record_exception=False, set_status_on_exception=False)
    finally:
        if pending is not None:
            pending.trace_id = 0  # (taken by the SDK; or not, if it raised)
    current = context.attach(trace.set_span_in_context(span))
    if not span.is_recording():
        return Attempt(span, current)
    state = Attempt(span, current, recording=True)
    try:
        _record_start(state, lease)
    except Exception as exc:  # a trace must never fail an attempt
        log.debug("task %s: its span's start was not recorded in full: %s", lease.key, exc)
    state._state = _attempt.set(state)
    return state


class _Unsampled(trace.NonRecordingSpan):
    """The span the SDK makes for a root span it drops (a NonRecordingSpan of its ids, not
    sampled, not remote), whose SpanContext is made only when read: with a handler that
    starts no span and makes no call, nothing reads it, and each line here is paid cold
    on every unsampled attempt. (Both ids are drawn at once, so that two threads reading
    it first at the same time make the same context.)"""

    def __init__(self, trace_id: int, span_id: int) -> None:
        self._ids = (trace_id, span_id)
        self._made: trace.SpanContext | None = None

    def get_span_context(self) -> trace.SpanContext:
        made = self._made
        if made is None:
            made = self._made = trace.SpanContext(*self._ids, False, _unsampled)
        return made

    @property  # type: ignore[override]  # (NonRecordingSpan's attribute, which repr reads)
    def _context(self) -> trace.SpanContext:
        return self.get_span_context()


def _nonzero(bits: int) -> int:
    """A random id of `bits` bits other than 0 (an invalid id), as the SDK draws them."""
    while True:
        value = _getrandbits(bits)
        if value:
            return value


def _record_start(state: Attempt, lease: Claimed) -> None:
    span = state.span
    span.set_attributes({
        "messaging.message.id": str(lease.id), "messaging.consumer.group.name": lease.batch_id,
        "jobrunner.batch": lease.batch_id, "jobrunner.task.key": lease.key,
        "jobrunner.tenant": lease.tenant_id, "jobrunner.attempt": lease.attempt,
        "jobrunner.max_attempts": lease.max_attempts})
    if lease.shard_key is not None:
        span.set_attribute("jobrunner.shard", lease.shard_key)
    stored = _extract(lease.trace_context)
    if stored is not None:
        producer = trace.get_current_span(stored).get_span_context()
        if producer.is_valid:
            span.add_link(producer, {"jobrunner.link": "enqueue"})
        # The enqueue's baggage travels on to the handler's own calls.
        ctx = context.get_current()
        for name, value in baggage.get_all(stored).items():
            ctx = baggage.set_baggage(name, value, ctx)
        state._baggage = context.attach(ctx)
    if lease.run_after is not None:  # (the time it waited pending once due)
        waited = max(0.0, time.time() - lease.run_after.timestamp())
        span.add_event("pending", {"jobrunner.pending.seconds": round(waited, 6)})


def finish_attempt(state: Attempt) -> None:
    """End an attempt's span (after end_attempt gave it its outcome) and make the context
    before it current again."""
    if state.recording:
        if state._state is not None:
            _attempt.reset(state._state)
        if state._baggage is not None:
            context.detach(state._baggage)  # type: ignore[arg-type]
        context.detach(state._current)  # type: ignore[arg-type]
        state.span.end()
        return
    context.detach(state._current)  # type: ignore[arg-type]


def end_attempt(state: Attempt, outcome: str, error: str | None = None, *,
                retry_after: float | None = None) -> None:
    """An attempt's outcome (OUTCOMES), status and usage, on its span (when sampled)."""
    if not state.recording:
        return
    span = state.span
    span.set_attribute("jobrunner.outcome", outcome)
    if state.usage_reported:
        span.set_attribute("jobrunner.usage.tokens", state.tokens)
        span.set_attribute("jobrunner.usage.cost", state.cost)
    if outcome == "rate_limited":
        # Not an error of the task: it goes back to pending without using an attempt.
        span.add_event("rate_limited", {"jobrunner.retry_after.seconds": retry_after or 0.0,
                                        "error.message": (error or "")[:1000]})
        span.set_attribute("error.type", "rate_limited")
    elif outcome != "done":
        span.set_attribute("error.type", outcome)
        span.set_status(Status(StatusCode.ERROR, (error or outcome)[:1000]))
    else:
        span.set_status(Status(StatusCode.OK))


def record_usage(tokens: int | None, input_tokens: int | None, output_tokens: int | None,
                 cost: float | None) -> None:
    """A usage report of the current attempt: an event on the current span (the model
    call's, when a handler made one), and the attempt's totals."""
    if not _enabled:
        return
    attributes: dict[str, Any] = {}
    for name, value in (("gen_ai.usage.input_tokens", input_tokens),
                        ("gen_ai.usage.output_tokens", output_tokens),
                        ("jobrunner.usage.tokens", tokens), ("jobrunner.usage.cost", cost)):
        if value is not None:
            attributes[name] = value
    current = trace.get_current_span()
    if current.is_recording():
        current.add_event("usage", attributes)
    state = _attempt.get()
    if state is not None:
        state.usage_reported = True
        state.tokens += int(tokens or 0)
        state.cost += float(cost or 0)


@contextlib.contextmanager
def model_call_span(operation: str, model: str | None, *, system: str = "openai",
                    server: str | None = None) -> Iterator[trace.Span | None]:
    """A gen_ai.* CLIENT span around one model call (None when tracing is off)."""
    if not _enabled:
        yield None
        return
    attributes: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.system": system,
                                  "gen_ai.provider.name": system}
    if model:
        attributes["gen_ai.request.model"] = model
    if server:
        attributes["server.address"] = server
    with _tracer.start_as_current_span(f"{operation} {model or ''}".strip(),
                                       kind=SpanKind.CLIENT, attributes=attributes) as span:
        yield span


def model_call_usage(span: trace.Span | None, body: Any) -> None:
    """The token usage and response model of an OpenAI-shaped answer, on its span."""
    if span is None or not span.is_recording() or not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        span.set_attribute("gen_ai.response.model", body["model"])
    if isinstance(body.get("id"), str):
        span.set_attribute("gen_ai.response.id", body["id"])
    usage = body.get("usage")
    if isinstance(usage, dict):
        for ours, theirs in (("gen_ai.usage.input_tokens", ("prompt_tokens", "input_tokens")),
                             ("gen_ai.usage.output_tokens",
                              ("completion_tokens", "output_tokens"))):
            for name in theirs:
                if isinstance(usage.get(name), int):
                    span.set_attribute(ours, usage[name])
                    break
