"""Traces, read back from a real trace store (docs/observability.md).

A real Jaeger (tests/support/jaeger.py: cmd/jaeger built from the Go module proxy, like
the e2e binaries) receives OTLP from the test's enqueue and from a real worker process
configured only by the standard OTEL_* variables. The worker runs the OpenAI-compatible
handler against tests/support/openai_server.py: one task succeeds, one is retried after a
500, one is rate limited by a 429, one ends dead on a 400; then the batch's reduce runs.
The test reads every trace back through Jaeger's query HTTP API and checks the span tree:
each attempt a CONSUMER `process` span, a root of its own trace LINKED to the enqueue's
PRODUCER span; its outcome, status and attributes; the model call a `chat` child with
gen_ai.* token usage; the reduce step's own span nested in its attempt. The tree is
printed for the CI log.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest

from jobrunner.features.reduce import REDUCE_KEY, ReduceSpec
from jobrunner.model.types import Lease
from jobrunner.model.validation import TaskSpec
from jobrunner.observability import tracing
from jobrunner.queue.client import Queue
from tests.support import jaeger as jaeger_support
from tests.support.figures import show
from tests.support.jaeger import kind, parent, refs, render, tags
from tests.support.openai_server import OpenAITestServer
from tests.support.processes import child_env, start_worker, wait_for

pytestmark = pytest.mark.skipif(not jaeger_support.available(),
                                reason="jaeger is not built: run `make e2e-bins`")

FAST = ["--visibility-timeout", "5", "--heartbeat", "1", "--backoff-base", "0.05",
        "--backoff-cap", "0.2", "--concurrency", "2"]
PATH = "/v1/chat/completions"


def chat(key: str, text: str) -> TaskSpec:
    return TaskSpec(key, {"url": PATH, "body": {"model": "test-model",
                                                "messages": [{"role": "user",
                                                              "content": text}]}})


@pytest.fixture
def jaeger(tmp_path):
    with jaeger_support.Jaeger(tmp_path) as j:
        yield j


@pytest.fixture
def enqueue_tracing(jaeger):
    """This process's enqueues traced to Jaeger, as `configure()` would from OTEL_*."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "test-enqueue"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
        endpoint=f"http://127.0.0.1:{jaeger.otlp}/v1/traces")))
    tracing.use(provider)
    try:
        yield provider
    finally:
        tracing.use(None)
        provider.shutdown()


