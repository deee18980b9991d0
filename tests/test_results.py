"""Getting the work out: `jobrunner results` (JSON lines, CSV, OpenAI batch files), the top
errors of `jobrunner status`, and the OpenAI batch round trip through a local
OpenAI-compatible server. Real PostgreSQL, real worker processes, real HTTP."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

import jobrunner
from jobrunner import PermanentError, Task
from jobrunner.features.openai_batch import OpenAIServerError, error_of, error_text, handle
from jobrunner.features.results import rows, top_errors, top_errors_status
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.openai_server import OpenAITestServer, expected_body
from tests.support.processes import child_env, cli, start_worker

FAST = ["--backoff-base", "0.01", "--backoff-cap", "0.05", "--visibility-timeout", "30"]
API_KEY = "sk-test-Zx81-never-in-logs"


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def table_rows(conn, table: str) -> int:
    row = conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone()
    conn.rollback()
    return row["n"]


# -- results and errors -----------------------------------------------------------------
def test_1000_tasks_10_poison_results_errors_csv_and_top_errors(dsn, conn, tmp_path):
    poison = {f"t{i}" for i in range(0, 1000, 100)}
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"poison": f"t{i}" in poison})
                                      for i in range(1000)])
    worker = start_worker(dsn, "b", "tests.support.handlers:poison_or_record",
                          "--exit-when-drained", "--concurrency", "4", "--batch-size", "10",
                          *FAST, log=tmp_path / "w.log")
    assert worker.wait(180) == 0, (tmp_path / "w.log").read_text()[-3000:]

    r = cli("results", "--batch", "b", dsn=dsn)
    assert r.returncode == 0, r.stderr
    results = lines(r.stdout)
    assert len(results) == 990
    assert {x["key"] for x in results} == {f"t{i}" for i in range(1000)} - poison
    for x in results:
        assert list(x) == ["key", "status", "result", "attempts", "finished_at"]
        assert x["status"] == "done" and x["attempts"] == 1
        assert x["result"] == {"key": x["key"]}  # what the handler returned for this task
        assert x["finished_at"].endswith("+00:00")

    r = cli("results", "--batch", "b", "--errors", dsn=dsn)
    assert r.returncode == 0, r.stderr
    errors = lines(r.stdout)
    assert {x["key"] for x in errors} == poison
    for x in errors:
        assert list(x) == ["key", "status", "error", "attempts", "finished_at"]
        assert x["status"] == "dead" and x["attempts"] == 1
        assert x["error"].startswith(f"PermanentError: poison task {x['key']} ")

    out = tmp_path / "results.csv"
    r = cli("results", "--batch", "b", "--format", "csv", "--output", str(out), dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert "wrote 990 result(s) of batch b" in r.stderr
    table = list(csv.DictReader(out.open(newline="")))
    assert list(table[0]) == ["key", "status", "result", "attempts", "finished_at"]
    assert len(table) == 990
    assert all(json.loads(row["result"]) == {"key": row["key"]} for row in table)
    by_key = {x["key"]: x for x in results}
    assert all(row["finished_at"] == by_key[row["key"]]["finished_at"] for row in table)
    errors_csv = list(csv.DictReader(io.StringIO(cli(
        "results", "--batch", "b", "--errors", "--format", "csv", dsn=dsn).stdout)))
    assert {row["key"] for row in errors_csv} == poison

    status = json.loads(cli("status", "--batch", "b", "--json", dsn=dsn).stdout)
    assert status["dead"] == 10 and status["done"] == 990
    [group] = status["top_errors"]  # ten messages that differ only in the key: one group
    assert group["count"] == 10 and group["example_key"] in poison
    assert group["message"].startswith(f"PermanentError: poison task {group['example_key']}")
    human = cli("status", "--batch", "b", dsn=dsn).stdout
    assert "most frequent errors" in human and "poison task" in human


def test_cancelled_tasks_are_errors_and_done_ones_are_not(dsn, conn):
    q = Queue(conn)
    q.enqueue("b", "acme", [TaskSpec(k, {}) for k in ("a", "b", "c")])
    [lease] = q.claim("b", "w", 1)
    q.ack("w", lease, {"answer": 42, "text": "ünïcode \"quoted\"\nline"})
    q.cancel("b")
    [done] = lines(cli("results", "--batch", "b", dsn=dsn).stdout)
    assert done["key"] == lease.key
    assert done["result"] == {"answer": 42, "text": "ünïcode \"quoted\"\nline"}
    errors = lines(cli("results", "--batch", "b", "--errors", dsn=dsn).stdout)
    assert [(e["status"], e["error"], e["attempts"]) for e in errors] == [
        ("cancelled", None, 0), ("cancelled", None, 0)]
    openai = lines(cli("results", "--batch", "b", "--errors", "--format", "openai",
                       dsn=dsn).stdout)
    assert {e["error"]["code"] for e in openai} == {"batch_cancelled"}
    assert all(e["response"] is None for e in openai)


def test_empty_batch_and_unknown_batch(dsn, conn, tmp_path):
    Queue(conn).enqueue("b", "acme", [TaskSpec("a", {})])
    r = cli("results", "--batch", "b", dsn=dsn)
    assert r.returncode == 0 and r.stdout == ""
    r = cli("results", "--batch", "b", "--format", "csv", dsn=dsn)
    assert r.stdout == "key,status,result,attempts,finished_at\n"
    out = tmp_path / "keep.jsonl"
    out.write_text("previous export\n")
    r = cli("results", "--batch", "nope", "--output", str(out), dsn=dsn)
    assert r.returncode == 1 and "unknown batch 'nope'" in r.stderr
    assert out.read_text() == "previous export\n"  # a failed export replaces nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]
    r = cli("results", "--batch", "b", "--format", "xml", dsn=dsn)
    assert r.returncode == 2 and "--format" in r.stderr


def test_output_to_a_special_file_and_into_a_closed_pipe(dsn, conn):
    q = Queue(conn)
    q.enqueue("b", "acme", [TaskSpec(f"k{i}", {}) for i in range(3000)])
    conn.execute("UPDATE agent_work_queue SET status = 'done', result = '{\"x\": 1}',"
                 " finished_at = now()")
    conn.commit()
    r = cli("results", "--batch", "b", "--output", "/dev/null", dsn=dsn)
    assert r.returncode == 0 and "wrote 3000 result(s)" in r.stderr
    # `jobrunner results | head -1`: the reader leaves early; no traceback, no error.
    pipe = subprocess.run(f"{sys.executable} -m jobrunner results --batch b | head -1",
                          shell=True, capture_output=True, text=True, env=child_env(dsn),
                          timeout=60)
    assert pipe.stdout.count("\n") == 1 and "Traceback" not in pipe.stderr, pipe.stderr


def test_export_reads_through_a_server_side_cursor(conn):
    q = Queue(conn)
    q.enqueue("b", "acme", [TaskSpec(f"k{i:03}", {}) for i in range(100)])
    conn.execute("UPDATE agent_work_queue SET status = 'done', result = to_jsonb(task_key),"
                 " finished_at = now()")
    conn.commit()
    stream = rows(conn, "b", itersize=10)
    first = next(stream)
    cursors = conn.execute("SELECT name FROM pg_cursors").fetchall()
    assert [c["name"] for c in cursors] == ["jobrunner_export"]
    rest = list(stream)
    assert [first[0], *(r[0] for r in rest)] == [f"k{i:03}" for i in range(100)]
    assert rest[-1][2] == '"k099"'  # the result as JSON text, not decoded
    assert conn.execute("SELECT count(*) AS n FROM pg_cursors").fetchone()["n"] == 0


# -- top errors ---------------------------------------------------------------------------
def _kill(conn, errors: dict[str, str]) -> None:
    for key, error in errors.items():
        conn.execute("UPDATE agent_work_queue SET status = 'dead', last_error = %s,"
                     " finished_at = now() WHERE task_key = %s", (error, key))
    conn.commit()


def test_top_errors_group_count_and_stay_bounded(conn):
    q = Queue(conn)
    q.enqueue("b", "acme", [TaskSpec(f"k{i:02}", {}) for i in range(40)])
    errors = {}
    for i in range(8):  # worker ids, attempts and deadlines differ: one error
        errors[f"k{i:02}"] = (f"lease expired: pod-{i}-{i:06x} did not heartbeat or finish "
                              f"attempt 8 before 2026-12-0{i + 1} 06:0{i}:01.12{i}+00")
    for i in range(8, 14):  # ids and numbers differ: one error
        errors[f"k{i:02}"] = (f"RuntimeError: upload {uuid.uuid4()} failed after {i * 7} ms"
                              f" (at handler.py:{i})")
    for i in range(14, 18):  # HTTP status codes tell errors apart
        errors[f"k{i:02}"] = f"OpenAIRequestError: HTTP 400 invalid_request_error: bad {i}"
    for i in range(18, 21):
        errors[f"k{i:02}"] = f"OpenAIRequestError: HTTP 404 model_not_found: no model {i}"
    errors["k21"] = "ValueError: " + "x" * 5000
    errors["k22"] = "KeyError: 'text'"
    _kill(conn, errors)
    groups = top_errors(conn, "b")
    assert [(g.count, g.example_key) for g in groups] == [
        (8, "k00"), (6, "k08"), (4, "k14"), (3, "k18"), (1, "k21")]
    assert groups[0].message.startswith("lease expired: pod-0-000000 did not heartbeat")
    assert groups[2].message == "OpenAIRequestError: HTTP 400 invalid_request_error: bad 14"
    assert len(groups[4].message) == 300
    status = top_errors_status(conn, "b")
    assert status[1] == {"message": errors["k08"], "count": 6, "exampleKey": "k08"}
    assert len(json.dumps(status)) < 2000  # what the controller puts in the BatchRun status
    # only the newest 5 dead tasks are read: k22, k21 and the three 404s
    assert top_errors(conn, "b", limit=1, sample=5) == [top_errors(conn, "b")[3]]
    assert top_errors(conn, "no-such-batch") == []


# -- OpenAI batch files --------------------------------------------------------------------
def _request(custom_id: str, text: str, url: str = "/v1/chat/completions") -> dict:
    body = ({"model": "gpt-test", "input": text} if url.endswith("embeddings") else
            {"model": "gpt-test", "messages": [{"role": "user", "content": text}],
             "max_tokens": 50})
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_batch_round_trip(dsn, conn, tmp_path):
    requests = [_request(f"request-{i}", f"summarise document {i}") for i in range(20)]
    requests += [_request(f"bad-{i}", f"[bad] document {i}") for i in range(3)]
    requests += [_request(f"flaky-{i}", f"[flaky] document {i}") for i in range(3)]
    requests += [_request("busy-0", "[busy] document"), _request(
        "embed-0", "a sentence to embed", "/v1/embeddings")]
    source = tmp_path / "batch_input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    r = cli("enqueue", "--batch", "ob", "--tenant", "acme", "--format", "openai-batch",
            str(source), dsn=dsn)
    assert r.returncode == 0, r.stderr
    assert f"{len(requests)} new, 0 already existed" in r.stdout

    with OpenAITestServer(api_key=API_KEY) as server:
        server.fail("[bad]", 400, times=None)
        for i in range(3):
            server.fail(f"[flaky] document {i}", 500)
        server.fail("[busy]", 429, retry_after=0.1)
        env = child_env(dsn, OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY=API_KEY)
        worker = start_worker(dsn, "ob", "jobrunner.openai_batch:handle",
                              "--exit-when-drained", "--concurrency", "4", *FAST,
                              log=tmp_path / "w.log", env=env)
        assert worker.wait(120) == 0, (tmp_path / "w.log").read_text()[-3000:]
        assert all(req.authorized for req in server.requests)
        assert server.count("[flaky]", 500) == 3 and server.count("[flaky]", 200) == 3
        assert server.count("[busy]", 429) == 1
    assert API_KEY not in (tmp_path / "w.log").read_text()

    output, errors = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    for path, extra in ((output, []), (errors, ["--errors"])):
        r = cli("results", "--batch", "ob", "--format", "openai", *extra, "--output", str(path),
                dsn=dsn)
        assert r.returncode == 0, r.stderr
    by_id = {req["custom_id"]: req for req in requests}
    out_lines, err_lines = lines(output.read_text()), lines(errors.read_text())
    assert {x["custom_id"] for x in out_lines} == set(by_id) - {f"bad-{i}" for i in range(3)}
    assert {x["custom_id"] for x in err_lines} == {f"bad-{i}" for i in range(3)}
    ids = set()
    for x in out_lines:  # the Batch API's output file, field by field
        assert list(x) == ["id", "custom_id", "response", "error"]
        assert x["id"].startswith("batch_req_") and x["error"] is None
        assert list(x["response"]) == ["status_code", "request_id", "body"]
        assert x["response"]["status_code"] == 200
        assert x["response"]["request_id"].startswith("req_")
        req = by_id[x["custom_id"]]
        assert x["response"]["body"] == expected_body(req["url"], req["body"])
        ids.add(x["id"])
    for x in err_lines:  # and its error file
        assert list(x) == ["id", "custom_id", "response", "error"]
        assert x["id"].startswith("batch_req_") and x["response"] is None
        assert x["error"] == {"code": "invalid_request_error",
                              "message": "Invalid request: [bad]"}
        ids.add(x["id"])
    assert len(ids) == len(requests)  # line ids are unique...
    again = lines(cli("results", "--batch", "ob", "--format", "openai", dsn=dsn).stdout)
    assert again == out_lines  # ...and stable from one export to the next
    flaky = {x["key"]: x["attempts"] for x in lines(cli("results", "--batch", "ob",
                                                        dsn=dsn).stdout)}
    assert [flaky[f"flaky-{i}"] for i in range(3)] == [2, 2, 2]
    assert flaky["request-0"] == 1


@pytest.mark.parametrize(("text", "message"), [
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}\n',
     "line 2: malformed JSON"),
    ('{"custom_id": "first", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n',
     "line 2: duplicate custom_id 'first' (first seen on line 1)"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n',
     "line 2: method must be 'POST'"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/files", "body": {}}\n',
     "line 2: url '/v1/files' is not a Batch API endpoint"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": "hi"}\n',
     "line 2: body must be a JSON object, got a string"),
    ('{"method": "POST", "url": "/v1/embeddings", "body": {}}\n',
     "line 2: missing required field(s) custom_id"),
    ('{"custom_id": 7, "method": "POST", "url": "/v1/embeddings", "body": {}}\n',
     "line 2: custom_id must be a string"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}, "x": 1}\n',
     "line 2: unknown field(s) x"),
])
def test_bad_openai_batch_input_writes_nothing(dsn, conn, tmp_path, text, message):
    first = json.dumps(_request("first", "hello")) + "\n"
    source = tmp_path / "in.jsonl"
    source.write_text(first + text)
    r = cli("enqueue", "--batch", "ob", "--tenant", "acme", "--format", "openai-batch",
            str(source), dsn=dsn)
    assert r.returncode == 2, r.stdout
    assert message in " ".join(r.stderr.split())
    assert table_rows(conn, "agent_work_queue") == 0
    assert table_rows(conn, "agent_batch") == 0


# -- the handler on its own ------------------------------------------------------------------
class UsageTask(Task):
    """A task whose usage reports are kept here instead of in a database."""

    def report_usage(self, **usage: int) -> None:
        self.__dict__.setdefault("usage", []).append(usage)


class NoUsageTask(Task):
    """A task of a jobrunner without flow control (no report_usage)."""

    report_usage = None


def _task(request: dict, cls: type[Task] = UsageTask) -> Task:
    return cls(id=1, key=request["custom_id"], batch_id="b", tenant_id="t", shard_key=None,
               payload={k: request[k] for k in ("method", "url", "body")}, attempt=1,
               max_attempts=8, worker_id="w")


@pytest.fixture
def server(monkeypatch):
    with OpenAITestServer(api_key=API_KEY) as s:
        monkeypatch.setenv("OPENAI_BASE_URL", s.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        monkeypatch.delenv("JOBRUNNER_OPENAI_MODEL", raising=False)
        yield s


def test_handler_answers_reports_usage_and_overrides_the_model(server, monkeypatch):
    request = _request("r", "count these four words")
    task = _task(request)
    body = handle(task)
    assert body == expected_body(request["url"], request["body"])
    assert task.usage == [{"input_tokens": 4, "output_tokens": 5, "tokens": 9}]
    monkeypatch.setenv("JOBRUNNER_OPENAI_MODEL", "local-llama")
    assert handle(_task(request, NoUsageTask))["model"] == "local-llama"
    assert server.requests[-1].body["model"] == "local-llama"


def test_handler_maps_http_errors(server, monkeypatch):
    server.fail("[bad]", 400, times=None)
    server.fail("[down]", 503, retry_after=3)
    server.fail("[busy]", 429, retry_after=0.25)
    with pytest.raises(PermanentError) as refused:
        handle(_task(_request("r", "[bad] input")))
    assert str(refused.value) == "HTTP 400 invalid_request_error: Invalid request: [bad]"
    with pytest.raises(OpenAIServerError) as down:
        handle(_task(_request("r", "[down] input")))
    assert "HTTP 503 server_error" in str(down.value) and down.value.retry_after == 3
    rate_limited = getattr(jobrunner, "RateLimited", None)
    with pytest.raises(rate_limited or OpenAIServerError) as busy:
        handle(_task(_request("r", "[busy] input")))
    assert busy.value.retry_after == 0.25
    assert not isinstance(busy.value, PermanentError)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong-key-7Qp")
    with pytest.raises(PermanentError) as unauthorized:
        handle(_task(_request("r", "hello")))
    assert "HTTP 401 invalid_api_key" in str(unauthorized.value)
    assert "sk-wrong-key-7Qp" not in str(unauthorized.value)


def test_handler_timeout_is_retryable(server, monkeypatch):
    server.delay("[slow]", 1.0)
    monkeypatch.setenv("JOBRUNNER_OPENAI_TIMEOUT", "0.2")
    with pytest.raises(httpx.TimeoutException):
        handle(_task(_request("r", "[slow] input")))


@pytest.mark.parametrize(("status", "last_error", "expected"), [
    ("dead", "OpenAIRequestError: " + error_text(400, "invalid_request_error", "Bad: x")
     + " (at openai_batch.py:170)", ("invalid_request_error", "Bad: x")),
    ("dead", "OpenAIRequestError: " + error_text(422, None, "no"), ("http_422", "no")),
    ("dead", "ReadTimeout: timed out (at _transports.py:12)", ("ReadTimeout", "timed out")),
    ("dead", "lease expired: w-1 did not heartbeat", ("lease_expired",
                                                      "lease expired: w-1 did not heartbeat")),
    ("dead", "something odd", ("task_failed", "something odd")),
    ("cancelled", None, ("batch_cancelled",
                         "This request was not executed: the batch was cancelled.")),
])
def test_error_codes_of_the_error_file(status, last_error, expected):
    assert error_of(status, last_error) == expected


def test_results_cli_is_documented():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "jobrunner results --batch B" in readme
