"""Traces through the real node (issue 32): a BatchRun's worker pods export their spans
to a real Jaeger, configured only the way a user would, and the test reads them back.

tests/test_tracing.py checks the span tree of a batch run by local processes; here the
same links must hold across the cluster. The test starts Jaeger (tests/support/jaeger.py)
on 127.0.0.1, which the pods reach on the node's network (every pod of the e2e node uses
hostNetwork). The controller gets the standard OTEL_* variables through the chart value
`controller.extraEnv`; the workers through the BatchRun's `spec.template.env`, with the
Kubernetes resource attributes from the downward API (`OTEL_RESOURCE_ATTRIBUTES` built
from `fieldRef`s with `$(VAR)` references), as OpenTelemetry's docs for Kubernetes show;
the image carries the SDK (the Dockerfile installs the `otel` extra). The controller's
enqueue is the PRODUCER span; each attempt in a worker pod is a CONSUMER `process` span,
the root of a trace of its own LINKED to it, with the pod's service name and resource
attributes and the messaging attributes. The tree is printed for the CI log.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest

from tests.support import jaeger as jaeger_support
from tests.support.figures import show
from tests.support.jaeger import kind, parent, process, refs, render, tags
from tests.support.processes import wait_for

from .operator_support import (
    Controller,
    apply,
    apply_crds,
    batchrun,
    create_db_secret,
    pods_of,
    wait_phase,
)

pytestmark = pytest.mark.skipif(not jaeger_support.available(),
                                reason="jaeger is not built: run `make e2e-bins`")

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}
RUN = "traced"
# tests.support.handlers:flaky fails (retryable) before attempt `succeed_on`
SHARDS = [{"key": "once-0", "payload": {"succeed_on": 1}},
          {"key": "once-1", "payload": {"succeed_on": 1}},
          {"key": "twice-0", "payload": {"succeed_on": 2}},
          {"key": "twice-1", "payload": {"succeed_on": 2}}]
ATTEMPTS = Counter({("once-0", 1, "done"): 1, ("once-1", 1, "done"): 1,
                    ("twice-0", 1, "retry"): 1, ("twice-0", 2, "done"): 1,
                    ("twice-1", 1, "retry"): 1, ("twice-1", 2, "done"): 1})


def field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def worker_env(jaeger: jaeger_support.Jaeger) -> list[dict[str, Any]]:
    """What a user puts in spec.template.env to trace a run's workers: the OTEL_* variables
    and the pod's identity as resource attributes (the downward API; `$(VAR)` refers to
    the variables above it)."""
    return [field("POD_NAME", "metadata.name"), field("POD_NAMESPACE", "metadata.namespace"),
            field("NODE_NAME", "spec.nodeName"),
            *({"name": k, "value": v} for k, v in jaeger.otel_env("jobrunner-worker").items()),
            {"name": "OTEL_RESOURCE_ATTRIBUTES",
             "value": "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),"
                      "k8s.node.name=$(NODE_NAME)"}]


@pytest.fixture
def jaeger(tmp_path):
    with jaeger_support.Jaeger(tmp_path) as j:
        yield j


def test_worker_pods_trace_to_jaeger_linked_to_the_controllers_enqueue(
        k8s, namespace, dsn, tmp_path, jaeger, capsys):
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    # The chart's controller.extraEnv; POD_ID is the chart's own (the pod's name).
    controller = Controller(k8s, namespace, tmp_path / "controller.log",
                            **jaeger.otel_env("jobrunner-controller",
                                              OTEL_RESOURCE_ATTRIBUTES="k8s.pod.name=$(POD_ID)"))
    controller.start()
    try:
        apply(k8s, namespace, batchrun(RUN, {
            "tenant": "acme", "workers": 2, "handler": "tests.support.handlers:flaky",
            "maxAttempts": 3, "shards": SHARDS, **FAST,
            "template": {"env": worker_env(jaeger)}}))
        status = wait_phase(k8s, RUN, namespace, ("Succeeded", "Failed"), timeout=240,
                            controller=controller)["status"]
        assert status["phase"] == "Succeeded", status
        batch_id = status["batchId"]
        pods = {p["metadata"]["name"] for p in pods_of(k8s, namespace)
                if p["metadata"]["labels"].get("jobrunner.dev/batchrun") == RUN}
        assert pods, "the run's worker pods"

        # -- the controller's enqueue: the PRODUCER span ---------------------------------
        def enqueued() -> list[dict[str, Any]]:
            return [t for t in jaeger.traces("jobrunner-controller")
                    if any(s["operationName"] == f"enqueue {batch_id}" for s in t["spans"])]

        produced = wait_for(enqueued, timeout=30, what="the controller's enqueue in jaeger")
        ((trace, enqueue),) = [(t, s) for t in produced for s in t["spans"]
                               if s["operationName"] == f"enqueue {batch_id}"]
        assert kind(enqueue) == "producer" and parent(enqueue) is None
        tg = tags(enqueue)
        assert tg["messaging.system"] == "jobrunner"
        assert tg["messaging.operation.type"] == "send"
        assert tg["messaging.destination.name"] == batch_id
        assert tg["messaging.batch.message_count"] == len(SHARDS)
        assert tg["jobrunner.tenant"] == "acme"
        service, resource = process(trace, enqueue)
        assert service == "jobrunner-controller"
        assert resource["k8s.pod.name"] == controller.pod_name
        producer = (enqueue["traceID"], enqueue["spanID"])
        # what the controller stored with each task is that span's context
        with psycopg.connect(dsn) as conn:
            stored = conn.execute("SELECT trace_context->>'traceparent' FROM agent_work_queue"
                                  " WHERE batch_id = %s", (batch_id,)).fetchall()
        assert sorted(tp.split("-")[1:3] for (tp,) in stored) == [list(producer)] * len(SHARDS)

        # -- each attempt in a worker pod: a CONSUMER span linked to it ------------------
        def attempts() -> list[dict[str, Any]]:
            found = jaeger.traces("jobrunner-worker")
            n = sum(s["operationName"] == "process" for t in found for s in t["spans"])
            return found if n >= sum(ATTEMPTS.values()) else []

        traces = wait_for(attempts, timeout=30, what="the attempts' spans in jaeger")
        show(capsys, "trace tree (tests/e2e/test_tracing_e2e.py), the controller's enqueue "
             "then the worker pods' attempts:\n" + render(produced + traces, services=True))
        seen: Counter[tuple[str, int, str]] = Counter()
        for t in traces:
            for span in t["spans"]:
                if span["operationName"] != "process":
                    continue
                tg = tags(span)
                key, attempt, outcome = (tg["jobrunner.task.key"], tg["jobrunner.attempt"],
                                         tg["jobrunner.outcome"])
                seen[(key, attempt, outcome)] += 1
                assert kind(span) == "consumer"
                assert parent(span) is None, "an attempt's span is a root, not a child"
                assert refs(span, "FOLLOWS_FROM") == [producer], "linked to the enqueue"
                assert span["traceID"] != producer[0]
                assert tg["messaging.system"] == "jobrunner"
                assert tg["messaging.operation.type"] == "process"
                assert tg["messaging.destination.name"] == batch_id
                assert tg["jobrunner.batch"] == batch_id and tg["jobrunner.tenant"] == "acme"
                assert tg["jobrunner.max_attempts"] == 3
                assert tg["otel.status_code"] == ("OK" if outcome == "done" else "ERROR")
                service, resource = process(t, span)
                assert service == "jobrunner-worker"
                assert resource["k8s.pod.name"] in pods, (resource, pods)
                assert resource["k8s.namespace.name"] == namespace
                assert resource["k8s.node.name"] == "127.0.0.1"  # the e2e node's name
                assert resource["telemetry.sdk.language"] == "python"
        assert seen == ATTEMPTS, seen
    finally:
        controller.stop()
