"""The chart's Grafana dashboard (charts/jobrunner/files/dashboard.json), checked against a
real Prometheus scraping real jobrunner processes during a real run.

Prometheus (cmd/prometheus v0.316.0, built from the Go module proxy like the e2e binaries)
scrapes, on 127.0.0.1 with static targets, two `jobrunner worker --metrics-port` processes
and a `jobrunner metrics` exporter (the database's gauges, the same ones the controller
exports from its BatchRuns' refreshes: no cluster needed) while they run two batches on a
real PostgreSQL: one tenant's batch with a limit, a rate-limited answer, a retry, a dead
task and a reduce step; another tenant's batch made by a generator. Then every panel's
every query, as Grafana sends it with all batches and tenants selected, is evaluated over
the run through Prometheus's HTTP API and must return data: a typo'd metric name or label
fails here. The panels are drawn from those answers (tests/support/dashboard.py; with
JOBRUNNER_DASHBOARD_PNG_DIR set, into that directory: `python hack/dashboard_pngs.py`
regenerates docs/observability/*.png).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from jobrunner.features.generators import GeneratorSpec
from jobrunner.features.generators import start as start_generator
from jobrunner.features.reduce import ReduceSpec
from jobrunner.local.embedded import free_port
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store import flowcontrol as limits
from tests.e2e.harness import build
from tests.support import dashboard, helm
from tests.support import prometheus as prometheus_support
from tests.support.helm import needs_helm
from tests.support.processes import REPO, child_env, spawned, start_worker, wait_for

PROMTOOL = build.PROMETHEUS.dir() / "bin" / "promtool"
ROWS = ["Overview", "Per batch", "Per tenant", "Limits", "Workers"]
FAST = ["--visibility-timeout", "10", "--heartbeat", "1", "--backoff-base", "0.2",
        "--backoff-cap", "0.5", "--concurrency", "2"]
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval for a 1 s scrape: 4 scrapes, plus margin


def test_the_dashboard_has_its_rows_and_queries():
    board = dashboard.load()
    found = dashboard.panels(board)
    assert [r["title"] for r in board["panels"] if r["type"] == "row"] == ROWS
    assert len(found) >= 15 and all(p.queries for p in found)
    assert {v["name"] for v in board["templating"]["list"]} >= {"batch", "tenant"}
    for panel in found:
        for q in panel.queries:
            assert "jobrunner_" in q.expr or "up{" in q.expr, (panel.title, q.expr)
            # per task would be unbounded: no panel may split by a task's key or id
            assert "task_key" not in q.expr and "task_id" not in q.expr


@pytest.mark.skipif(not os.access(PROMTOOL, os.X_OK) and not build.go_available(),
                    reason="promtool is not built and go is missing: make e2e-bins")
def test_every_panel_query_parses(tmp_path):
    build.ensure("prometheus")  # (`make test` builds it in the background: wait for it)
    # promtool checks each filled-in query as a recording rule: PromQL syntax, fast, and
    # without a run (the run below says whether each returns data)
    rules = [{"record": f"dashboard:panel{i}_{q.ref}",
              "expr": dashboard.fill(q.expr, rate_interval=RATE_INTERVAL, range_="1h")}
             for i, panel in enumerate(dashboard.panels(dashboard.load()))
             for q in panel.queries]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


@needs_helm
def test_the_chart_ships_the_dashboard_for_the_grafana_sidecar():
    out = helm.template("--set", "metrics.grafanaDashboard.enabled=true").stdout
    (cm,) = [d for d in yaml.safe_load_all(out)
             if d and d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["jobrunner.json"].strip() == dashboard.DASHBOARD.read_text().strip()
    off = helm.template().stdout
    assert "grafana_dashboard" not in off


def _exporter(dsn: str, port: int, log: Path) -> subprocess.Popen:
    stream = open(log, "ab")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "jobrunner", "metrics", "--port", str(port),
                             "--host", "127.0.0.1", "--interval", "1"],
                            env=child_env(dsn), cwd=REPO, stdout=stream, stderr=stream,
                            start_new_session=True)
    spawned.append(proc)  # (reaped by tests/conftest.py, like the workers)
    return proc


def _scraped(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return ""


def _has_data(answer: list[dict]) -> bool:
    return any(series["values"] for series in answer)


@pytest.mark.skipif(not prometheus_support.available(),
                    reason="prometheus is not built: run `make e2e-bins`")
def test_every_panel_returns_data_from_a_real_run(dsn, conn, tmp_path):
    queue = Queue(conn)
    limits.set_limit(conn, "llm", requests=4, per=2)  # tasks wait behind it
    # (sleeps of several lengths: a scrape every second must not always fall in the same
    # phase of the limit's rhythm; the failing tasks sort last, so Prometheus sees them)
    nightly = [TaskSpec(f"t{i:03d}", {"sleep": 0.2 + (i % 5) * 0.1}) for i in range(24)]
    nightly += [TaskSpec("x-flaky", {"fail_once": True}),
                TaskSpec("x-poison", {"poison": True}),
                TaskSpec("x-busy", {"rate_limited": True})]
    queue.enqueue("nightly", "acme", nightly, max_attempts=3, limits=["llm"],
                  reduce=ReduceSpec(handler="tests.support.metrics_handlers:count",
                                    on_dead="include").as_json())
    start_generator(conn, "backfill", "globex",
                    GeneratorSpec(handler="tests.support.metrics_handlers:rows",
                                  args={"count": 20}, chunk_size=5))
    conn.commit()

    ports = {"exporter": free_port(), "nightly": free_port(), "backfill": free_port()}
    # (Prometheus first, so that it sees the run from its start)
    with prometheus_support.Prometheus(tmp_path, {
            "worker": [ports["nightly"], ports["backfill"]],
            "exporter": [ports["exporter"]]}) as prom:
        start = time.time()
        _exporter(dsn, ports["exporter"], tmp_path / "exporter.log")
        workers = {batch: start_worker(dsn, batch, "tests.support.metrics_handlers:work",
                                       "--metrics-port", str(ports[batch]), *FAST,
                                       log=tmp_path / f"{batch}.log")
                   for batch in ("nightly", "backfill")}
        for name, port in ports.items():
            wait_for(lambda port=port: _scraped(port), timeout=30, what=f"{name}'s /metrics")

        def settled() -> bool:
            rows = conn.execute(
                "SELECT count(*) FILTER (WHERE status IN ('pending', 'leased')) AS open, "
                "count(*) FILTER (WHERE task_key = '__reduce__' AND status = 'done') AS reduced "
                "FROM agent_work_queue").fetchone()
            conn.rollback()
            return rows["open"] == 0 and rows["reduced"] == 1

        wait_for(settled, timeout=120, interval=0.5, what="both batches to finish")
        time.sleep(4)  # the exporter's last look, and Prometheus's scrapes of it
        assert set(prom.targets_up().values()) == {"up"}, prom.targets_up()
        for proc in workers.values():
            assert proc.poll() is None, "a worker died"
        end = time.time()

        board = dashboard.load()
        window = f"{int(end - start) + 60}s"
        answers, empty = {}, []
        for panel in dashboard.panels(board):
            for q in panel.queries:
                expr = dashboard.fill(q.expr, rate_interval=RATE_INTERVAL, range_=window)
                answers[(panel.title, q.ref)] = prom.query_range(expr, start, end, step=1)
                if not _has_data(answers[(panel.title, q.ref)]):
                    empty.append(f"{panel.row} / {panel.title} [{q.ref}]: {expr}")
        assert empty == [], "panels whose query returns no data:\n" + "\n".join(empty)

        # the check sees a typo'd metric: the first panel's query, one letter off
        first = dashboard.panels(board)[0].queries[0]
        typo = dashboard.fill(first.expr.replace("jobrunner_batch_tasks", "jobrunner_batch_task"),
                              rate_interval=RATE_INTERVAL, range_=window)
        assert not _has_data(prom.query_range(typo, start, end, step=1))

        # and the data says what happened
        def last(expr: str) -> dict[str, float]:
            return {",".join(f"{k}={v}" for k, v in sorted(s["metric"].items())):
                    float(s["value"][1]) for s in prom.query(expr, at=end)}

        assert last('sum by (batch, status) (jobrunner_batch_tasks{status=~"done|dead"})') == {
            "batch=backfill,status=dead": 0, "batch=backfill,status=done": 20,
            "batch=nightly,status=dead": 1, "batch=nightly,status=done": 26}
        outcomes = last('sum by (outcome) (jobrunner_task_run_seconds_count{batch="nightly"})')
        assert outcomes == {"outcome=done": 27, "outcome=retry": 1, "outcome=dead": 1,
                            "outcome=rate_limited": 1, "outcome=lease_lost": 0}, outcomes
        # (27 done: the reduce's too; lease_lost there from 0, as every outcome)
        assert last('jobrunner_batch_reduce_state{batch="nightly"} == 1') == {
            "__name__=jobrunner_batch_reduce_state,batch=nightly,instance=127.0.0.1:"
            f"{ports['exporter']},job=jobrunner-exporter,jobrunner_component=exporter,"
            "state=done,tenant=acme": 1}
        tokens = last("sum by (tenant) (jobrunner_task_tokens_total)")
        # (each task's one successful attempt reports 100 + len(key) + 20 tokens)
        assert tokens == {"tenant=acme": sum(120 + len(t.key) for t in nightly
                                             if t.key != "x-poison"),
                          "tenant=globex": 20 * (120 + len("row0000"))}, tokens
        # no task keys among the labels of any jobrunner series
        names = prom._get("/api/v1/labels")
        assert "task_key" not in names and "key" not in names, names

        written = dashboard.render(answers, tmp_path / "png", board)
        assert [p.name for p in written] == [f"dashboard-{r.lower().replace(' ', '-')}.png"
                                            for r in ROWS]
        assert all(p.stat().st_size > 10_000 for p in written)
        target = os.environ.get("JOBRUNNER_DASHBOARD_PNG_DIR")
        if target:
            dashboard.render(answers, Path(target), board)


@needs_helm
def test_the_chart_scrapes_the_workers_as_the_dashboard_expects():
    out = helm.template("--set", "metrics.podMonitor.enabled=true",
                        "--set", "worker.metricsPort=9090").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    # the labels jobs.py gives every worker pod, its port's name, and the component label
    # the dashboard's Workers row selects
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "jobrunner-worker", "app.kubernetes.io/managed-by": "jobrunner"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["relabelings"] == [{"targetLabel": "jobrunner_component",
                                        "replacement": "worker"}]
    (controller,) = [d for d in docs if d["kind"] == "Deployment"
                     and d["metadata"]["name"] == "t-jobrunner"]
    env = {e["name"]: e.get("value") for c in controller["spec"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}
    assert env["JOBRUNNER_WORKER_METRICS_PORT"] == "9090"
    refused = helm.template("--set", "metrics.podMonitor.enabled=true", check=False)
    assert refused.returncode != 0 and "needs worker.metricsPort" in refused.stderr
