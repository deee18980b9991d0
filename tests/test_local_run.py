"""`jobrunner run`: the README's main command, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from tests.support.processes import REPO, child_env, cli, wait_for

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


def test_run_says_when_the_budget_stops_it_and_resumes_when_raised(dsn, tmp_path):
    """A local run whose budget is used up says so on its progress line (instead of a bar
    that just stops), and `jobrunner budget set` from another shell lets it finish."""
    from tests.support.limits_handlers import LOG_DDL

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOG_DDL)
    manifest = tmp_path / "budget.yaml"
    shards = "\n".join(f"    - {{key: k{i}, payload: {{actual: 10, sleep: 0.05}}}}"
                       for i in range(6))
    manifest.write_text(f"""
apiVersion: jobrunner.dev/v1alpha1
kind: BatchRun
metadata: {{name: budget}}
spec:
  tenant: t
  handler: tests.support.limits_handlers:paced
  budget: {{tokens: 30}}
  shards:
{shards}
""")
    env = child_env(dsn, TTY_COMPATIBLE="1", TTY_INTERACTIVE="1", COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "jobrunner", "run", str(manifest),
                             "--batch", "budget-1", "--dsn", dsn],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(lambda: conn.execute(
                "SELECT tokens >= budget_tokens FROM agent_batch_usage WHERE batch_id = %s",
                ("budget-1",)).fetchone() == (True,), timeout=60, what="budget used up")
            time.sleep(1.0)  # a few refreshes of the progress line
            stopped = conn.execute("SELECT count(*) FROM agent_work_queue WHERE batch_id = %s"
                                   " AND status = 'pending'", ("budget-1",)).fetchone()[0]
        assert stopped > 0
        cli("budget", "set", "--batch", "budget-1", "--tokens", "1000", "--dsn", dsn, check=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "budget exhausted" in out and "jobrunner budget set --batch budget-1" in out, out
