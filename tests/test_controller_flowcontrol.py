"""The BatchRun side of flow control (jobrunner/operator/flowcontrol.py), against a real
PostgreSQL: an unknown limit writes nothing, the budget is applied from the spec and
raised, status shows usage and the limits' use, and the Prometheus metrics render what
`jobrunner limit list` shows. (The same on a real cluster: tests/e2e/test_flow_control_e2e.py.)"""

from __future__ import annotations

from decimal import Decimal

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jobrunner.features.manifest import parse_batchrun
from jobrunner.model.errors import BadInput, RateLimited
from jobrunner.operator import flowcontrol, metrics
from jobrunner.queue.client import Queue
from jobrunner.store import flowcontrol as limits


def _run(**spec):
    return parse_batchrun({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRun",
                           "metadata": {"name": "br", "namespace": "ns"},
                           "spec": {"tenant": "t", "handler": "m:f",
                                    "shards": [{"key": f"k{i}"} for i in range(4)], **spec}})


def _samples() -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_unknown_limit_is_refused_and_nothing_is_written(conn):
    limits.set_limit(conn, "known", requests=5, per=1)
    run = _run(limits=["known", "nope"], tokens=10)
    with pytest.raises(flowcontrol.UnknownLimit) as err:
        flowcontrol.check_limits(Queue(conn), run)
    print(err.value)
    assert "'nope'" in str(err.value) and "jobrunner limit set nope" in str(err.value)
    assert "nothing was enqueued" in str(err.value)
    # (and enqueue itself refuses it too, should the limit go between check and enqueue)
    with pytest.raises(BadInput, match="unknown limit 'nope'"):
        Queue(conn).enqueue("b", "t", run.tasks, **flowcontrol.enqueue_options(run))
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM agent_batch").fetchone()["n"] == 0


def test_budget_from_the_spec_exhausts_and_a_raise_resumes(conn):
    queue = Queue(conn)
    run = _run(limits=["llm"], tokens=100, budget={"tokens": 150, "cost": "0.50"})
    # (slow rates: 1 request and 10 tokens a second refill, so the use read a moment
    # later is still what was charged)
    limits.set_limit(conn, "llm", requests=3600, tokens=36_000, per=3600, max_concurrent=3)
    queue.enqueue("b", "t", run.tasks, **flowcontrol.enqueue_options(run))
    st: dict = {}
    st["budget"] = flowcontrol.apply_budget(queue, run, st, "b")
    assert st["budget"] == {"tokens": 150, "cost": "0.5"}
    used = queue.usage("b", by_status=False)
    assert (used.budget_tokens, used.budget_cost) == (150, Decimal("0.5"))

    lease = queue.claim("b", "w")[0]
    assert conn.execute("SELECT limits, tokens FROM agent_work_queue WHERE id = %s",
                        (lease.id,)).fetchone() == {"limits": ["llm"], "tokens": 100}
    limits.record_usage(conn, lease.id, lease.attempt,
                        limits.Usage.of(input_tokens=150, output_tokens=10, cost="0.1"))
    limits.block_limits(conn, lease.id, RateLimited(retry_after=3, limit="llm"))
    state = flowcontrol.observe(queue, run, st, "b")
    assert state.exhausted
    assert state.status["tokens"] == 160 and state.status["cost"] == "0.1"
    (entry,) = state.status["limits"]
    assert entry["name"] == "llm" and entry["inFlight"] == 1 and entry["maxConcurrent"] == 3
    assert entry["requests"] == 3600 and entry["requestsUsed"] == 1
    assert entry["tokens"] == 36_000
    assert 155 <= entry["tokensUsed"] <= 160  # settled: 160, not the estimate of 100
    assert entry["blockedForSeconds"] in (2, 3) and entry["perSeconds"] == "3600"
    assert entry["throttledSeconds"] == 0  # the block counts from the run's first look
    counts = queue.counts("b")
    phase, reason, message = flowcontrol.budget_phase("Running", "Running", "1/4 done",
                                                      state, counts, "br")
    print(message)
    assert (phase, reason) == ("BudgetExhausted", "BudgetExhausted")
    assert "160 tokens of 150" in message and "3 task(s) wait" in message
    conditions, event = flowcontrol.budget_condition([], phase, message, state, 1)
    assert event and event[:2] == ("Warning", "BudgetExhausted")
    assert conditions[0]["status"] == "True"
    # Still exhausted on the next refresh: no second Event.
    assert flowcontrol.budget_condition(conditions, phase, message, state, 1)[1] is None

    # kubectl patch: the budget raised (tokens) and removed (cost).
    st["limits"] = state.status["limits"]
    raised = _run(limits=["llm"], tokens=100, budget={"tokens": 1000})
    st["budget"] = flowcontrol.apply_budget(queue, raised, st, "b")
    assert st["budget"] == {"tokens": 1000}
    used = queue.usage("b", by_status=False)
    assert (used.budget_tokens, used.budget_cost, used.exhausted) == (1000, None, False)
    state = flowcontrol.observe(queue, raised, st, "b")
    phase, _, _ = flowcontrol.budget_phase("Running", "Running", "", state, counts, "br")
    assert phase == "Running"
    conditions, event = flowcontrol.budget_condition(conditions, phase, "", state, 2)
    assert event and event[:2] == ("Normal", "BudgetResumed")
    assert conditions[0]["status"] == "False" and conditions[0]["reason"] == "BudgetAvailable"


