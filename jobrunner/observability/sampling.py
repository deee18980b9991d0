"""Deciding an attempt's sampling before the SDK's `start_span` (tracing.start_attempt).

At 1 % sampling 99 % of the attempts are not sampled, and the SDK's `start_span` costs
each of them the sampler's call, three id generator calls, a SamplingResult and a
SpanContext: 11-19 µs per task in the worker, paid cold (bench/results/
issue-32-tracing-cost.md). The SDK's own samplers decide a root span on its trace id
alone, so jobrunner can draw the trace id itself, apply the same rule, and build the
unsampled span without the SDK; a sampled attempt is still started by the SDK, with the
trace id that was decided on (PresetTraceIds hands it out). Any other sampler (a custom
one, one reading attributes or links, one that records what it drops) keeps the SDK's
path for every attempt.

This module needs the SDK (the `otel` extra); tracing.py imports it only when it is there.
"""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

# The SDK's rule (TraceIdRatioBased.should_sample): sampled iff
# trace_id & TRACE_ID_LIMIT < bound, the limit being the 64 low bits.
LOW_64 = sampling.TraceIdRatioBased.TRACE_ID_LIMIT
ALL = LOW_64 + 1  # (a bound every trace id is below: always sampled)


class _Pending(threading.local):
    trace_id = 0  # (0 is never a valid trace id: none pending)


class PresetTraceIds(RandomIdGenerator):
    """The SDK's random ids, except that the next root trace id of a thread can be chosen
    beforehand (tracing.start_attempt, for an attempt it decided to sample). Per thread:
    the worker starts attempts in several threads at once, and between the choice and
    the SDK's call for it nothing else of this thread starts a span."""

    def __init__(self) -> None:
        self.pending = _Pending()

    def generate_trace_id(self) -> int:
        pending = self.pending
        trace_id = pending.trace_id
        if trace_id:
            pending.trace_id = 0
            return trace_id
        return super().generate_trace_id()


# Samplers whose should_sample is the SDK's own, by exact type: a subclass may override
# it (read the attributes, say), so it keeps the SDK's path.
_RATIO = {sampling.TraceIdRatioBased}
_PARENT_BASED = {sampling.ParentBased, sampling.ParentBasedTraceIdRatio}
_STATIC = {sampling.StaticSampler}
for _kind, _names in ((_PARENT_BASED, ("_ParentBasedAlwaysOff", "_ParentBasedAlwaysOn")),
                      (_STATIC, ("_AlwaysOff", "_AlwaysOn"))):
    for _name in _names:  # (the classes OTEL_TRACES_SAMPLER names; private, so looked up)
        if isinstance(getattr(sampling, _name, None), type):
            _kind.add(getattr(sampling, _name))


def root_bound(sampler: object) -> int | None:
    """The bound below which the low 64 bits of a ROOT span's trace id make `sampler`
    sample it (RECORD_AND_SAMPLE; any other trace id: DROP), or None when its decision is
    not that rule (then only the sampler itself can decide).

    None of these samplers reads the name, kind, attributes or links it is given, so not
    giving them any (the unsampled attempt is decided without the sampler's call) decides
    the same; a sampled attempt's span is started by the SDK with them all, and its
    sampler decides it again, the same way."""
    kind = type(sampler)
    if kind in _PARENT_BASED:
        # An attempt has no parent (tracing._ROOT): ParentBased asks its root sampler.
        return root_bound(getattr(sampler, "_root", None))
    if kind in _RATIO:
        bound = getattr(sampler, "bound", None)
        return bound if isinstance(bound, int) else None
    if kind in _STATIC:
        decision = getattr(sampler, "_decision", None)
        if decision is sampling.Decision.DROP:
            return 0
        if decision is sampling.Decision.RECORD_AND_SAMPLE:
            return ALL
    return None  # (RECORD_ONLY, or any other sampler)
