"""`jobrunner serve`, driven with the real `openai` SDK (pinned in pyproject.toml) exactly as
a user would: files.create, batches.create, polling batches.retrieve, files.content,
batches.list pagination, batches.cancel, and each error as the SDK's exception class.

Everything is real processes: PostgreSQL, `jobrunner serve` replicas (two on one port
with SO_REUSEPORT, as pods behind a Service), and `jobrunner worker --pool batch-api`
workers running jobrunner.openai_batch:handle. The upstream the workers call is our own
OpenAI-compatible test server (tests/support/openai_server.py): it answers with `usage`,
and delays, 500s and 429 + Retry-After on demand.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.support.openai_server import OpenAITestServer, expected_body
from tests.support.processes import REPO, child_env, cli, wait_for

MODEL = "test-model"
LIMITED, LIMIT, UNDEFINED = "limited-model", "upstream-rps", "misrouted-model"
ENDPOINT = "/v1/chat/completions"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A database, an upstream, N server replicas on one port, pool workers."""

    def __init__(self, dsn: str, tmp: Path, upstream: OpenAITestServer) -> None:
        self.dsn, self.tmp, self.upstream = dsn, tmp, upstream
        self.port = _free_port()
        self.fault_file = tmp / "fault"
        self.routes = tmp / "routes.yaml"
        self.routes.write_text(json.dumps({"models": {
            MODEL: {"base_url": upstream.base_url, "api_key_env": "UPSTREAM_KEY",
                    "input_cost_per_token": 0.001, "output_cost_per_token": 0.002},
            # its requests share the flow-control limit LIMIT (created by the test)
            LIMITED: {"base_url": upstream.base_url, "api_key_env": "UPSTREAM_KEY",
                      "limit": LIMIT},
            UNDEFINED: {"base_url": upstream.base_url, "api_key_env": "UPSTREAM_KEY",
                        "limit": "no-such-limit"}}}))
        self.replicas: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def env(self) -> dict[str, str]:
        return child_env(self.dsn, JOBRUNNER_MODEL_ROUTES=str(self.routes),
                         UPSTREAM_KEY="sk-upstream", JOBRUNNER_OPENAI_TIMEOUT="1",
                         JOBRUNNER_SERVE_FAULT_FILE=str(self.fault_file))

    def start_replica(self) -> subprocess.Popen:
        log = open(self.tmp / f"serve-{len(self.replicas)}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobrunner", "serve", "--port", str(self.port),
             "--reuse-port", "--max-file-bytes", str(4 * 1024 * 1024),
             "--max-file-lines", "5000", "--max-attempts", "2", "--min-window-seconds", "1"],
            env=self.env(), cwd=REPO, stdout=log, stderr=log, start_new_session=True)
        self.replicas.append(proc)
        wait_for(lambda: self._healthy(), timeout=30, what="jobrunner serve to answer")
        return proc

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_workers(self, n: int = 2) -> None:
        # (not conftest.start_worker: its workers are reaped after each test, these serve
        # the whole module)
        for _ in range(n):
            log = open(self.tmp / "workers.log", "ab")  # noqa: SIM115
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "jobrunner", "worker", "--pool", "batch-api",
                 "--handler", "jobrunner.openai_batch:handle", "--concurrency", "4",
                 "--backoff-base", "0.05", "--backoff-cap", "0.2", "--log-level", "info"],
                env=self.env(), cwd=REPO, stdout=log, stderr=log, start_new_session=True))

    def key(self, tenant: str) -> str:
        r = cli("api-key", "create", "--tenant", tenant, dsn=self.dsn, check=True)
        return r.stdout.strip()

    def client(self, key: str, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, **kw)

    def stop(self) -> None:
        for proc in self.replicas + self.workers:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait(10)


