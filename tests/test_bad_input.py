"""Bad input, one named test per case: a clear error and no partial state.

(Enqueue-file cases are also covered, parametrised, in test_cli.py; these are the
named cases of the reliability suite, each checking that nothing was written.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import psycopg

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.processes import REPO, child_env, cli, start_worker, wait_for

GOOD = '{"key": "good", "payload": {}}\n'


def nothing_written(conn) -> bool:
    rows = conn.execute("SELECT (SELECT count(*) FROM agent_work_queue) AS q,"
                        " (SELECT count(*) FROM agent_batch) AS b").fetchone()
    conn.rollback()
    return rows["q"] == 0 and rows["b"] == 0


def enqueue(dsn, text: str) -> subprocess.CompletedProcess:
    return cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=text)


def test_bad_input_malformed_jsonl(dsn, conn):
    r = enqueue(dsn, GOOD + '{"key": "x", "payload": {\n')
    assert r.returncode == 2 and "stdin line 2: malformed JSON" in r.stderr
    assert nothing_written(conn)


def test_bad_input_payload_not_an_object(dsn, conn):
    r = enqueue(dsn, GOOD + '{"key": "x", "payload": "text"}\n')
    assert r.returncode == 2 and "payload must be a JSON object, got a string" in r.stderr
    assert nothing_written(conn)


def test_bad_input_10_mb_payload(dsn, conn):
    big = json.dumps({"key": "big", "payload": {"blob": "x" * (10 * 1024 * 1024)}})
    r = enqueue(dsn, GOOD + big + "\n")
    assert r.returncode == 2
    assert "payload is 10485771 bytes of JSON; the limit is 1048576 bytes" in r.stderr
    assert nothing_written(conn)


def test_bad_input_nul_bytes_in_keys_and_tenant(dsn, conn):
    r = enqueue(dsn, GOOD + '{"key": "a\\u0000b", "payload": {}}\n')
    assert r.returncode == 2 and "key contains a NUL byte" in r.stderr
    r = cli("enqueue", "--batch", "B", "--tenant", "t\x01", "-", dsn=dsn, input=GOOD)
    assert r.returncode == 0  # control characters other than NUL are just text
    conn.execute("DELETE FROM agent_work_queue; DELETE FROM agent_batch")
    conn.commit()
    with psycopg.connect(dsn) as c:
        try:
            Queue(c).enqueue("B", "ten\x00ant", [TaskSpec("k", {})])
        except Exception as exc:
            assert "tenant id contains a NUL byte" in str(exc)
        else:
            raise AssertionError("a NUL byte in the tenant id was accepted")
    assert nothing_written(conn)


def test_bad_input_sql_metacharacters_are_data(dsn, conn):
    evil = "'; DROP TABLE agent_work_queue; --"
    line = json.dumps({"key": evil, "shard_key": "%s $1 \\", "payload": {"q": "' OR 1=1"}})
    r = cli("enqueue", "--batch", evil, "--tenant", evil, "-", dsn=dsn, input=line + "\n")
    assert r.returncode == 0, r.stderr
    row = conn.execute("SELECT task_key, shard_key, tenant_id FROM agent_work_queue").fetchone()
    assert row == {"task_key": evil, "shard_key": "%s $1 \\", "tenant_id": evil}
    status = json.loads(cli("status", "--batch", evil, "--json", dsn=dsn).stdout)
    assert status["pending"] == 1


def test_bad_input_unknown_batch(dsn, conn):
    r = cli("status", "--batch", "never-enqueued", dsn=dsn)
    assert r.returncode == 1 and "unknown batch 'never-enqueued'" in r.stderr
    assert nothing_written(conn)


def test_bad_input_duplicate_keys_within_one_file(dsn, conn):
    r = enqueue(dsn, GOOD + '{"key": "d", "payload": {}}\n{"key": "d", "payload": {}}\n')
    assert r.returncode == 2
    assert "stdin line 3: duplicate key 'd' (first seen on line 2)" in r.stderr
    assert nothing_written(conn)


def test_bad_input_cli_parameter_values(dsn, conn):
    cases = [
        (["worker", "--batch", "B", "--handler", "m:f", "--concurrency", "0"], "--concurrency"),
        (["worker", "--batch", "B", "--handler", "m:f", "--concurrency", "-1"], "--concurrency"),
        (["worker", "--batch", "B", "--handler", "m:f", "--batch-size", "99999999"],
         "--batch-size"),
        (["worker", "--batch", "B", "--handler", "m:f", "--visibility-timeout", "-5"],
         "--visibility-timeout"),
        (["worker", "--batch", "B", "--handler", "m:f", "--visibility-timeout", "1e30"],
         "--visibility-timeout"),
        (["worker", "--batch", "B", "--handler", "m:f", "--heartbeat", "0"], "--heartbeat"),
        (["enqueue", "--batch", "B", "--tenant", "T", "--max-attempts", "0", "-"],
         "--max-attempts"),
        (["enqueue", "--batch", "B", "--tenant", "T", "--max-attempts", "100000", "-"],
         "--max-attempts"),
        (["retention", "--older-than-days", "-1"], "--older-than-days"),
        (["run", "examples/summarise.yaml", "--workers", "0"], "--workers"),
    ]
    for args, flag in cases:
        r = cli(*args, dsn=dsn, input=GOOD)
        assert r.returncode == 2, (args, r.stderr)
        assert flag in r.stderr, (args, r.stderr)
    assert nothing_written(conn)


def test_bad_input_wrong_password_is_not_echoed(dsn):
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(dsn)
    params["password"] = "Wr0ng-But-Secret-Pw"
    for args in (["status", "--batch", "B"], ["migrate"],
                 ["worker", "--batch", "B", "--handler", "tests.support.handlers:noop"]):
        r = cli(*args, "--dsn", make_conninfo(**params))
        assert r.returncode == 1, r.stderr
        assert "password authentication failed" in r.stderr
        assert "Wr0ng-But-Secret-Pw" not in r.stderr + r.stdout


def test_bad_input_handler_that_does_not_import(dsn, conn):
    cli("enqueue", "--batch", "B", "--tenant", "T", "-", dsn=dsn, input=GOOD)
    r = cli("worker", "--batch", "B", "--handler", "tests.support.nope:fn", dsn=dsn)
    assert r.returncode == 2
    assert "cannot import module 'tests.support.nope'" in r.stderr
    assert Queue(conn).counts("B")["pending"] == 1  # nothing claimed, nothing burned


def test_bad_input_handler_that_hangs_is_abandoned_at_lease_loss(dsn, conn, tmp_path):
    """A sync handler that never returns and ignores its lease: once the lease is lost the
    worker stops claiming and exits (code 70); the task is run again elsewhere."""
    Queue(conn).enqueue("B", "T", [TaskSpec("hang", {})], max_attempts=2)
    hung = start_worker(dsn, "B", "tests.support.handlers:hangs", "--visibility-timeout", "3",
                        "--heartbeat", "1", "--lost-lease-grace", "1", log=tmp_path / "w.log")
    wait_for(lambda: Queue(conn).counts("B")["leased"] == 1, what="the hang to start")
    conn.rollback()
    # The lease is taken away (as when the worker stalled and someone rescued it).
    conn.execute("UPDATE agent_work_queue SET lease_owner = 'rescuer', attempts = 2")
    conn.commit()
    assert hung.wait(30) == 70
    log = (tmp_path / "w.log").read_text()
    assert "ignored the loss of its lease" in log
    r = conn.execute("SELECT status, lease_owner FROM agent_work_queue").fetchone()
    assert (r["status"], r["lease_owner"]) == ("leased", "rescuer")  # never acked by the hung one


def test_bad_input_async_handler_that_hangs_is_cancelled(dsn, conn, tmp_path):
    # The handler itself says it was cancelled (a file written on CancelledError): a
    # "lease lost" line in the log is only the worker noticing, not the cancellation.
    marker = tmp_path / "cancelled"
    code = ("import asyncio\nasync def hang(task):\n    try:\n"
            "        await asyncio.sleep(3600)\n    except asyncio.CancelledError:\n"
            f"        open({str(marker)!r}, 'w').close()\n        raise\n")
    (tmp_path / "asynchang.py").write_text(code)
    Queue(conn).enqueue("B", "T", [TaskSpec("hang", {})])
    env = child_env(dsn, PYTHONPATH=f"{tmp_path}:{REPO}")
    worker = subprocess.Popen(
        [sys.executable, "-m", "jobrunner", "worker", "--batch", "B", "--handler",
         "asynchang:hang", "--visibility-timeout", "3", "--heartbeat", "1"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "w.log", "wb"))  # noqa: SIM115
    wait_for(lambda: Queue(conn).counts("B")["leased"] == 1, what="the task to start")
    conn.rollback()
    conn.execute("UPDATE agent_work_queue SET lease_owner = 'someone-else'")
    conn.commit()
    wait_for(marker.exists, timeout=20, what="the async handler to be cancelled")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0  # cancelled cleanly: no wedged thread


def test_bad_input_handler_returns_non_json(dsn, conn):
    Queue(conn).enqueue("B", "T", [TaskSpec("nj", {})])
    r = cli("worker", "--batch", "B", "--handler", "tests.support.handlers:not_json",
            "--exit-when-drained", dsn=dsn)
    assert r.returncode == 0, r.stderr
    row = conn.execute("SELECT status, attempts, last_error FROM agent_work_queue").fetchone()
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert "handler returned a value that is not JSON" in row["last_error"]
    assert "object is not JSON serializable" in row["last_error"]
