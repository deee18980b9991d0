"""The queue's Prometheus metrics (jobrunner/observability/metrics.py), in-process against
a real PostgreSQL: what a worker observes of each attempt (queue wait by the database's
clock, run time by outcome, reported usage), nothing while the metrics are not served,
the database's gauges of a batch as `jobrunner metrics` reads them (stuck tasks, oldest
pending age, reduce state), and bounded label sets. (The same through a real Prometheus
and every dashboard panel: tests/test_dashboard.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import pytest
from prometheus_client import REGISTRY

from jobrunner.features.metrics import LIMITS, Exporter
from jobrunner.features.reduce import ReduceSpec
from jobrunner.model.validation import TaskSpec
from jobrunner.observability import metrics
from jobrunner.queue.client import Queue
from jobrunner.store import flowcontrol as limits
from jobrunner.worker.config import WorkerConfig
from jobrunner.worker.process import Worker
from tests.support.metrics_handlers import work


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def drain(dsn: str, batch: str) -> Worker:
    worker = Worker(WorkerConfig(dsn=dsn, batch_id=batch, handler=work, concurrency=2,
                                 visibility_timeout=30, backoff_base=0.05, backoff_cap=0.1,
                                 exit_when_drained=True, listen=False,
                                 idle_poll=(0.02, 0.05)))
    worker.run()
    return worker


@pytest.fixture
def observing():
    metrics.enable()
    yield
    metrics.enable(False)


def test_a_worker_observes_each_attempt(dsn, conn, observing):
    batch = f"b-{uuid.uuid4().hex[:8]}"
    Queue(conn).enqueue(batch, "acme", [
        TaskSpec("ok", {"sleep": 1.2}), TaskSpec("flaky", {"sleep": 0, "fail_once": True}),
        TaskSpec("poison", {"sleep": 0, "poison": True})], max_attempts=3)
    conn.commit()
    time.sleep(1.0)  # every first attempt waits at least this long, due, before its claim
    drain(dsn, batch)

    ids = {"batch": batch, "tenant": "acme"}
    assert sample("jobrunner_task_queue_wait_seconds_count", **ids, attempt="first") == 3
    assert sample("jobrunner_task_queue_wait_seconds_count", **ids, attempt="retry") == 1
    # the first claims waited the second slept (and not the lease's length: the claim
    # time is the lease's deadline less the visibility timeout, both the database's)
    assert sample("jobrunner_task_queue_wait_seconds_bucket", **ids, attempt="first",
                  le="0.5") == 0
    assert sample("jobrunner_task_queue_wait_seconds_bucket", **ids, attempt="first",
                  le="10.0") == 3
    # the retry was claimed once its short backoff ended
    assert sample("jobrunner_task_queue_wait_seconds_bucket", **ids, attempt="retry",
                  le="1.0") == 1
    runs = {o: sample("jobrunner_task_run_seconds_count", **ids, outcome=o)
            for o in ("done", "retry", "dead")}
    assert runs == {"done": 2, "retry": 1, "dead": 1}
    # the outcomes that did not happen are there from 0 (so that rate() sees the first)
    assert sample("jobrunner_task_run_seconds_count", **ids, outcome="lease_lost") == 0
    # ok slept 1.2 s in its handler, flaky's retry not at all: one run in the 1 s bucket
    # (with ok at 0.2 s and the 0.1 s bucket, the no-op run alone took over 0.1 s in a
    # cold CI run, its 2 cores shared by 30-50 runnable processes)
    assert sample("jobrunner_task_run_seconds_bucket", **ids, outcome="done", le="1.0") == 1
    assert sample("jobrunner_task_run_seconds_sum", **ids, outcome="done") >= 1.2
    assert sample("jobrunner_task_tokens_total", **ids) == (120 + 2) + (120 + 5)
    assert sample("jobrunner_task_cost_total", **ids) == pytest.approx(0.0024)
    assert sample("jobrunner_worker_busy_slots") == 0
    assert sample("jobrunner_worker_slots") == 0  # (the worker stopped: its slots went)


def test_nothing_is_observed_while_the_metrics_are_not_served(dsn, conn):
    batch = f"b-{uuid.uuid4().hex[:8]}"
    Queue(conn).enqueue(batch, "acme", [TaskSpec("ok", {"sleep": 0})])
    conn.commit()
    assert not metrics.enabled()
    drain(dsn, batch)
    assert sample("jobrunner_task_run_seconds_count", batch=batch, tenant="acme",
                  outcome="done") is None
    assert sample("jobrunner_task_tokens_total", batch=batch, tenant="acme") is None


def test_the_exporter_reads_the_batches_and_limits(conn):
    batch = f"b-{uuid.uuid4().hex[:8]}"
    queue = Queue(conn)
    limits.set_limit(conn, "llm", requests=10, per=60, max_concurrent=2)
    queue.enqueue(batch, "globex", [TaskSpec(f"t{i}", {}) for i in range(4)], limits=["llm"],
                  reduce=ReduceSpec(handler="tests.support.metrics_handlers:count",
                                    on_dead="include").as_json())
    conn.commit()
    # one task leased past its deadline by a worker that died (no sweeper ran since),
    # one done, one dead; the oldest pending task was enqueued a minute ago
    conn.execute("UPDATE agent_work_queue SET status = 'leased', attempts = 1, "
                 "lease_owner = 'gone', locked_until = now() - interval '5 minutes' "
                 "WHERE batch_id = %s AND task_key = 't0'", (batch,))
    conn.execute("UPDATE agent_work_queue SET created_at = now() - interval '60 seconds' "
                 "WHERE batch_id = %s AND task_key = 't1'", (batch,))
    conn.commit()
    exporter = Exporter(queue)
    assert exporter.look() >= 1

    ids = {"batch": batch, "tenant": "globex"}
    assert {s: sample("jobrunner_batch_tasks", **ids, status=s)
            for s in ("pending", "leased", "done", "dead", "cancelled")} == {
        "pending": 3, "leased": 1, "done": 0, "dead": 0, "cancelled": 0}
    assert sample("jobrunner_batch_stuck_tasks", **ids) == 1
    assert sample("jobrunner_batch_ready_tasks", **ids) == 3
    assert 59 <= sample("jobrunner_batch_oldest_pending_age_seconds", **ids) < 120
    assert sample("jobrunner_batch_reduce_state", **ids, state="waiting") == 1
    assert sample("jobrunner_batch_reduce_state", **ids, state="done") == 0
    assert sample("jobrunner_batch_generator_state", **ids, state="Running") is None
    assert sample("jobrunner_limit_capacity", limit="llm", resource="concurrency") == 2
    assert sample("jobrunner_limit_blocked_seconds_total", limit="llm") == 0

    # the batch is cancelled (its stuck task given up too): read once more (its final
    # counts), then no more
    queue.cancel(batch)
    conn.execute("UPDATE agent_work_queue SET status = 'cancelled', locked_until = NULL, "
                 "lease_owner = NULL WHERE batch_id = %s AND status = 'leased'", (batch,))
    conn.commit()
    exporter.look()
    assert sample("jobrunner_batch_tasks", **ids, status="cancelled") == 4
    assert sample("jobrunner_batch_stuck_tasks", **ids) == 0
    assert sample("jobrunner_batch_oldest_pending_age_seconds", **ids) == 0
    assert sample("jobrunner_batch_reduce_state", **ids, state="cancelled") == 1
    assert batch not in exporter._watched
    assert LIMITS.snapshot()


def test_a_batch_not_seen_for_long_loses_its_series(monkeypatch, observing):
    collector = metrics.BatchCollector(stale_seconds=0.2)
    collector.update(metrics.BatchGauges("old", "acme", {"pending": 1}, 0, 1, 3.0))
    assert [g.batch for g in collector.snapshot()] == ["old"]
    time.sleep(0.3)
    assert collector.snapshot() == []

    # a worker's own series of a batch it no longer serves go too
    monkeypatch.setattr(metrics, "STALE_SECONDS", 0.2)
    monkeypatch.setattr(metrics, "_SWEEP_EVERY", 0.0)
    metrics.ran("gone-batch", "acme", "done", 0.1)
    assert sample("jobrunner_task_run_seconds_count", batch="gone-batch", tenant="acme",
                  outcome="done") == 1
    time.sleep(0.3)
    metrics.ran("live-batch", "acme", "done", 0.1)
    assert sample("jobrunner_task_run_seconds_count", batch="gone-batch", tenant="acme",
                  outcome="done") is None
    assert sample("jobrunner_task_run_seconds_count", batch="live-batch", tenant="acme",
                  outcome="done") == 1


def test_jobrunner_metrics_serves_the_gauges(dsn, conn, tmp_path):
    # the command as a real process: the open batch's gauges at its /metrics
    from jobrunner.local.embedded import free_port
    from tests.support.processes import REPO, child_env, spawned, wait_for

    Queue(conn).enqueue("served", "acme", [TaskSpec("a", {}), TaskSpec("b", {})])
    conn.commit()
    port = free_port()
    log = tmp_path / "metrics.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jobrunner", "metrics", "--port",
                                 str(port), "--host", "127.0.0.1", "--interval", "0.5"],
                                env=child_env(dsn), cwd=REPO, stdout=out, stderr=out,
                                start_new_session=True)
    spawned.append(proc)

    def scraped() -> str:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except httpx.HTTPError:
            return ""

    text = wait_for(scraped, timeout=30, what="jobrunner metrics' endpoint")
    assert 'jobrunner_batch_tasks{batch="served",status="pending",tenant="acme"} 2.0' in text, \
        log.read_text()[-2000:]
    assert "postgresql://" not in text and "password" not in text.lower()
    proc.terminate()
    assert proc.wait(10) == 0


def test_the_exporter_follows_a_settled_batch_until_its_reduce_is_done(dsn, conn):
    # every task done, its reduce due but not enqueued yet: the batch has nothing pending
    # or leased, yet the exporter must look again until the reduce ran (enqueued and done
    # between two looks, it would never be seen open)
    batch = f"b-{uuid.uuid4().hex[:8]}"
    queue = Queue(conn)
    queue.enqueue(batch, "acme", [TaskSpec("a", {}), TaskSpec("b", {})],
                  reduce=ReduceSpec(handler="tests.support.metrics_handlers:count").as_json())
    conn.execute("UPDATE agent_work_queue SET status = 'done' WHERE batch_id = %s", (batch,))
    conn.commit()
    exporter = Exporter(queue)
    exporter._watched[batch] = "acme"  # (seen open by an earlier look)
    exporter.look()
    ids = {"batch": batch, "tenant": "acme"}
    assert sample("jobrunner_batch_reduce_state", **ids, state="due") == 1
    drain(dsn, batch)  # a worker enqueues the reduce and runs it
    exporter.look()
    assert sample("jobrunner_batch_reduce_state", **ids, state="done") == 1
    assert sample("jobrunner_batch_reduce_state", **ids, state="due") == 0
    assert batch not in exporter._watched
