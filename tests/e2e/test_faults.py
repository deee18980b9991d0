"""Kubernetes faults with numbers: controller killed mid-enqueue, API server restarted
mid-run, the database Secret deleted mid-run, and no DSN password anywhere a user or an
attacker could read. (Pods killed by activeDeadlineSeconds: tests/e2e/test_node.py,
test_the_deadline_sends_sigterm_then_sigkill_after_the_grace_period, which checks the
run's DeadlineExceeded and both ways a task comes back: released on SIGTERM, and by
lease expiry from a worker that only SIGKILL ends.)"""

from __future__ import annotations

import base64
import json
import time

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .operator_support import (
    apply,
    batchrun,
    create_db_secret,
    events_of,
    get,
    jobs_of,
    wait_phase,
)

FAST = {"visibilityTimeoutSeconds": 5, "heartbeatSeconds": 1, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


def db_one(dsn: str, sql: str, *args):
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, args).fetchone()


def test_controller_killed_mid_enqueue(k8s, namespace, dsn, operator):
    count = 150_000  # its enqueue (a few seconds) is the window the kill must hit
    apply(k8s, namespace, batchrun("big", {
        "tenant": "t", "handler": "tests.support.handlers:noop", "suspend": True,
        "shardRange": {"count": count}}))
    # Kill it while the enqueue transaction is open: a session (not this one) inside a
    # transaction whose last statement is the enqueue's COPY into its staging table or its
    # INSERT of the tasks ('idle in transaction': between the two). Parenthesised: AND
    # binds tighter than OR, and an idle session whose last query was an INSERT is not an
    # enqueue in flight.
    in_enqueue = ("SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                  " AND state IN ('active', 'idle in transaction')"
                  " AND (query LIKE 'COPY jobrunner_enqueue_stage%%'"
                  "      OR query LIKE '%%INSERT INTO agent_work_queue%%')")
    deadline = time.monotonic() + 60
    while not db_one(dsn, in_enqueue)[0]:
        if time.monotonic() > deadline:
            raise AssertionError("no enqueue transaction seen in 60 s: the kill would not "
                                 "hit the window this test is about")
        time.sleep(0.02)
    operator.kill()
    # Read after the kill (a dead controller writes nothing more): had the enqueue
    # finished before the kill, the milestone would be there.
    status_at_kill = (get(k8s, "batchrun", "big", namespace).get("status") or {})
    assert not (status_at_kill.get("milestones") or {}).get("enqueued"), \
        "the enqueue finished before the kill; the test did not hit the window"
    operator.start()
    br = wait_phase(k8s, "big", namespace, ("Suspended",), timeout=240, controller=operator)
    batch_id = br["status"]["batchId"]
    total, distinct = db_one(dsn, "SELECT count(*), count(DISTINCT task_key) FROM "
                             "agent_work_queue WHERE batch_id = %s", batch_id)
    assert total == distinct == count, "tasks lost or duplicated"
    assert br["status"]["counts"]["total"] == count
    assert len(jobs_of(k8s, namespace)) == 1
    k8s.kubectl("delete", "batchrun", "big", "-n", namespace, "--timeout=120s")


@pytest.mark.exclusive  # (see tests/e2e/conftest.py)
def test_apiserver_restart_mid_run(k8s, namespace, dsn, operator):
    apply(k8s, namespace, batchrun("survivor", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 40, "payload": {"sleep": 0.3}}, **FAST}))
    wait_phase(k8s, "survivor", namespace, ("Running",), controller=operator)
    k8s.restart_apiserver(downtime=3)
    br = wait_phase(k8s, "survivor", namespace, ("Succeeded", "Failed"), timeout=240,
                    controller=operator)
    assert br["status"]["phase"] == "Succeeded", br["status"]
    done = db_one(dsn, "SELECT count(*) FROM agent_work_queue WHERE status = 'done'")[0]
    assert done == 40 == br["status"]["counts"]["done"]
    assert operator.alive()


def test_database_secret_deleted_mid_run(k8s, namespace, dsn, operator):
    apply(k8s, namespace, batchrun("secretless", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 40, "payload": {"sleep": 0.5}}, **FAST}))
    wait_phase(k8s, "secretless", namespace, ("Running",), controller=operator)
    k8s.kubectl("delete", "secret", "jobrunner-db", "-n", namespace)
    deadline = time.monotonic() + 90
    cond = None
    while time.monotonic() < deadline:
        status = get(k8s, "batchrun", "secretless", namespace)["status"]
        cond = next((c for c in status.get("conditions", []) if c["type"] == "Progressing"),
                    None)
        if cond and cond.get("reason") == "SecretNotFound":
            break
        time.sleep(1)
    assert cond and cond["reason"] == "SecretNotFound" and cond["status"] == "Unknown", cond
    assert "jobrunner-db" in cond["message"]
    assert status["phase"] == "Running"  # not Succeeded, not Failed: it is waiting
    assert operator.alive(), "the controller crashed"
    reasons = [e["reason"] for e in events_of(k8s, namespace)]
    assert "SecretNotFound" in reasons
    create_db_secret(k8s, namespace, dsn)
    br = wait_phase(k8s, "secretless", namespace, ("Succeeded",), timeout=240,
                    controller=operator)
    assert br["status"]["counts"]["done"] == 40


def test_no_password_in_logs_events_or_status(k8s, namespace, dsn, operator, tmp_path):
    password = conninfo_to_dict(dsn)["password"]
    canary = "Leak-Canary-Pw-4711"
    wrong = conninfo_to_dict(dsn)
    wrong["password"] = canary
    create_db_secret(k8s, namespace, make_conninfo(**wrong), name="wrong-db")
    apply(k8s, namespace, batchrun("fine", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:poison_or_record",
        "shards": [{"key": "a", "payload": {}}, {"key": "b", "payload": {"poison": True}}],
        **FAST}))
    apply(k8s, namespace, batchrun("denied", {
        "tenant": "t", "handler": "tests.support.handlers:noop", "shardRange": {"count": 1},
        "database": {"secretName": "wrong-db"}}))
    wait_phase(k8s, "fine", namespace, ("Failed", "Succeeded"), controller=operator)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        conds = (get(k8s, "batchrun", "denied", namespace).get("status") or {}).get(
            "conditions", [])
        if any(c.get("reason") == "DatabaseUnavailable" for c in conds):
            break
        time.sleep(1)
    denied = get(k8s, "batchrun", "denied", namespace)
    message = next(c for c in denied["status"]["conditions"] if c["type"] == "Enqueued")
    assert "password authentication failed" in message["message"]
    texts = {
        "controller log": operator.output(),
        "events": json.dumps(events_of(k8s, namespace)),
        "batchruns": k8s.kubectl("get", "br", "-n", namespace, "-o", "json").stdout,
        "jobs": k8s.kubectl("get", "jobs", "-n", namespace, "-o", "json").stdout,
        "pods": k8s.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout,
    }
    # every container's log file, as the kubelet wrote it (what `kubectl logs` serves)
    for path in k8s.node.pod_logs.glob(f"{namespace}_*/*/*.log"):
        texts[f"pod log {path.parent.parent.name}/{path.parent.name}"] = path.read_text(
            errors="replace")
    assert any(k.startswith("pod log") for k in texts), "no worker pod logs were collected"
    secret_forms = [password, canary, base64.b64encode(password.encode()).decode()]
    for where, text in texts.items():
        for secret in secret_forms:
            assert secret not in text, f"a DSN password leaked into the {where}"
    print(f"\npassword grep: {len(texts)} sources, {sum(len(t) for t in texts.values())} "
          "bytes, 0 occurrences")