def test_a_batch_read_back_from_jaeger(dsn, conn, tmp_path, jaeger, enqueue_tracing, capsys):
    with OpenAITestServer(api_key="sk-test") as server:
        server.fail("[flaky]", 500)
        server.fail("[busy]", 429, retry_after=0.2)
        server.fail("[bad]", 400, times=None)
        Queue(conn).enqueue("b", "acme", [chat("ok", "hello"), chat("flaky", "[flaky] hi"),
                                          chat("busy", "[busy] hi"), chat("bad", "[bad] hi")],
                            max_attempts=3,
                            reduce=ReduceSpec(handler="tests.support.tracing_handlers:count",
                                              on_dead="include").as_json())
        stored = conn.execute("SELECT task_key, trace_context->>'traceparent' AS tp "
                              "FROM agent_work_queue WHERE batch_id = 'b'").fetchall()
        conn.rollback()
        stored = [r["tp"] for r in stored]
        assert len(stored) == 4 and all(tp and tp.startswith("00-") for tp in stored), stored
        env = child_env(dsn, OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="sk-test",
                        **jaeger.otel_env("jobrunner-worker"))
        worker = start_worker(dsn, "b", "jobrunner.openai_batch:handle", "--exit-when-drained",
                              *FAST, env=env, log=tmp_path / "worker.log")
        assert worker.wait(120) == 0, (tmp_path / "worker.log").read_text()[-3000:]

    statuses = {r["task_key"]: r["status"] for r in conn.execute(
        "SELECT task_key, status::text FROM agent_work_queue WHERE batch_id = 'b'")}
    conn.rollback()
    assert statuses == {"ok": "done", "flaky": "done", "busy": "done", "bad": "dead",
                        REDUCE_KEY: "done"}, statuses

    # -- the producer's trace --------------------------------------------------------
    produced = wait_for(lambda: jaeger.traces("test-enqueue"), timeout=30,
                        what="the enqueue's trace in jaeger")
    (enqueue,) = [s for t in produced for s in t["spans"] if s["operationName"] == "enqueue b"]
    assert kind(enqueue) == "producer"
    assert tags(enqueue)["messaging.system"] == "jobrunner"
    assert tags(enqueue)["messaging.batch.message_count"] == 4
    producer = (enqueue["traceID"], enqueue["spanID"])
    # what the tasks store is that span's context
    assert {tp.split("-")[1:3] == list(producer) for tp in stored} == {True}

    # -- the worker's traces ---------------------------------------------------------
    # ok 1, flaky 2 (a retry), busy 2 (rate limited, then done), bad 1 (dead), reduce 1
    def attempts() -> list[dict[str, Any]]:
        found = jaeger.traces("jobrunner-worker")
        spans = [s for t in found for s in t["spans"] if s["operationName"] == "process"]
        return found if len(spans) >= 7 else []

    traces = wait_for(attempts, timeout=30, what="7 attempts' spans in jaeger")
    show(capsys, "trace tree (tests/test_tracing.py), the enqueue's then the worker's:\n"
         + render(produced + traces))
    spans = [s for t in traces for s in t["spans"]]
    process = [s for s in spans if s["operationName"] == "process"]
    assert len(process) == 7, render(traces)

    seen: Counter[tuple[str, int, str]] = Counter()
    reduce_links: list[tuple[str, str]] = []
    for span in process:
        tg = tags(span)
        key, attempt, outcome = tg["jobrunner.task.key"], tg["jobrunner.attempt"], \
            tg["jobrunner.outcome"]
        seen[(key, attempt, outcome)] += 1
        assert kind(span) == "consumer"
        assert parent(span) is None, "an attempt's span is a root, not the enqueue's child"
        assert tg["messaging.system"] == "jobrunner"
        assert tg["messaging.operation.type"] == "process"
        assert tg["jobrunner.batch"] == "b" and tg["jobrunner.tenant"] == "acme"
        assert "pending" in {f["value"] for log in span.get("logs", []) for f in log["fields"]}
        if key == REDUCE_KEY:
            # linked to the PRODUCER span of the trigger that enqueued it (in the worker)
            reduce_links.extend(refs(span, "FOLLOWS_FROM"))
        else:
            assert refs(span, "FOLLOWS_FROM") == [producer], "linked to the enqueue"
            assert span["traceID"] != producer[0]
        if outcome in ("retry", "dead"):
            assert tg["otel.status_code"] == "ERROR" and tg["error.type"] == outcome
        if outcome == "done":
            assert tg["otel.status_code"] == "OK"
    (trigger,) = [s for s in spans if s["operationName"] == "enqueue b"
                  and tags(s).get("jobrunner.task.key") == REDUCE_KEY
                  and tags(s).get("jobrunner.reduce.enqueued") is True]
    assert kind(trigger) == "producer" and parent(trigger) is None
    assert reduce_links == [(trigger["traceID"], trigger["spanID"])]
    assert seen == Counter({("ok", 1, "done"): 1, ("flaky", 1, "retry"): 1,
                            ("flaky", 2, "done"): 1, ("busy", 1, "rate_limited"): 1,
                            ("busy", 1, "done"): 1, ("bad", 1, "dead"): 1,
                            (REDUCE_KEY, 1, "done"): 1}), seen

    # -- the handlers' spans are the attempts' children ------------------------------
    by_id = {s["spanID"]: s for s in spans}
    calls = [s for s in spans if s["operationName"] == "chat test-model"]
    assert len(calls) == 6  # every attempt of a chat task made one call
    for call in calls:
        up = by_id[parent(call)]
        assert up["operationName"] == "process" and up["traceID"] == call["traceID"]
        assert kind(call) == "client" and tags(call)["gen_ai.operation.name"] == "chat"
    done_calls = [c for c in calls if tags(c)["http.response.status_code"] == 200]
    assert len(done_calls) == 3
    for call in done_calls:
        tg = tags(call)
        assert tg["gen_ai.usage.input_tokens"] > 0 and tg["gen_ai.usage.output_tokens"] > 0
        attempt = tags(by_id[parent(call)])
        assert attempt["jobrunner.usage.tokens"] == (tg["gen_ai.usage.input_tokens"]
                                                     + tg["gen_ai.usage.output_tokens"])
    assert sorted(tags(c)["http.response.status_code"] for c in calls) == [
        200, 200, 200, 400, 429, 500]
    # the upstream saw the call's context (an instrumented server would continue it)
    assert all(r.headers.get("traceparent", "").startswith("00-") for r in server.requests)
    (counted,) = [s for s in spans if s["operationName"] == "count results"]
    assert tags(by_id[parent(counted)])["jobrunner.task.key"] == REDUCE_KEY
    assert tags(counted)["results"] == 4


