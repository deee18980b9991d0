"""The CLI contract, exactly as documented, and its errors for bad input."""

from __future__ import annotations

import json

import pytest

from jobrunner.queue.client import Queue
from jobrunner.store.sqlfiles import migrations
from tests.support.processes import cli

LINES = "\n".join(json.dumps(t) for t in [
    {"key": "a", "payload": {"n": 1}},
    {"key": "b", "shard_key": "repo-1", "payload": {"n": 2}},
    {"key": "c", "payload": {"n": 3}, "max_attempts": 2},
]) + "\n"


def counts(conn, batch: str) -> dict:
    return Queue(conn).counts(batch)


@pytest.mark.parametrize("args", [("limit", "set", "llm", "--requests", "5"),
                                  ("limit", "list"), ("usage", "--batch", "b")])
def test_unmigrated_database_says_to_migrate(empty_dsn, args):
    r = cli(*args, "--dsn", empty_dsn)
    assert r.returncode == 1, r.stderr
    assert "no jobrunner schema" in r.stderr and "jobrunner migrate" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_migrate_is_idempotent(empty_dsn):
    first = cli("migrate", "--dsn", empty_dsn)
    assert first.returncode == 0, first.stderr
    assert f"applied {len(migrations())} migration(s)" in first.stdout
    second = cli("migrate", "--dsn", empty_dsn)
    assert "schema is up to date" in second.stdout


def test_enqueue_from_stdin_and_file_reports_new_and_existing(dsn, tmp_path, conn):
    r = cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=LINES)
    assert r.returncode == 0, r.stderr
    assert "3 new, 0 already existed" in r.stdout
    f = tmp_path / "tasks.jsonl"
    f.write_text(LINES + json.dumps({"key": "d", "payload": {}}) + "\n")
    r = cli("enqueue", "--batch", "B", "--tenant", "T", str(f), dsn=dsn)
    assert "1 new, 3 already existed" in r.stdout
    row = conn.execute("SELECT shard_key, max_attempts FROM agent_work_queue WHERE task_key='b'"
                       ).fetchone()
    assert row == {"shard_key": "repo-1", "max_attempts": 8}
    assert conn.execute("SELECT max_attempts FROM agent_work_queue WHERE task_key='c'"
                        ).fetchone()["max_attempts"] == 2


def test_dsn_from_environment_and_flag(dsn):
    assert cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn,
               input=LINES).returncode == 0
    r = cli("status", "--batch", "B", "--json", "--dsn", dsn,
            env={k: v for k, v in __import__("os").environ.items()
                 if k != "JOBRUNNER_DATABASE_URL"})
    assert r.returncode == 0, r.stderr


def test_status_json_shape(dsn):
    cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=LINES)
    r = cli("status", "--batch", "B", "--json", dsn=dsn)
    data = json.loads(r.stdout)
    assert {k: data[k] for k in ("pending", "leased", "done", "dead", "cancelled")} == {
        "pending": 3, "leased": 0, "done": 0, "dead": 0, "cancelled": 0}
    assert data["total"] == 3 and data["stuck"] == 0
    assert data["oldest_pending_seconds"] >= 0
    human = cli("status", "--batch", "B", dsn=dsn)
    assert "oldest pending" in human.stdout and "stuck leases: 0" in human.stdout


def test_worker_cancel_dead_list_and_requeue(dsn, tmp_path):
    cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=LINES)
    r = cli("worker", "--batch", "B", "--handler", "tests.support.handlers:always_fails",
            "--exit-when-drained", "--backoff-base", "0.01", "--backoff-cap", "0.05", dsn=dsn)
    assert r.returncode == 0, r.stderr
    dead = json.loads(cli("dead", "list", "--batch", "B", "--json", dsn=dsn).stdout)
    assert sorted(d["task_key"] for d in dead) == ["a", "b", "c"]
    assert all("always fails" in d["last_error"] for d in dead)
    table = cli("dead", "list", "--batch", "B", dsn=dsn).stdout
    assert "always fails" in table
    r = cli("dead", "requeue", "--batch", "B", dsn=dsn)
    assert "requeued 3 dead task(s)" in r.stdout
    r = cli("cancel", "--batch", "B", dsn=dsn)
    assert "cancelled 3 pending task(s)" in r.stdout
    data = json.loads(cli("status", "--batch", "B", "--json", dsn=dsn).stdout)
    assert data["cancelled"] == 3


def test_worker_runs_handler_and_stores_result(dsn):
    cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=LINES)
    r = cli("worker", "--batch", "B", "--handler", "tests.support.handlers:record",
            "--exit-when-drained", "--concurrency", "3", "--batch-size", "2",
            "--visibility-timeout", "30", "--heartbeat", "5", "--worker-id", "me", dsn=dsn)
    assert r.returncode == 0, r.stderr
    data = json.loads(cli("status", "--batch", "B", "--json", dsn=dsn).stdout)
    assert data["done"] == 3