@pytest.fixture(scope="module")
def module_dsn(pg_admin_dsn: str, template_db: str) -> Iterator[str]:
    """A migrated database for the whole module (the `dsn` fixture's, module-scoped)."""
    name = f"jr_api_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    yield make_conninfo(pg_admin_dsn, dbname=name)
    with psycopg.connect(pg_admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


@pytest.fixture(scope="module")
def stack(module_dsn: str, tmp_path_factory) -> Iterator[Stack]:
    with OpenAITestServer(api_key="sk-upstream") as upstream:
        s = Stack(module_dsn, tmp_path_factory.mktemp("batch-api"), upstream)
        try:
            s.start_replica()
            s.start_replica()
            s.start_workers(2)
            yield s
        finally:
            s.stop()


def request(custom_id: str, text: str, *, model: str = MODEL, url: str = ENDPOINT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": text}]}}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def run_to_end(client: openai.OpenAI, batch_id: str, timeout: float = 90) -> openai.types.Batch:
    def ended():
        b = client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "expired", "cancelled", "failed") else None
    return wait_for(ended, timeout=timeout, interval=0.2, what=f"batch {batch_id} to end")


def lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {(o := json.loads(line))["custom_id"]: o for line in text.splitlines()}


# -- the whole path -------------------------------------------------------------------------
def test_a_batch_runs_to_completion_with_output_errors_and_usage(stack: Stack) -> None:
    client = stack.client(stack.key("acme"))
    stack.upstream.fail("[refused]", 400, times=None)
    reqs = [request(f"r{i}", f"hello number {i}") for i in range(20)]
    reqs.append(request("bad", "this one is [refused] upstream"))
    uploaded = client.files.create(file=("in.jsonl", jsonl(reqs)), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.status, uploaded.filename) == (
        "file", "batch", "processed", "in.jsonl")
    assert uploaded.bytes == len(jsonl(reqs))
    assert client.files.retrieve(uploaded.id).id == uploaded.id

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                                  completion_window="24h", metadata={"team": "a"})
    assert batch.status == "in_progress" and batch.request_counts.total == 21
    assert batch.metadata == {"team": "a"} and batch.expires_at - batch.created_at == 86400

    done = run_to_end(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (20, 1)
    assert done.completed_at and done.finalizing_at and done.in_progress_at

    out = lines_of(client, done.output_file_id)
    assert set(out) == {f"r{i}" for i in range(20)}
    for i, r in enumerate(reqs[:20]):
        line = out[f"r{i}"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert line["response"]["body"] == expected_body(ENDPOINT, r["body"])
    errors = lines_of(client, done.error_file_id)
    assert set(errors) == {"bad"}
    assert "Invalid request: [refused]" in errors["bad"]["error"]["message"]

    want = [expected_body(ENDPOINT, r["body"])["usage"] for r in reqs[:20]]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in want)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in want)
    assert done.usage.total_tokens == sum(u["total_tokens"] for u in want)
    # the upstream saw the key from the routing table's Secret variable, never ours
    assert all(r.authorized for r in stack.upstream.requests)
    # output files are files: listed, retrievable, purpose batch_output, expiring
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at
    listed = {f.id for f in client.files.list()}
    assert {uploaded.id, done.output_file_id, done.error_file_id} <= listed


def test_batches_list_paginates_newest_first(stack: Stack) -> None:
    client = stack.client(stack.key("pager"))
    file = client.files.create(file=("p.jsonl", jsonl([request("x", "page")])), purpose="batch")
    ids = [client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                 completion_window="24h").id for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # auto-paging
    last = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in last.data] == [ids[0]] and not last.has_more