def test_off_stores_no_context_and_sends_nothing(dsn, conn, tmp_path, jaeger):
    """Without OTEL_* the worker traces nothing, and an untraced enqueue stores NULL."""
    Queue(conn).enqueue("quiet", "acme", [TaskSpec("t", {})])
    assert conn.execute("SELECT trace_context FROM agent_work_queue").fetchone() == {
        "trace_context": None}
    conn.rollback()
    env = child_env(dsn, OTEL_SERVICE_NAME="jobrunner-quiet")
    worker = start_worker(dsn, "quiet", "tests.support.handlers:record", "--exit-when-drained",
                          *FAST, env=env, log=tmp_path / "worker.log")
    assert worker.wait(60) == 0
    assert "jobrunner-quiet" not in jaeger.services()


def test_a_command_handler_continues_the_attempts_trace():
    """A command handler gets its attempt's context as TRACEPARENT (OpenTelemetry's
    environment carrier), and a usage report lands on the attempt's span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from jobrunner.runtime.task import Task
    from jobrunner.runtime.taskhandlers import CommandHandler

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracing.use(provider)
    try:
        task = Task(id=1, key="k", batch_id="b", tenant_id="acme", shard_key=None, payload={},
                    attempt=1, max_attempts=3, worker_id="w")
        lease = Lease(id=1, batch_id="b", key="k", tenant_id="acme", shard_key=None,
                      payload={}, attempt=1, max_attempts=3,
                      locked_until=datetime.now(UTC))
        attempt = tracing.start_attempt(lease)
        try:
            out = CommandHandler("printf '%s' \"$TRACEPARENT\"")(task)
            tracing.record_usage(7, 3, 4, 0.5)
            tracing.end_attempt(attempt, "done")
        finally:
            tracing.finish_attempt(attempt)
    finally:
        tracing.use(None)
    (span,) = exported.get_finished_spans()
    ctx = span.get_span_context()
    # (its flags: sampled, and the SDK's random trace id flag)
    assert out["stdout"].rsplit("-", 1)[0] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"
    assert span.attributes["jobrunner.usage.tokens"] == 7
    assert span.attributes["jobrunner.usage.cost"] == 0.5
    assert span.attributes["jobrunner.outcome"] == "done"


def test_an_unsampled_enqueue_stores_only_its_baggage(conn):
    """A span that is not sampled is never exported: its traceparent is not stored (a
    link to it would point nowhere, and the row would be wider at every claim and ack);
    the enqueue's baggage still is, for the attempts' handlers."""
    from opentelemetry import baggage, context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    tracing.use(TracerProvider(sampler=ALWAYS_OFF))
    try:
        Queue(conn).enqueue("plain", "acme", [TaskSpec("t", {})])
        token = context.attach(baggage.set_baggage("team", "search"))
        try:
            Queue(conn).enqueue("carried", "acme", [TaskSpec("t", {})])
        finally:
            context.detach(token)
    finally:
        tracing.use(None)
    stored = {r["batch_id"]: r["trace_context"] for r in conn.execute(
        "SELECT batch_id, trace_context FROM agent_work_queue")}
    conn.rollback()
    assert stored == {"plain": None, "carried": {"baggage": "team=search"}}

