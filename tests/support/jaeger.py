"""A real Jaeger (github.com/jaegertracing/jaeger cmd/jaeger, built from the Go module proxy
and cached by tests/e2e/harness/build.py, like the cluster's binaries) for the trace tests:
an OTLP/HTTP receiver, its in-memory store and its query API, all on 127.0.0.1 ports of
its own (several pytest workers each run one).

    with Jaeger(tmp_path) as jaeger:
        env = jaeger.otel_env("jobrunner-worker")
        ...
        traces = jaeger.traces("jobrunner-worker")

and the helpers that read Jaeger's JSON model: a span's tags, kind, references and parent,
its process (service name and resource attributes), and `render()`, the trace tree the
trace tests print for the CI log.
"""

from __future__ import annotations

import socket
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from jobrunner.local.embedded import free_port
from tests.e2e.harness import build
from tests.support.processes import ServerProcess

CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: []
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def available() -> bool:
    return build.can_have("jaeger", "jaeger")


def binary() -> Path | None:
    return build.binary("jaeger", "jaeger")


class Jaeger(ServerProcess):
    name = "jaeger"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.query, self.query_grpc, self.otlp = free_port(), free_port(), free_port()

    def __enter__(self) -> Jaeger:
        exe = binary()
        if exe is None:
            raise RuntimeError("jaeger is not built: run `make e2e-bins`")
        config = self.root / "jaeger.yaml"
        config.write_text(CONFIG.format(query=self.query, query_grpc=self.query_grpc,
                                        otlp=self.otlp))
        self._launch([str(exe), "--config", f"file:{config}"])
        return self

    def _ready(self) -> bool:
        try:
            self._get("/api/services")
            with socket.create_connection(("127.0.0.1", self.otlp), timeout=1):
                return True
        except (OSError, httpx.HTTPError):
            return False

    def _get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"http://127.0.0.1:{self.query}{path}", params=params,
                             timeout=10)
        response.raise_for_status()
        return response.json()

    def otel_env(self, service: str, **extra: str) -> dict[str, str]:
        """The standard OTEL_* variables that send a process's traces here."""
        return {"OTEL_SERVICE_NAME": service, "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.otlp}",
                "OTEL_BSP_SCHEDULE_DELAY": "200", **extra}

    def services(self) -> list[str]:
        return self._get("/api/services").get("data") or []

    def traces(self, service: str, limit: int = 1000) -> list[dict[str, Any]]:
        """Every trace of `service` the query API returns (Jaeger's JSON model: spans with
        references, tags and logs; processes by id)."""
        return self._get("/api/traces", service=service, limit=limit,
                         lookback="1h").get("data") or []

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        try:
            found = self._get(f"/api/traces/{trace_id}").get("data") or []
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return None
            raise
        return found[0] if found else None


def tags(span: dict[str, Any]) -> dict[str, Any]:
    return {t["key"]: t["value"] for t in span.get("tags", [])}


def kind(span: dict[str, Any]) -> str | None:
    return tags(span).get("span.kind")


def refs(span: dict[str, Any], ref_type: str) -> list[tuple[str, str]]:
    return [(r["traceID"], r["spanID"]) for r in span.get("references", [])
            if r["refType"] == ref_type]


def parent(span: dict[str, Any]) -> str | None:
    """The parent span's id (a CHILD_OF reference within the same trace)."""
    for trace_id, span_id in refs(span, "CHILD_OF"):
        if trace_id == span["traceID"]:
            return span_id
    return None


def process(trace: dict[str, Any], span: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The span's service name and resource attributes (Jaeger's "process")."""
    p = trace["processes"][span["processID"]]
    return p["serviceName"], {t["key"]: t["value"] for t in p.get("tags", [])}


# (the resource attributes render() shows after a span's service name)
RESOURCE_SHOWN = ("k8s.pod.name", "k8s.namespace.name", "k8s.node.name")


def render(traces: list[dict[str, Any]], services: bool = False) -> str:
    """Every trace as an indented tree: span name, kind, the attributes that matter, its
    status and events, and its links; with `services`, each span's service name and the
    pod it ran in (RESOURCE_SHOWN)."""
    shown = ("jobrunner.task.key", "jobrunner.attempt", "jobrunner.outcome", "error.type",
             "otel.status_code", "jobrunner.usage.tokens", "gen_ai.usage.input_tokens",
             "gen_ai.usage.output_tokens", "http.response.status_code",
             "messaging.batch.message_count", "results")
    lines: list[str] = []

    def start(span: dict[str, Any]) -> int:
        return int(span["startTime"])

    for t in sorted(traces, key=lambda t: min(start(s) for s in t["spans"])):
        spans = t["spans"]
        children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
        for s in spans:
            children[parent(s)].append(s)
        lines.append(f"trace {t['traceID']}")

        def walk(span: dict[str, Any], depth: int,
                 children: dict[str | None, list[dict[str, Any]]] = children,
                 t: dict[str, Any] = t) -> None:
            tg = tags(span)
            attrs = " ".join(f"{k.removeprefix('jobrunner.').removeprefix('gen_ai.usage.')}"
                             f"={tg[k]}" for k in shown if k in tg)
            events = ",".join(sorted({f['value'] for log in span.get('logs', [])
                                      for f in log['fields'] if f['key'] == 'event'}))
            links = [f"{ti[:8]}/{si[:8]}" for ti, si in refs(span, "FOLLOWS_FROM")]
            where = ""
            if services:
                service, resource = process(t, span)
                where = f" @{service}" + "".join(f" {k.removeprefix('k8s.')}={resource[k]}"
                                                 for k in RESOURCE_SHOWN if k in resource)
            lines.append("  " * (depth + 1) + f"{span['operationName']} [{kind(span)}] {attrs}"
                         + (f" events={events}" if events else "")
                         + (f" link->{','.join(links)}" if links else "") + where)
            for c in sorted(children[span["spanID"]], key=start):
                walk(c, depth + 1)

        for root in sorted(children[None], key=start):
            walk(root, 0)
    return "\n".join(lines)
