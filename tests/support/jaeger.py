"""A real Jaeger (github.com/jaegertracing/jaeger cmd/jaeger, built from the Go module proxy
and cached by tests/e2e/harness/build.py, like the cluster's binaries) for the trace tests:
an OTLP/HTTP receiver, its in-memory store and its query API, all on 127.0.0.1 ports of
its own (several pytest workers each run one).

    with Jaeger(tmp_path) as jaeger:
        env = jaeger.otel_env("jobrunner-worker")
        ...
        traces = jaeger.traces("jobrunner-worker")
"""

from __future__ import annotations

import socket
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