@pytest.mark.parametrize("command", [
    ["status", "--batch", "nope"],
    ["cancel", "--batch", "nope"],
    ["dead", "list", "--batch", "nope"],
    ["dead", "requeue", "--batch", "nope"],
    ["worker", "--batch", "nope", "--handler", "tests.support.handlers:noop"],
])
def test_unknown_batch_is_a_clear_error(dsn, command):
    r = cli(*command, dsn=dsn)
    assert r.returncode == 1
    assert "unknown batch 'nope'" in r.stderr


@pytest.mark.parametrize(("text", "message"), [
    ('{"key": "a", "payload": {}}\n{"key": "b", "payload": {}\n',
     "line 3: malformed JSON (Expecting ',' delimiter at column 27)"),
    ('{"key": "a", "payload": [1, 2]}\n', "payload must be a JSON object, got an array"),
    ('["a"]\n', "a task must be a JSON object, got an array"),
    ('{"payload": {}}\n', "missing required field 'key'"),
    ('{"key": "a", "payload": {}}\n{"key": "a", "payload": {}}\n',
     "line 3: duplicate key 'a' (first seen on line 2)"),
    ('{"key": "a\\u0000b", "payload": {}}\n', "NUL byte"),
    ('{"key": "a", "payload": {"x": "\\u0000"}}\n', "NUL character"),
    ('{"key": "a", "payload": {}, "max_attempts": 0}\n', "max_attempts must be between 1"),
    ('{"key": "a", "payload": {}, "colour": "red"}\n', "unknown field(s) colour"),
    ('{"key": "a", "payload": {"x": NaN}}\n', "NaN is not valid JSON"),
])
def test_bad_jsonl_is_rejected_and_nothing_is_written(dsn, conn, text, message):
    good = '{"key": "first", "payload": {}}\n'
    r = cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=good + text)
    assert r.returncode == 2
    assert message in r.stderr
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM agent_batch").fetchone()["n"] == 0


def test_payload_size_limit(dsn, conn):
    big = json.dumps({"key": "big", "payload": {"blob": "x" * (10 * 1024 * 1024)}})
    r = cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=big + "\n")
    assert r.returncode == 2
    assert "the limit is 1048576 bytes" in r.stderr
    assert conn.execute("SELECT count(*) AS n FROM agent_work_queue").fetchone()["n"] == 0


def test_sql_metacharacters_are_just_data(dsn, conn):
    evil = "x'); DROP TABLE agent_work_queue; --"
    line = json.dumps({"key": evil, "shard_key": "$1 %s %(x)s", "payload": {"q": "' OR 1=1"}})
    r = cli("enqueue", "--batch", evil, "--tenant", "t'; --", "-", dsn=dsn, input=line + "\n")
    assert r.returncode == 0, r.stderr
    row = conn.execute("SELECT task_key, shard_key, tenant_id, batch_id FROM agent_work_queue"
                       ).fetchone()
    assert row == {"task_key": evil, "shard_key": "$1 %s %(x)s", "tenant_id": "t'; --",
                   "batch_id": evil}


@pytest.mark.parametrize(("args", "message"), [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "-3"], "--concurrency"),
    (["--batch-size", "100000"], "--batch-size"),
    (["--visibility-timeout", "0"], "--visibility-timeout"),
    (["--visibility-timeout", "1e12"], "--visibility-timeout"),
    (["--visibility-timeout", "10", "--heartbeat", "6"], "less than half the visibility"),
])
def test_bad_worker_parameters(dsn, args, message):
    cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=LINES)
    r = cli("worker", "--batch", "B", "--handler", "tests.support.handlers:noop", *args, dsn=dsn)
    assert r.returncode == 2
    assert message in r.stderr


def test_handler_that_does_not_import(dsn):
    cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=LINES)
    r = cli("worker", "--batch", "B", "--handler", "no_such_module:fn", dsn=dsn)
    assert r.returncode == 2
    assert "cannot import module 'no_such_module'" in r.stderr
    r = cli("worker", "--batch", "B", "--handler", "tests.support.handlers:missing", dsn=dsn)
    assert "has no attribute 'missing'" in r.stderr
    r = cli("worker", "--batch", "B", "--handler", "not-a-path", dsn=dsn)
    assert "must look like 'package.module:function'" in r.stderr


def test_wrong_password_is_reported_without_echoing_it(dsn):
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(dsn)
    params["password"] = "Sup3r-Secret-Passw0rd"
    bad = make_conninfo(**params)
    r = cli("status", "--batch", "B", "--dsn", bad)
    assert r.returncode == 1
    assert "password authentication failed" in r.stderr
    assert "Sup3r-Secret-Passw0rd" not in r.stderr + r.stdout


def test_no_dsn_at_all(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "JOBRUNNER_DATABASE_URL"}
    r = cli("status", "--batch", "B", env=env)
    assert r.returncode == 1 and "JOBRUNNER_DATABASE_URL" in r.stderr