def test_cancel_keeps_what_finished(stack: Stack) -> None:
    client = stack.client(stack.key("canceller"))
    stack.upstream.delay("[slow-c]", 0.8, times=None)
    reqs = [request(f"q{i}", "quick") for i in range(4)]
    reqs += [request(f"s{i}", f"[slow-c] {i}") for i in range(30)]
    file = client.files.create(file=("c.jsonl", jsonl(reqs)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4,
             timeout=60, what="the quick requests")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = run_to_end(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    out, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert {f"q{i}" for i in range(4)} <= set(out)
    assert set(out) | set(errors) == {r["custom_id"] for r in reqs}
    assert not set(out) & set(errors)
    assert any(e["error"]["code"] == "batch_cancelled" for e in errors.values())
    assert (done.request_counts.completed, done.request_counts.failed) == (
        len(out), len(errors))
    ended = _completed_batch(client)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(ended)


def _completed_batch(client: openai.OpenAI) -> str:
    quick = client.files.create(file=("q.jsonl", jsonl([request("one", "fast")])),
                                purpose="batch")
    batch = client.batches.create(input_file_id=quick.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    assert run_to_end(client, batch.id).status == "completed"
    return batch.id


def test_the_completion_window_expires_the_batch_with_partial_results(stack: Stack) -> None:
    client = stack.client(stack.key("expiring"))
    stack.upstream.delay("[slow-e]", 0.8, times=None)
    reqs = [request(f"q{i}", "quick") for i in range(3)]
    reqs += [request(f"s{i}", f"[slow-e] {i}") for i in range(80)]
    file = client.files.create(file=("e.jsonl", jsonl(reqs)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="4s")
    assert batch.expires_at - batch.created_at == 4
    done = run_to_end(client, batch.id)
    assert done.status == "expired" and done.expired_at
    out, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert {f"q{i}" for i in range(3)} <= set(out)
    assert errors and set(out) | set(errors) == {r["custom_id"] for r in reqs}
    assert done.request_counts.completed == len(out)


# -- errors -------------------------------------------------------------------------------
BAD_FILES = {
    "malformed JSON": (["{\"custom_id\": \"a\"", ], 1, "invalid_json_line"),
    "not an object": ([request("a", "x"), "[1, 2]"], 2, "invalid_json_line"),
    "wrong method": ([{**request("a", "x"), "method": "GET"}], 1, "invalid_method"),
    "wrong url": ([request("a", "x"), request("b", "y", url="/v1/embeddings")], 2,
                  "mismatched_endpoint"),
    "duplicate custom_id": ([request("a", "x"), request("b", "y"), request("a", "z")], 3,
                            "duplicate_custom_id"),
    "unknown model": ([request("a", "x", model="gpt-unknown")], 1, "model_not_found"),
    "missing body": ([{"custom_id": "a", "method": "POST", "url": ENDPOINT}], 1,
                     "missing_required_parameter"),
}


def _api_batches(dsn: str, tenant: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as c:
        return (c.execute("SELECT count(*) FROM api_batch WHERE tenant_id = %s",
                          (tenant,)).fetchone()[0],
                c.execute("SELECT count(*) FROM agent_batch WHERE tenant_id = %s",
                          (tenant,)).fetchone()[0])


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_input_file_is_refused_with_its_line_and_creates_nothing(stack: Stack,
                                                                      case: str) -> None:
    tenant = "bad-" + case.replace(" ", "-").replace("_", "-")
    client = stack.client(stack.key(tenant))
    lines, line_no, code = BAD_FILES[case]
    file = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file.id, endpoint=ENDPOINT, completion_window="24h")
    assert caught.value.status_code == 400 and caught.value.code == code
    assert caught.value.param == "input_file_id"
    assert f"Line {line_no}:" in caught.value.message
    assert _api_batches(stack.dsn, tenant) == (0, 0)
    assert list(client.batches.list()) == []


def test_request_errors_map_to_the_sdks_exception_classes(stack: Stack) -> None:
    key = stack.key("errs")
    client = stack.client(key, max_retries=0)
    file = client.files.create(file=("ok.jsonl", jsonl([request("a", "x")])), purpose="batch")
    # unknown, then deleted, input file
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=ENDPOINT,
                              completion_window="24h")
    gone = client.files.create(file=("g.jsonl", jsonl([request("a", "x")])), purpose="batch")
    assert client.files.delete(gone.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=gone.id, endpoint=ENDPOINT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(gone.id)
    # bad parameters
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file.id, endpoint="/v1/nothing",
                              completion_window="24h")
    assert caught.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file.id, endpoint=ENDPOINT, completion_window="3x")
    assert caught.value.param == "completion_window"
    # over the limits (the test server's: 4 MiB, 5,000 lines)
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("big.jsonl", b"x" * (4 * 1024 * 1024 + 1)), purpose="batch")
    assert caught.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("long.jsonl", b"{}\n" * 5001), purpose="batch")
    assert caught.value.code == "too_many_lines"
    # keys: missing, wrong, revoked; another tenant's ids do not exist
    with pytest.raises(openai.AuthenticationError):
        stack.client("jr-wrong-key", max_retries=0).files.list()
    r = httpx.get(f"{stack.base_url}/files")
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    other = stack.client(stack.key("someone-else"), max_retries=0)
    batch = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    for call in (lambda: other.files.retrieve(file.id), lambda: other.files.content(file.id),
                 lambda: other.files.delete(file.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    key_id = key.split("-")[1]
    cli("api-key", "revoke", key_id, dsn=stack.dsn, check=True)
    with pytest.raises(openai.AuthenticationError):
        client.batches.list()


# -- crashes ------------------------------------------------------------------------------
def _counts(dsn: str, tenant: str) -> tuple[int, int, int]:
    with psycopg.connect(dsn) as c:
        files = c.execute("SELECT count(*) FROM api_file WHERE tenant_id = %s AND purpose = "
                          "'batch'", (tenant,)).fetchone()[0]
        batches, queue_batches = _api_batches(dsn, tenant)
        return files, batches, queue_batches


def test_kill_9_of_a_replica_during_upload_or_create_leaves_nothing_half_made(
        stack: Stack) -> None:
    client = stack.client(stack.key("crash"), max_retries=4)
    # ~3 MiB: several chunks, the replica dies after writing the first
    reqs = [request(f"k{i}", "y" * 1000) for i in range(2500)]
    for point, expected in (("files.after_first_chunk", (1, 0, 0)),):
        stack.fault_file.write_text(point)
        file = client.files.create(file=("crash.jsonl", jsonl(reqs)), purpose="batch")
        assert not stack.fault_file.exists(), "no replica died"
        assert _counts(stack.dsn, "crash") == expected
        assert file.bytes == len(jsonl(reqs))
        _replace_dead_replicas(stack)
    stack.fault_file.write_text("batches.before_commit")
    batch = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    assert not stack.fault_file.exists()
    assert _counts(stack.dsn, "crash") == (1, 1, 1)
    assert batch.request_counts.total == 2500
    _replace_dead_replicas(stack)
    # dying after the commit, before the answer: the SDK's retry carries the same
    # Idempotency-Key (passed here: the SDK does not send one of its own) and gets the
    # same batch back
    stack.fault_file.write_text("batches.after_commit")
    again = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="24h",
                                  extra_headers={"Idempotency-Key": "create-once"})
    assert not stack.fault_file.exists()
    assert _counts(stack.dsn, "crash") == (1, 2, 2)
    assert client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                 completion_window="24h",
                                 extra_headers={"Idempotency-Key": "create-once"}).id == again.id
    _replace_dead_replicas(stack)
    for b in (batch.id, again.id):
        client.batches.cancel(b)


