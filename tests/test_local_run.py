"""`jobrunner run`: the README's main command, end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg

from tests.conftest import REPO, cli

EXAMPLE = REPO / "examples" / "summarise.yaml"


def test_run_example_on_a_server(dsn):
    r = cli("run", str(EXAMPLE), "--workers", "3", "--batch", "demo-1", "--dsn", dsn, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "48 task(s) enqueued" in r.stdout
    assert "done" in r.stdout and "throughput" in r.stdout
    status = json.loads(cli("status", "--batch", "demo-1", "--json", dsn=dsn).stdout)
    assert status["done"] == 48 and status["dead"] == 0
    with psycopg.connect(dsn) as conn:
        stored = conn.execute("SELECT count(*) FROM demo_chunk_summary").fetchone()[0]
        retried = conn.execute("SELECT count(*) FROM agent_work_queue WHERE attempts > 1"
                               ).fetchone()[0]
    assert stored == 48  # one summary per chunk, written once through the effects ledger
    assert retried >= 5  # the simulated rate limits were retried
    again = cli("run", str(EXAMPLE), "--batch", "demo-1", "--dsn", dsn, timeout=120)
    assert again.returncode == 0
    assert "0 task(s) enqueued, 48 already there" in again.stdout


def test_run_on_embedded_postgres(tmp_path: Path):
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text("""
apiVersion: jobrunner.dev/v1alpha1
kind: BatchRun
metadata: {name: tiny}
spec:
  tenant: t
  workers: 2
  handler: tests.support.handlers:noop
  shardRange: {count: 20}
""")
    env = {k: v for k, v in os.environ.items() if k != "JOBRUNNER_DATABASE_URL"}
    env["PYTHONPATH"] = str(REPO)
    r = cli("run", str(manifest), "--data-dir", str(tmp_path / "pg"), env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "embedded PostgreSQL" in r.stdout
    assert "20 task(s) enqueued" in r.stdout
    assert not (tmp_path / "pg" / "pgdata" / "postmaster.pid").exists()  # stopped after


def test_run_reports_dead_tasks_with_exit_code_3(dsn, tmp_path):
    manifest = tmp_path / "poison.yaml"
    manifest.write_text("""
apiVersion: jobrunner.dev/v1alpha1
kind: BatchRun
metadata: {name: poison}
spec:
  tenant: t
  handler: tests.support.handlers:poison_or_record
  shards:
    - {key: ok, payload: {}}
    - {key: bad, payload: {poison: true}}
""")
    r = cli("run", str(manifest), "--dsn", dsn, timeout=120)
    assert r.returncode == 3
    assert "dead tasks" in r.stdout and "poison task bad" in r.stdout


def test_run_rejects_bad_manifest(tmp_path):
    manifest = tmp_path / "bad.yaml"
    manifest.write_text("""
apiVersion: jobrunner.dev/v1alpha1
kind: BatchRun
metadata: {name: bad}
spec: {tenant: t, handler: "m:f", shardRange: {count: 2}, workers: 0}
""")
    r = cli("run", str(manifest), "--dsn", "postgresql://nowhere.invalid/x")
    assert r.returncode == 2
    assert "spec.workers must be between 1 and 1000" in r.stderr
