"""A real Prometheus (github.com/prometheus/prometheus cmd/prometheus, built from the Go
module proxy and cached by tests/e2e/harness/build.py) scraping jobrunner processes on
127.0.0.1 with static targets, queried through its HTTP API (tests/test_dashboard.py,
docs/observability/render.py).

    with Prometheus(tmp_path, {"worker": [port1, port2], "exporter": [port3]}) as prom:
        prom.query_range('sum(jobrunner_batch_tasks)', start, end, step=1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from jobrunner.local.embedded import free_port
from tests.e2e.harness import build
from tests.support.processes import ServerProcess


def available() -> bool:
    return build.can_have("prometheus", "prometheus")


def binary() -> Path | None:
    return build.binary("prometheus", "prometheus")


class Prometheus(ServerProcess):
    """`targets`: the jobrunner_component label (as the chart's monitors set it) -> the
    ports of its processes on 127.0.0.1. Scraped every `interval` seconds."""

    name = "prometheus"

    def __init__(self, root: Path, targets: Mapping[str, Sequence[int]],
                 interval: float = 1.0) -> None:
        self.root = root
        self.targets = targets
        self.interval = interval
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        exe = binary()
        if exe is None:
            raise RuntimeError("prometheus is not built: run `make e2e-bins`")
        every = f"{int(self.interval * 1000)}ms"
        config = {
            "global": {"scrape_interval": every, "scrape_timeout": every,
                       "evaluation_interval": every},
            "scrape_configs": [{
                "job_name": f"jobrunner-{component}",
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports],
                                    "labels": {"jobrunner_component": component}}],
            } for component, ports in self.targets.items()],
        }
        path = self.root / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self._launch([str(exe), f"--config.file={path}",
                      f"--storage.tsdb.path={self.root / 'tsdb'}",
                      f"--web.listen-address=127.0.0.1:{self.port}"])
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=30)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {response.status_code} {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return self._get("/api/v1/query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0
                    ) -> list[dict[str, Any]]:
        """Each series: {"metric": labels, "values": [[t, "v"], ...]}."""
        return self._get("/api/v1/query_range", query=expr, start=start, end=end,
                         step=step)["result"]

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health (up, down, unknown) of every active target."""
        return {t["scrapeUrl"]: t["health"]
                for t in self._get("/api/v1/targets")["activeTargets"]}