def _replace_dead_replicas(stack: Stack) -> None:
    for proc in list(stack.replicas):
        if proc.poll() is not None:
            stack.replicas.remove(proc)
            stack.start_replica()


# -- the upstream fails ---------------------------------------------------------------------
def test_upstream_timeouts_500s_and_429s_end_in_the_error_file_with_its_message(
        stack: Stack) -> None:
    client = stack.client(stack.key("upstream-trouble"))
    stack.upstream.delay("[hang]", 3.0, times=None)  # the workers' timeout is 1 s
    stack.upstream.fail("[down]", 500, times=None)
    stack.upstream.fail("[busy]", 429, times=None, retry_after=0.01)
    stack.upstream.fail("[flaky]", 503, times=1)  # once, then it answers
    reqs = [request("hang", "[hang]"), request("down", "[down]"), request("busy", "[busy]"),
            request("flaky", "[flaky]"), request("fine", "fine")]
    file = client.files.create(file=("t.jsonl", jsonl(reqs)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    done = run_to_end(client, batch.id, timeout=120)
    assert done.status == "completed"
    out, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert set(out) == {"flaky", "fine"} and set(errors) == {"hang", "down", "busy"}
    assert "timed out" in errors["hang"]["error"]["message"].lower()
    assert "The server had an error while processing your request." in (
        errors["down"]["error"]["message"])
    assert "Rate limit reached for requests." in errors["busy"]["error"]["message"]
    assert stack.upstream.count("[down]") == 2  # --max-attempts 2: retried once
    assert stack.upstream.count("[busy]") >= 2


# -- flow control: a route's limit gates every worker -----------------------------------------
def test_a_routes_limit_paces_the_requests_of_every_worker(stack: Stack) -> None:
    """LIMITED's route names the limit LIMIT (10 requests per second); 40 lines, 2 workers
    x 4 in flight. Witness: the upstream's own arrival times. The limit is a GCRA on the
    database clock: 10 may start at once, then one every 0.1 s, so 40 take at least 3 s
    (without the limit, 8 in flight finish them in well under 1 s here)."""
    cli("limit", "set", LIMIT, "--requests", "10", "--per", "1", dsn=stack.dsn, check=True)
    client = stack.client(stack.key("paced"))
    marker = f"paced-{uuid.uuid4().hex[:8]}"
    reqs = [request(f"p{i}", f"{marker} {i}", model=LIMITED) for i in range(40)]
    uploaded = client.files.create(file=("paced.jsonl", jsonl(reqs)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    done = run_to_end(client, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 40), done
    arrived = sorted(r.arrived for r in stack.upstream.requests if marker in str(r.body))
    assert len(arrived) == 40
    span = arrived[-1] - arrived[0]
    # (2 s, not 3: the first and last requests' claim -> arrival lags may differ; unpaced,
    # the 40 arrive within a fraction of a second. The limit's exact rate is proven with
    # the handlers' own start times in tests/test_pool_limits.py.)
    assert span >= 2.0, f"40 requests at 10/s arrived within {span:.2f} s"


def test_a_route_naming_an_undefined_limit_is_refused_and_creates_nothing(
        stack: Stack) -> None:
    client = stack.client(stack.key("misrouted"))
    uploaded = client.files.create(
        file=("m.jsonl", jsonl([request("m1", "hi", model=UNDEFINED)])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                              completion_window="24h")
    assert "no-such-limit" in err.value.message
    assert err.value.code == "limit_not_defined"
    assert _api_batches(stack.dsn, "misrouted") == (0, 0)