def test_metrics_render_the_limits_and_the_runs_usage(conn):
    queue = Queue(conn)
    limits.set_limit(conn, "metrics-llm", requests=50, tokens=5000, per=100,
                     max_concurrent=4)
    run = _run(limits=["metrics-llm"], tokens=200)
    queue.enqueue("mb", "t", run.tasks, **flowcontrol.enqueue_options(run))
    leases = queue.claim("mb", "w", limit=2)
    assert len(leases) == 2
    limits.record_usage(conn, leases[0].id, 1, limits.Usage.of(tokens=300, cost="0.25"))
    limits.block_limits(conn, leases[0].id, RateLimited(retry_after=5, limit="metrics-llm"))
    state = flowcontrol.observe(queue, run, {}, "mb")
    flowcontrol.record_metrics("ns", "br-metrics", state)
    (limit,) = limits.list_limits(conn, ["metrics-llm"])
    got = _samples()
    print({k: v for k, v in got.items() if "metrics-llm" in str(k) or "br-metrics" in str(k)})

    def at(name, **labels):
        return got[(name, tuple(sorted(labels.items())))]

    lim = {"limit": "metrics-llm"}
    assert at("jobrunner_limit_capacity", **lim, resource="requests") == 50
    assert at("jobrunner_limit_capacity", **lim, resource="tokens") == 5000
    assert at("jobrunner_limit_capacity", **lim, resource="concurrency") == 4
    # (the limit refills half a request and 50 tokens a second: read a moment later,
    # the same numbers minus what refilled in between)
    requests_used = at("jobrunner_limit_used", **lim, resource="requests")
    assert 1.5 <= requests_used <= 2 and requests_used >= limit.requests_used
    tokens_used = at("jobrunner_limit_used", **lim, resource="tokens")
    assert 300 <= tokens_used <= 500 and tokens_used >= limit.tokens_used  # 300 + 200 estimated
    assert at("jobrunner_limit_used", **lim, resource="concurrency") == 2  # both leases live
    assert at("jobrunner_limit_period_seconds", **lim) == 100
    assert 4 <= at("jobrunner_limit_blocked_for_seconds", **lim) <= 5
    assert at("jobrunner_limit_blocked_seconds_total", **lim) == pytest.approx(
        limit.blocked_seconds, abs=0.01)
    assert at("jobrunner_limit_blocked_seconds_total", **lim) > 4
    run_labels = {"namespace": "ns", "batchrun": "br-metrics"}
    assert at("jobrunner_batchrun_tokens", **run_labels) == 300
    assert at("jobrunner_batchrun_cost", **run_labels) == 0.25
    metrics.forget("ns", "br-metrics")
    assert not [k for k in _samples() if ("batchrun", "br-metrics") in k[1]]
