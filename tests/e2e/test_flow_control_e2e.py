"""Flow control on the real cluster (issue 16): a BatchRun's budget stops its claims
(phase and condition BudgetExhausted, an Event; overshoot at most what was in flight) and
`kubectl patch` of the budget resumes it to Succeeded; a BatchRun naming an unknown limit
fails with a clear error and writes nothing; the CRD refuses zero and negative values."""

from __future__ import annotations

import json
import time

import psycopg
from psycopg.rows import dict_row

from jobrunner.operator.flowcontrol import cost_text
from jobrunner.store import flowcontrol as limits
from tests.support.limits_handlers import LOG_DDL

from .operator_support import apply, batchrun, events_of, get, jobs_of, wait_phase

FAST = {"visibilityTimeoutSeconds": 10, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}
TASKS, TOKENS_EACH, BUDGET = 16, 100, 500
WORKERS, CONCURRENCY = 2, 2


def _condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions") or [] if c["type"] == type_)


def _reasons(k8s, namespace: str, name: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e.get("message") or "") for e in events_of(k8s, namespace)
            if e["involvedObject"]["kind"] == "BatchRun" and e["involvedObject"]["name"] == name]


def test_budget_stops_claims_and_a_patch_resumes_to_succeeded(k8s, namespace, dsn, operator):
    with psycopg.connect(dsn) as conn:
        conn.execute(LOG_DDL)  # (the handler logs its starts)
        limits.set_limit(conn, "e2e-llm", requests=1000, tokens=1_000_000, per=60)
        conn.commit()
    name = "budgeted"
    apply(k8s, namespace, batchrun(name, {
        "tenant": "t", "workers": WORKERS, "concurrency": CONCURRENCY,
        "handler": "tests.support.limits_handlers:spend_at_end",
        "limits": ["e2e-llm"], "tokens": TOKENS_EACH,
        "budget": {"tokens": BUDGET, "cost": "100"},
        "shards": [{"key": f"k{i:02d}", "payload": {"tokens": TOKENS_EACH, "sleep": 0.4,
                                                     "cost": "0.01"}}
                   for i in range(TASKS)], **FAST}))
    status = wait_phase(k8s, name, namespace, ("BudgetExhausted", "Succeeded", "Failed"),
                        timeout=240, controller=operator)["status"]
    assert status["phase"] == "BudgetExhausted", status
    cond = _condition(status, "BudgetExhausted")
    assert cond["status"] == "True" and "budget reached" in cond["message"], cond
    assert status["budget"] == {"tokens": BUDGET, "cost": "100"}
    (limit,) = status["limits"]
    assert limit["name"] == "e2e-llm" and limit["requests"] == 1000
    assert limit["tokens"] == 1_000_000 and limit["perSeconds"] == "60"
    # (a limit that never binds: its use in the current period is a GCRA backlog that a
    # rate of 1000/min pays off in milliseconds, so it reads 0 or a few)
    assert 0 <= limit["requestsUsed"] <= 1000 and limit["inFlight"] >= 0

    # Stopped: once nothing is leased, nothing more is claimed and the usage stays put.
    deadline = time.monotonic() + 60
    while True:
        status = get(k8s, "batchrun", name, namespace)["status"]
        if status["counts"]["leased"] == 0 and status["phase"] == "BudgetExhausted":
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        used = conn.execute("SELECT tokens, cost FROM agent_batch_usage").fetchone()
        started = conn.execute("SELECT count(*) AS n FROM limit_log").fetchone()["n"]
    time.sleep(3)  # (3 refreshes and many worker polls: nothing may be claimed meanwhile)
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        assert conn.execute("SELECT count(*) AS n FROM limit_log").fetchone()["n"] == started
        assert conn.execute("SELECT tokens FROM agent_batch_usage").fetchone()["tokens"] == (
            used["tokens"])
    status = get(k8s, "batchrun", name, namespace)["status"]
    in_flight = WORKERS * CONCURRENCY
    overshoot = used["tokens"] - BUDGET
    print(f"budget {BUDGET} tokens, {TOKENS_EACH} per task, {in_flight} in flight at most: "
          f"claims stopped at {used['tokens']} tokens ({started} of {TASKS} tasks started), "
          f"overshoot {overshoot} = {overshoot // TOKENS_EACH} task(s)")
    assert 0 <= overshoot <= in_flight * TOKENS_EACH
    assert status["counts"]["pending"] == TASKS - started and status["tokens"] == used["tokens"]
    assert status["cost"] == cost_text(used["cost"]) and used["cost"] > 0
    assert ("Warning", "BudgetExhausted") in {r[:2] for r in _reasons(k8s, namespace, name)}
    table = k8s.kubectl("get", "br", name, "-n", namespace, "-o", "wide").stdout
    print(table)
    assert "COST" in table.splitlines()[0] and "BudgetExhausted" in table

    k8s.kubectl("patch", "br", name, "-n", namespace, "--type", "merge", "-p",
                json.dumps({"spec": {"budget": {"tokens": 100_000}}}))
    status = wait_phase(k8s, name, namespace, ("Succeeded", "Failed"), timeout=240,
                        controller=operator)["status"]
    assert status["phase"] == "Succeeded", status
    assert status["counts"]["done"] == TASKS and status["tokens"] == TASKS * TOKENS_EACH
    assert status["budget"] == {"tokens": 100_000, "cost": "100"}  # (a merge patch)
    cond = _condition(status, "BudgetExhausted")
    assert cond["status"] == "False" and cond["reason"] == "BudgetAvailable"
    assert ("Normal", "BudgetResumed") in {r[:2] for r in _reasons(k8s, namespace, name)}
    print(k8s.kubectl("get", "br", name, "-n", namespace).stdout)


