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

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from jobrunner.local.embedded import free_port
from tests.e2e.harness import build

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


def path() -> Path:
    return build.JAEGER.dir() / "bin" / "jaeger"


def available() -> bool:
    """Built, or buildable here (a cheap check for collection time)."""
    return os.access(path(), os.X_OK) or build.go_available()


def binary() -> Path | None:
    """The jaeger binary, built first if it is missing (`make test` builds it in the
    background while the suite runs: this waits for that build), or None without Go."""
    if not available():
        return None
    build.ensure("jaeger")
    return path()


class Jaeger:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.query, self.query_grpc, self.otlp = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Jaeger:
        exe = binary()
        if exe is None:
            raise RuntimeError("jaeger is not built: run `make e2e-bins`")
        config = self.root / "jaeger.yaml"
        config.write_text(CONFIG.format(query=self.query, query_grpc=self.query_grpc,
                                        otlp=self.otlp))
        self.log = self.root / "jaeger.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([str(exe), "--config", f"file:{config}"],
                                         stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("jaeger did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

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