BAD_SPECS = [
    ({"budget": {"tokens": 0}}, "spec.budget.tokens"),
    ({"budget": {"tokens": -5}}, "spec.budget.tokens"),
    ({"budget": {"cost": "0"}}, "spec.budget.cost must be greater than 0"),
    ({"budget": {"cost": "0.000"}}, "spec.budget.cost must be greater than 0"),
    ({"budget": {"cost": "-1"}}, "spec.budget.cost"),
    ({"budget": {"cost": 12.5}}, "spec.budget.cost"),
    ({"budget": {}}, "spec.budget"),
    ({"tokens": 0}, "spec.tokens"),
    ({"tokens": -1}, "spec.tokens"),
    ({"limits": []}, "spec.limits"),
    ({"limits": ["a", "a"]}, "spec.limits"),
    ({"limits": [""]}, "spec.limits"),
    ({"source": {"external": {}}, "shardRange": None, "limits": ["a"]},
     "spec.limits and spec.tokens apply to the tasks the run enqueues"),
]


def test_crd_refuses_zero_negative_and_malformed_flow_control(k8s, namespace):
    from .operator_support import apply_crds

    apply_crds(k8s)
    base = {"tenant": "t", "handler": "m:f", "shardRange": {"count": 2}}
    wrong = []
    for extra, message in BAD_SPECS:
        spec = {k: v for k, v in {**base, **extra}.items() if v is not None}
        r = k8s.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                        input=batchrun("bad-flow", spec), check=False)
        if r.returncode == 0 or message not in r.stderr:
            wrong.append((extra, r.returncode, r.stderr))
    assert not wrong, wrong
    ok = {**base, "limits": ["a"], "tokens": 1, "budget": {"tokens": 1, "cost": "0.01"}}
    r = k8s.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                    input=batchrun("good-flow", ok), check=False)
    assert r.returncode == 0, r.stderr  # (the same fields with valid values are accepted)


def test_unknown_limit_fails_the_run_and_writes_nothing(k8s, namespace, dsn, operator):
    name = "unknown-limit"
    spec = {"tenant": "t", "handler": "tests.support.handlers:noop",
            "shardRange": {"count": 3}, "limits": ["no-such-limit"], "tokens": 10,
            "budget": {"tokens": 1000}, **FAST}
    apply(k8s, namespace, batchrun(name, spec))
    status = wait_phase(k8s, name, namespace, ("Failed", "Running", "Succeeded"),
                        controller=operator)["status"]
    assert status["phase"] == "Failed", status
    enqueued = _condition(status, "Enqueued")
    assert enqueued["status"] == "False" and enqueued["reason"] == "UnknownLimit"
    assert "'no-such-limit'" in status["message"] and "nothing was enqueued" in status["message"]
    print(status["message"])
    assert _condition(status, "Failed")["status"] == "True"
    events = _reasons(k8s, namespace, name)
    assert any(t == "Warning" and r == "UnknownLimit" and "no-such-limit" in m
               for t, r, m in events), events
    with psycopg.connect(dsn) as conn:
        for table in ("agent_work_queue", "agent_batch", "agent_batch_usage"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 0, table
    assert jobs_of(k8s, namespace) == []
    # spec.limits cannot be changed afterwards (the tasks would be enqueued with them).
    r = k8s.kubectl("patch", "br", name, "-n", namespace, "--type", "merge", "-p",
                    json.dumps({"spec": {"limits": ["other"]}}), check=False)
    assert r.returncode != 0 and "spec.limits is immutable" in r.stderr, r.stderr
