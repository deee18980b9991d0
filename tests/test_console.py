"""The web console (/console of `jobrunner serve`, docs/console.md) without a browser:
real `jobrunner serve`, real PostgreSQL, real workers, driven with httpx. Access (read
by default, admin to act, a tenant sees only its batches), CSRF refusals, escaping, the
bounded reads' query plans, and the live updates' one-refresh-per-topic cost.
The same views in a real browser: tests/test_console_browser.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from jobrunner.model.types import Outcome, Timing
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.server.console.filters import FilterError, TaskFilter, parse_payload
from jobrunner.store.sqlfiles import query
from tests.support.console import (
    HANDLER,
    ConsoleServer,
    counts,
    enqueue,
    module_database,
    worker,
)
from tests.support.processes import REPO, child_env, cli, start_worker, wait_for


@pytest.fixture(scope="module")
def module_dsn(pg_admin_dsn: str, template_db: str) -> Iterator[str]:
    yield from module_database(pg_admin_dsn, template_db)


@pytest.fixture(scope="module")
def server(module_dsn: str, tmp_path_factory) -> Iterator[ConsoleServer]:
    s = ConsoleServer(module_dsn, tmp_path_factory.mktemp("console")).start()
    try:
        yield s
    finally:
        s.stop()


def client(server: ConsoleServer, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=10)


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', html)[1]


@pytest.fixture(scope="module")
def dead_batch(server: ConsoleServer, tmp_path_factory) -> dict:
    """A batch of tenant acme with dead tasks (3 csv, 2 pdf) and done ones, run by a real
    worker; one payload holds HTML."""
    flag = tmp_path_factory.mktemp("flag") / "fail"
    flag.write_text("x")
    rows = [{"key": f"doc-{i:02d}", "payload": {"doc": "csv" if i < 3 else "pdf",
                                                 "fail_while": str(flag)}} for i in range(5)]
    rows += [{"key": f"ok-{i:02d}", "payload": {"doc": "txt"}} for i in range(4)]
    rows.append({"key": "html", "payload": {"doc": "<script>alert(1)</script>",
                                           "note": "<img src=x onerror=alert(2)>"}})
    enqueue(server.dsn, "acme-b1", "acme", rows)
    proc = worker(server.dsn, "acme-b1")
    try:
        wait_for(lambda: counts(server.dsn, "acme-b1")["dead"] == 5
                 and counts(server.dsn, "acme-b1")["done"] == 5, timeout=60,
                 what="the batch to settle")
    finally:
        proc.kill()
        proc.wait(10)
    return {"batch": "acme-b1", "flag": flag}


def test_payload_filter_parsing():
    assert parse_payload('payload.doc = "csv"') == {"doc": "csv"}
    assert parse_payload("payload.doc = csv and payload.meta.n = 3") == {
        "doc": "csv", "meta": {"n": 3}}
    assert parse_payload("") is None
    for bad in ("doc = csv", "payload.doc = two words", "payload.a = 1 and payload.a = 2",
                "payload. = 1"):
        with pytest.raises(FilterError):
            parse_payload(bad)
    with pytest.raises(FilterError):
        TaskFilter.from_params({"state": "nope"})


def test_pages_need_a_key_and_show_one_tenant(server, dead_batch):
    with client(server, None) as anon:
        r = anon.get("/console/", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
        assert anon.get("/console/events?topic=overview").status_code == 401
        assert anon.get("/console/batches/acme-b1", follow_redirects=False).status_code == 303
    other = server.key("globex")
    with client(server, other) as c:
        assert c.get("/console/batches/acme-b1").status_code == 404
        assert "acme-b1" not in c.get("/console/dead").text
    with client(server, server.key("acme")) as c:
        page = c.get("/console/batches/acme-b1")
        assert page.status_code == 200
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        assert 'id="count-dead"' in page.text and ">5<" in page.text
        assert "requeue-all" not in page.text  # (a read key sees no action)
        assert "doc-00" in c.get("/console/dead").text


def test_a_payload_with_html_is_shown_escaped(server, dead_batch):
    with client(server, server.key("acme")) as c:
        page = c.get("/console/batches/acme-b1/tasks/html").text
        browser = c.get("/console/batches/acme-b1/tasks?prefix=ht").text
    for html in (page, browser):
        assert "<script>alert" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page


def test_the_browser_filters_by_state_prefix_and_payload(server, dead_batch):
    with client(server, server.key("acme")) as c:
        def keys(**params) -> list[str]:
            html = c.get("/console/batches/acme-b1/tasks", params=params).text
            return re.findall(r'<tr class="task" data-key="([^"]+)"', html)

        assert keys(state="dead") == [f"doc-{i:02d}" for i in range(5)]
        assert keys(state="dead", payload='payload.doc = "csv"') == [
            "doc-00", "doc-01", "doc-02"]
        assert keys(payload="payload.doc = txt") == [f"ok-{i:02d}" for i in range(4)]
        assert keys(state="done", prefix="ok-0") == [f"ok-{i:02d}" for i in range(4)]
        assert keys(prefix="zzz") == []
        bad = c.get("/console/batches/acme-b1/tasks", params={"payload": "doc = csv"})
        assert bad.status_code == 200 and 'id="problem"' in bad.text


def test_the_browser_filters_by_shard_attempts_and_error_and_so_does_the_requeue(
        server, tmp_path):
    flag = tmp_path / "fail"
    flag.write_text("x")
    rows = [{"key": "a-0", "shard_key": "s1"}, {"key": "a-1", "shard_key": "s1"},
            {"key": "a-2", "shard_key": "s2"},
            {"key": "b-0", "shard_key": "s2", "max_attempts": 2},
            {"key": "b-1", "shard_key": "s3", "max_attempts": 2}]
    enqueue(server.dsn, "acme-b3", "acme",
            [{**r, "payload": {"fail_while": str(flag)}} for r in rows])
    proc = worker(server.dsn, "acme-b3")
    try:
        wait_for(lambda: counts(server.dsn, "acme-b3")["dead"] == 5, what="5 dead tasks")
    finally:
        proc.kill()
        proc.wait(10)
    with client(server, server.key("acme", "admin")) as c:
        def keys(**params) -> list[str]:
            html = c.get("/console/batches/acme-b3/tasks", params=params).text
            return re.findall(r'<tr class="task" data-key="([^"]+)"', html)

        # the failed rows' index (state dead) and the key order (any state) alike
        assert keys(state="dead", shard="s1") == ["a-0", "a-1"]
        assert keys(shard="s2") == ["a-2", "b-0"]
        assert keys(state="dead", attempts="2") == ["b-0", "b-1"]
        assert keys(attempts="2", shard="s2") == ["b-0"]
        # the handler's error names the task: "task a-2 refused: ..."; any case
        assert keys(state="dead", error="A-2 REFUSED") == ["a-2"]
        assert keys(error="no such text") == []
        bad = c.get("/console/batches/acme-b3/tasks", params={"attempts": "two"})
        assert 'id="problem"' in bad.text and "whole number" in bad.text
        # the bulk requeue moves what the filter shows, no more
        token = csrf_of(c.get("/console/batches/acme-b3").text)
        url = "/console/batches/acme-b3/requeue"
        confirm = c.post(url, data={"csrf": token, "shard": "s1"})
        assert 'data-count="2"' in confirm.text
        assert 'name="shard" value="s1"' in confirm.text
        flag.unlink()
        done = c.post(url, data={"csrf": csrf_of(confirm.text), "confirmed": "1",
                                 "expected": "2", "shard": "s1"}, follow_redirects=False)
        assert done.status_code in (302, 303), done.text
    assert counts(server.dsn, "acme-b3")["dead"] == 3


def test_actions_are_refused_without_csrf_from_another_site_and_to_read_keys(
        server, dead_batch):
    admin, reader = server.key("acme", "admin"), server.key("acme")
    url = "/console/batches/acme-b1/requeue"
    with client(server, admin) as c:
        token = csrf_of(c.get("/console/batches/acme-b1").text)
        assert c.post(url, data={}).status_code == 403
        assert c.post(url, data={"csrf": "0" * 64}).status_code == 403
        assert c.post(url, data={"csrf": token},
                      headers={"Origin": "https://evil.example"}).status_code == 403
        assert c.post(url, data={"csrf": token}, headers={"Origin": "null"}).status_code == 403
        # the admin's own token from its own page: the confirmation, nothing moved yet
        confirm = c.post(url, data={"csrf": token, "payload": 'payload.doc = "csv"'})
        assert confirm.status_code == 200 and 'data-count="3"' in confirm.text
    with client(server, reader) as c:
        reader_token = csrf_of(c.get("/console/batches/acme-b1").text)
        refused = c.post(url, data={"csrf": reader_token, "confirmed": "1", "expected": "5"})
        assert refused.status_code == 403 and "role is read" in refused.text
        assert c.post("/console/batches/acme-b1/cancel",
                      data={"csrf": reader_token, "confirmed": "1"}).status_code == 403
    with client(server, admin) as c:  # (another key's token is not this key's)
        assert c.post(url, data={"csrf": reader_token}).status_code == 403
    assert counts(server.dsn, "acme-b1")["dead"] == 5
    with psycopg.connect(server.dsn) as conn:
        # (nothing refused was done: no audit row for this batch; other tests of the
        # module audit their own batches)
        assert conn.execute("SELECT count(*) FROM console_audit WHERE batch_id = %s",
                            ("acme-b1",)).fetchone()[0] == 0


def test_a_changed_count_is_confirmed_again_and_an_action_is_audited(server, tmp_path):
    flag = tmp_path / "fail"
    flag.write_text("x")
    enqueue(server.dsn, "acme-b2", "acme", [
        {"key": f"t{i}", "payload": {"fail_while": str(flag)}} for i in range(4)])
    proc = worker(server.dsn, "acme-b2")
    wait_for(lambda: counts(server.dsn, "acme-b2")["dead"] == 4, what="4 dead tasks")
    admin = server.key("acme", "admin")
    url = "/console/batches/acme-b2/requeue"
    with client(server, admin) as c:
        token = csrf_of(c.get("/console/batches/acme-b2").text)
        stale = c.post(url, data={"csrf": token, "confirmed": "1", "expected": "3"})
        assert stale.status_code == 409 and counts(server.dsn, "acme-b2")["dead"] == 4
        flag.unlink()
        done = c.post(url, data={"csrf": token, "confirmed": "1", "expected": "4"},
                      follow_redirects=False)
        assert done.status_code == 303
        wait_for(lambda: counts(server.dsn, "acme-b2")["done"] == 4, what="requeued tasks done")
        audit = c.get("/console/audit").text
        assert "requeue_dead" in audit and "acme-b2" in audit
    proc.kill()
    with psycopg.connect(server.dsn) as conn:
        row = conn.execute("SELECT action, batch_id, rows, tenant_id FROM console_audit "
                           "WHERE batch_id = 'acme-b2'").fetchone()
    assert row == ("requeue_dead", "acme-b2", 4, "acme")


def test_an_operator_key_sees_every_tenant_and_the_batch_api_refuses_it(server, dead_batch):
    operator = server.key("*")
    server.key("acme", "admin")  # (listed below: made here, not by another test)
    with client(server, operator) as c:
        assert c.get("/console/batches/acme-b1").status_code == 200
        refused = c.get("/v1/batches")
        assert refused.status_code == 401 and "operator" in refused.json()["error"]["message"]
    listed = [json.loads(line) for line in cli("api-key", "list", dsn=server.dsn,
                                               check=True).stdout.splitlines()]
    assert {k["role"] for k in listed} >= {"read", "admin"}
    assert all("key_hash" not in k for k in listed)


def test_live_updates_cost_one_refresh_per_topic_whatever_the_viewers(server, tmp_path):
    """Six viewers of the overview and of one batch: the hub refreshes each topic about
    once per poll interval (2 s), not once per viewer; every viewer gets the updates."""
    key = server.key("acme")
    got: dict[int, list[str]] = {}
    stop = threading.Event()

    def viewer(n: int, topic: str) -> None:
        got[n] = []
        try:
            with httpx.Client(base_url=server.url, timeout=30,
                              headers={"Authorization": f"Bearer {key}"}) as c, \
                    c.stream("GET", f"/console/events?{topic}") as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got[n].append(line)
                    if stop.is_set():
                        return
        except httpx.HTTPError:  # (the server stops at the module's end)
            pass

    with client(server, key) as c:
        before = c.get("/console/events/stats").json()
    threads = [threading.Thread(target=viewer, args=(n, "topic=overview" if n % 2 else
                                                     "topic=batch&batch=acme-live"),
                                daemon=True) for n in range(6)]
    for t in threads:
        t.start()
    started = time.monotonic()
    # (enqueued while they watch: its NOTIFY reaches the hub's listener)
    enqueue(server.dsn, "acme-live", "acme",
            [{"key": f"k{i:03d}", "payload": {"sleep": 0.1}} for i in range(60)])
    proc = worker(server.dsn, "acme-live", concurrency=2)
    wait_for(lambda: counts(server.dsn, "acme-live")["done"] == 60, timeout=60,
             what="the live batch to finish")
    time.sleep(2.5)  # (the last refresh)
    elapsed = time.monotonic() - started
    with client(server, key) as c:
        after = c.get("/console/events/stats").json()
    stop.set()
    proc.kill()
    refreshes = after["refreshes"] - before["refreshes"]
    # two topics, at most one refresh each per min_gap (1 s), whatever the 6 viewers
    assert refreshes <= 2 * (elapsed / 1.0 + 2), (refreshes, elapsed)
    assert after["listening"] and after["notifications"] > before["notifications"]
    assert all(len(got[n]) >= 2 for n in range(6)), {n: len(v) for n, v in got.items()}
    batch_view = json.loads(got[0][-1].removeprefix("data: "))["batch-counts"]
    assert re.search(r'id="count-done">60<', batch_view), batch_view
    overview_views = [json.loads(line.removeprefix("data: "))["overview-rows"]
                      for line in got[1]]
    assert any("acme-live" in v for v in overview_views)  # (while it ran)
    assert "acme-live" not in overview_views[-1]  # (done: no longer open)


@pytest.fixture(scope="module")
def big(module_dsn: str) -> str:
    """20,000 tasks in one batch (mostly done, some dead, pending, leased) and 300 small
    open batches, analysed: enough rows for the planner to pick what it would on a big
    table."""
    with psycopg.connect(module_dsn, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO agent_batch (batch_id, tenant_id, tasks)
            SELECT 'plan-' || g, 'plans', CASE WHEN g = 0 THEN 20000 ELSE 10 END
            FROM generate_series(0, 300) g;
            INSERT INTO agent_work_queue (tenant_id, batch_id, task_key, payload, status,
                                          locked_until, last_error)
            SELECT 'plans', 'plan-0', 'k' || lpad(g::text, 6, '0'),
                   jsonb_build_object('doc', CASE WHEN g % 7 = 0 THEN 'csv' ELSE 'pdf' END),
                   CASE WHEN g % 50 = 0 THEN 'dead' WHEN g % 13 = 0 THEN 'pending'
                        WHEN g = 5 THEN 'leased' ELSE 'done' END,
                   CASE WHEN g = 5 THEN now() + interval '1 hour' END,
                   CASE WHEN g % 50 = 0 THEN 'ValueError: no' END
            FROM generate_series(1, 20000) g;
            INSERT INTO agent_work_queue (tenant_id, batch_id, task_key, payload, status)
            SELECT 'plans', 'plan-' || b, 't' || g, '{}', 'pending'
            FROM generate_series(1, 300) b, generate_series(1, 10) g;
            -- (50 of the small batches in a pool, of two tenants' weights)
            UPDATE agent_batch SET pool = 'plans-pool'
            WHERE batch_id IN (SELECT 'plan-' || g FROM generate_series(1, 50) g);
            UPDATE agent_work_queue SET pool = 'plans-pool'
            WHERE batch_id IN (SELECT 'plan-' || g FROM generate_series(1, 50) g);
            INSERT INTO agent_pool_tenant (pool, tenant_id, weight)
            VALUES ('plans-pool', 'plans', 2), ('plans-pool', 'other', 1);
            -- (three ended attempts per task of the big batch)
            INSERT INTO agent_task_attempt (task_id, attempt, ended_at, batch_id, tenant_id,
                                            worker, started_at, outcome, status, error)
            SELECT q.id, a, now() - make_interval(mins => 10 - a), q.batch_id, q.tenant_id,
                   'w', now() - make_interval(mins => 11 - a), 'failed', 'pending', 'boom'
            FROM agent_work_queue q, generate_series(1, 3) a WHERE q.batch_id = 'plan-0';
            """)
        # (as autovacuum would: the visibility map lets the counts be index-only scans)
        for table in ("agent_work_queue", "agent_task_key", "agent_batch",
                      "agent_task_attempt"):
            conn.execute(f"VACUUM ANALYZE {table}")
    return module_dsn


def _plan(conn: psycopg.Connection, name: str, params: dict) -> str:
    rows = conn.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "
                        + query(name), params).fetchall()
    return "\n".join(r[0] for r in rows)


PLANS = {
    "batch_list_open": {"tenant_id": None, "limit": 50, "cap": 10000},
    "batch_summary": {"batch_id": "plan-0", "tenant_id": None, "cap": 10000},
    "task_page": {"batch_id": "plan-0", "after": "", "prefix": "k01", "status": None,
                  "contains": '{"doc": "csv"}', "limit": 50, "scan": 5000,
                  "shard": "s1", "min_attempts": 1, "error": "timeout"},
    "task_page_failed": {"batch_id": "plan-0", "status": "dead", "after_id": 0,
                         "prefix": "", "contains": None, "limit": 50, "scan": 5000,
                         "shard": None, "min_attempts": 2, "error": "timeout"},
    "task_count_dead_matching": {"batch_id": "plan-0", "task_key": None, "prefix": "",
                                 "contains": '{"doc": "csv"}', "cap": 10001,
                                 "shard": "s1", "min_attempts": None, "error": "429"},
    "task_list_dead_recent": {"tenant_id": "plans", "limit": 100},
    "task_attempt_list": {"task_id": 17, "limit": 100},
    "console_batch_sample": {"batch_id": "plan-0", "sample": 5000},
    "console_batch_results": {"batch_id": "plan-0", "limit": 5, "scan": 5000, "chars": 300},
    "console_batch_reduce": {"batch_id": "plan-0", "chars": 300},
    "console_pool_list": {"limit": 100},
    "console_pool_tenants": {"pool": "plans-pool", "cap": 10000},
    "console_api_batches": {"tenant_id": None, "limit": 100},
    "console_api_tenants": {"tenant_id": "plans"},
    "console_schedule_runs": {"tenant_id": None, "limit": 200},
    "schedule_state_list": {"tenant_id": "plans", "limit": 500},
    "schedule_trigger_list": {"tenant_id": "plans", "limit": 50},
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_console_reads_are_index_scans_never_a_scan_of_the_task_table(big, name):
    """Every console read reaches agent_work_queue through an index (the pending, leased
    or failed partial indexes, the primary key, or agent_task_key's), never a sequential
    scan of it: the page's cost follows what it shows, not the table's size."""
    with psycopg.connect(big) as conn:
        plan = _plan(conn, name, PLANS[name])
    print(f"--- {name}\n{plan}")
    assert "Seq Scan on agent_work_queue" not in plan, plan
    assert "Seq Scan on agent_task_key" not in plan, plan
    assert "Seq Scan on agent_task_attempt" not in plan, plan


def test_an_admin_cancels_a_batch_and_exports_are_streamed(server, dead_batch):
    enqueue(server.dsn, "acme-cancel", "acme",
            [{"key": f"c{i}", "payload": {}} for i in range(7)])
    with client(server, server.key("acme", "admin")) as c:
        token = csrf_of(c.get("/console/batches/acme-cancel").text)
        ask = c.post("/console/batches/acme-cancel/cancel", data={"csrf": token})
        assert ask.status_code == 200 and 'data-count="7"' in ask.text
        assert counts(server.dsn, "acme-cancel")["pending"] == 7
        done = c.post("/console/batches/acme-cancel/cancel",
                      data={"csrf": token, "confirmed": "1"}, follow_redirects=False)
        assert done.status_code == 303
        assert counts(server.dsn, "acme-cancel")["cancelled"] == 7
        page = c.get("/console/batches/acme-cancel").text
        assert "cancel_batch" in page and 'id="cancel-batch"' not in page

        results = c.get("/console/batches/acme-b1/export.jsonl")
        assert results.status_code == 200
        assert results.headers["content-disposition"] == 'attachment; filename="acme-b1.jsonl"'
        lines = [json.loads(line) for line in results.text.splitlines()]
        assert [r["key"] for r in lines] == ["html"] + [f"ok-{i:02d}" for i in range(4)]
        errors = c.get("/console/batches/acme-b1/export.csv", params={"errors": "1"}).text
        assert errors.splitlines()[0] == "key,status,error,attempts,finished_at"
        assert len(errors.splitlines()) == 6 and "doc-04,dead,ValueError" in errors
        assert c.get("/console/batches/acme-b1/export.xml").status_code == 404


def test_jobrunner_run_console_prints_its_address_and_serves_while_the_run_lasts(
        dsn, tmp_path):
    manifest = tmp_path / "slow.yaml"
    manifest.write_text("""
apiVersion: jobrunner.dev/v1alpha1
kind: BatchRun
metadata: {name: slow}
spec:
  tenant: t
  workers: 1
  handler: tests.support.console_handlers:handle
  shards:
""" + "".join(f"    - {{key: s{i}, payload: {{sleep: 1.0}}}}\n" for i in range(12)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobrunner", "run", str(manifest), "--dsn", dsn, "--console"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        line, seen = "", []
        while "console:" not in line:
            line = proc.stdout.readline()
            seen.append(line)
            assert line or proc.poll() is None, \
                "the run ended without a console line:\n" + "".join(seen)[-3000:]
        url, key = re.search(r"console: (http://localhost:\d+/console/) \(log in with the "
                             r"key (jr-\S+):", line).groups()
        base = url.replace("localhost", "127.0.0.1")
        # (the console may answer before the run's enqueue has committed: the batch shows
        # once it has, and stays while its 12 s of tasks run)
        def shown() -> bool:
            page = httpx.get(base, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert page.status_code == 200, page.status_code
            return "local/slow" in page.text

        wait_for(lambda: shown() or proc.poll() is not None, timeout=60, interval=0.2,
                 what="the console to show the run's batch")
        assert proc.poll() is None and shown(), "the run ended before its batch was shown"
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(httpx.HTTPError):  # (the console ended with the run)
        httpx.get(base, timeout=2)
    with psycopg.connect(dsn) as conn:  # (and its key was revoked)
        assert conn.execute("SELECT revoked_at IS NOT NULL FROM api_key WHERE tenant_id = '*'"
                            ).fetchone() == (True,)


def test_a_pool_batch_requeued_wakes_the_pool_workers_and_login_refuses_other_sites(
        server, tmp_path):
    flag = tmp_path / "fail"
    flag.write_text("x")
    lines = "".join(json.dumps({"key": f"p{i}", "payload": {"fail_while": str(flag)}}) + "\n"
                    for i in range(3))
    cli("enqueue", "-", "--batch", "acme-pool", "--tenant", "acme", "--pool", "console-p",
        "--max-attempts", "1", dsn=server.dsn, input=lines, check=True)
    # a pool worker that only LISTENs and polls rarely: the requeue's pool NOTIFY wakes it
    start_worker(server.dsn, "", HANDLER, "--poll-interval", "30", pool="console-p")
    wait_for(lambda: counts(server.dsn, "acme-pool")["dead"] == 3, what="3 dead pool tasks")
    flag.unlink()
    with client(server, server.key("acme", "admin")) as c:
        token = csrf_of(c.get("/console/batches/acme-pool").text)
        c.post("/console/batches/acme-pool/requeue",
               data={"csrf": token, "confirmed": "1", "expected": "3"})
        wait_for(lambda: counts(server.dsn, "acme-pool")["done"] == 3, timeout=15,
                 what="the pool worker to run the requeued tasks")
    with client(server, None) as anon:
        refused = anon.post("/console/login", data={"key": "jr-x"},
                            headers={"Origin": "https://evil.example"})
        assert refused.status_code == 403


# -- the views of limits, pools, schedules and API batches; the batch page's detail -----
@pytest.fixture(scope="module")
def shared(server: ConsoleServer, dead_batch) -> dict:
    """A limit, a pool with two tenants' batches and a weight, a scheduled run's batch and
    two Batch API batches (one whose model name holds HTML)."""
    from jobrunner.store import flowcontrol, workerpools
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        flowcontrol.set_limit(conn, "llm", requests=600, max_concurrent=4)
        workerpools.set_weight(conn, "gpu", "acme", 3.0)
        conn.execute("""
            INSERT INTO api_batch (batch_id, tenant_id, input_file_id, endpoint,
                                   completion_window, model, status, total, completed,
                                   failed, expires_at)
            VALUES ('batch_a1', 'acme', 'file-1', '/v1/chat/completions', '24h',
                    '<b>llama</b>', 'completed', 10, 9, 1, now() + interval '1 day'),
                   ('batch_g1', 'globex', 'file-2', '/v1/chat/completions', '24h',
                    'qwen', 'in_progress', 5, 0, 0, now() + interval '1 day')""")
    for batch, tenant in (("gpu-acme", "acme"), ("gpu-globex", "globex")):
        cli("enqueue", "-", "--batch", batch, "--tenant", tenant, "--pool", "gpu",
            dsn=server.dsn, input='{"key": "a", "payload": {}}\n{"key": "b", "payload": {}}\n',
            check=True)
    enqueue(server.dsn, "ops/nightly-29412345/0a1b2c3d", "acme", [{"key": "n", "payload": {}}])
    enqueue(server.dsn, "ops/nightly-manual-now/4e5f6a7b", "acme", [{"key": "n", "payload": {}}])
    return {"pool": "gpu", "limit": "llm"}


def test_limits_pools_schedules_and_api_batches_are_shown_to_their_tenant(server, shared):
    with client(server, server.key("acme")) as c:
        limits = c.get("/console/limits").text
        pools = c.get("/console/pools").text
        schedules = c.get("/console/schedules").text
        api = c.get("/console/api-batches").text
    assert 'data-name="llm"' in limits and "0 / 4" in limits and "600" in limits
    assert "Pause" not in limits  # (a read key sees no action)
    # acme's row of the pool only, with its weight; acme has both pending tasks of gpu-acme
    assert 'data-pool="gpu"' in pools and 'data-tenant="acme"' in pools
    assert 'data-tenant="globex"' not in pools
    assert re.search(r'class="num weight">3<', pools)
    assert "ops/nightly" in schedules and "2025-12-03 05:45" in schedules
    assert "manual" in schedules
    assert 'data-batch="batch_a1"' in api and "batch_g1" not in api
    assert "&lt;b&gt;llama&lt;/b&gt;" in api and "<b>llama" not in api
    with client(server, server.key("*")) as c:
        pools = c.get("/console/pools").text
        api = c.get("/console/api-batches").text
    # the operator sees both tenants, sharing the pool by weight (3 and the default 1)
    assert 'data-tenant="globex"' in pools and "75.0%" in pools and "25.0%" in pools
    assert "batch_g1" in api and "batch_a1" in api


def test_the_batch_page_shows_throughput_attempts_and_results_escaped(server, dead_batch):
    with client(server, server.key("acme")) as c:
        page = c.get("/console/batches/acme-b1").text
    bars = [int(n) for n in re.findall(r'<rect class="done"[^>]*data-count="(\d+)"', page)]
    assert len(bars) == 30 and sum(bars) == 5  # the 5 done tasks, over time
    assert re.findall(r'<tr data-attempts="(\d+)"><td class="num">\d+</td>'
                      r'<td class="num">(\d+)</td>', page) == [("1", "10")]
    preview = page[page.index('id="result-preview"'):]
    assert re.findall(r'/tasks/([^"]+)">', preview)[:5] == ["html", "ok-00", "ok-01", "ok-02",
                                                             "ok-03"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in preview and "<script>alert" not in page
    for fmt in ("jsonl", "csv", "openai"):
        assert f'/console/batches/acme-b1/export.{fmt}"' in page


def _audit(dsn: str, action: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT key_id, tenant_id, batch_id, detail, rows FROM "
                            "console_audit WHERE action = %s ORDER BY id", (action,)).fetchall()


def test_limit_pool_and_budget_actions_need_an_admin_csrf_and_are_audited(server, shared):
    from jobrunner.store import flowcontrol
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        flowcontrol.set_budget(conn, "acme-b1", tokens=100)
    reader, tenant_admin, operator = (server.key("acme"), server.key("acme", "admin"),
                                      server.key("*", "admin"))
    pause = "/console/limits/llm/pause"
    weight = "/console/pools/gpu/weight"
    budget = "/console/batches/acme-b1/budget"

    def blocked() -> bool:
        with psycopg.connect(server.dsn) as conn:
            return conn.execute("SELECT blocked_until > now() + interval '1 year' "
                                "FROM agent_limit WHERE name = 'llm'").fetchone()[0] is True

    with client(server, reader) as c:
        token = csrf_of(c.get("/console/limits").text)
        for url, data in ((pause, {}), (weight, {"tenant": "acme", "weight": "9"}),
                          (budget, {"tokens": "500"})):
            refused = c.post(url, data={"csrf": token, **data})
            assert refused.status_code == 403 and "role is read" in refused.text
    with client(server, tenant_admin) as c:
        token = csrf_of(c.get("/console/batches/acme-b1").text)
        # limits and pools are every tenant's: a tenant's admin may not change them
        assert c.post(pause, data={"csrf": token}).status_code == 403
        assert c.post(weight, data={"csrf": token, "tenant": "acme",
                                    "weight": "9"}).status_code == 403
        assert c.post(budget, data={"tokens": "500"}).status_code == 403  # (no token)
        lower = c.post(budget, data={"csrf": token, "tokens": "50"})
        assert lower.status_code == 400 and "above" in lower.text
        raised = c.post(budget, data={"csrf": token, "tokens": "500"}, follow_redirects=False)
        assert raised.status_code == 303
        page = c.get("/console/batches/acme-b1").text
        assert "raise_budget" in page and "/ 500" in page
    assert not blocked()
    with client(server, operator) as c:
        token = csrf_of(c.get("/console/limits").text)
        assert c.post(pause, data={"csrf": "0" * 64}).status_code == 403
        assert c.post(pause, data={"csrf": token},
                      headers={"Origin": "https://evil.example"}).status_code == 403
        assert not blocked()
        assert c.post(pause, data={"csrf": token}, follow_redirects=False).status_code == 303
        assert blocked() and ">paused<" in c.get("/console/limits").text
        assert c.post("/console/limits/llm/resume", data={"csrf": token},
                      follow_redirects=False).status_code == 303
        assert not blocked()
        assert c.post("/console/limits/nope/pause", data={"csrf": token}).status_code == 404
        assert c.post(weight, data={"csrf": token, "tenant": "globex",
                                    "weight": "5000"}).status_code == 400
        assert c.post(weight, data={"csrf": token, "tenant": "globex", "weight": "2"},
                      follow_redirects=False).status_code == 303
        audit = c.get("/console/audit").text
        assert "pause_limit" in audit and "set_pool_weight" in audit
    with psycopg.connect(server.dsn) as conn:
        assert conn.execute("SELECT weight FROM agent_pool_tenant WHERE pool = 'gpu' "
                            "AND tenant_id = 'globex'").fetchone() == (2.0,)
        assert conn.execute("SELECT budget_tokens FROM agent_batch_usage "
                            "WHERE batch_id = 'acme-b1'").fetchone() == (500,)
    with psycopg.connect(server.dsn) as conn:
        operators = {r[0] for r in conn.execute(
            "SELECT key_id FROM api_key WHERE tenant_id = '*' AND role = 'admin'")}
        admins = {r[0] for r in conn.execute(
            "SELECT key_id FROM api_key WHERE tenant_id = 'acme' AND role = 'admin'")}
    # (who: the operator's key; what: the limit, pool, weight, budgets; how many rows)
    assert [r[1:] for r in _audit(server.dsn, "pause_limit") if r[0] in operators] == [
        ("*", None, {"limit": "llm"}, 1)]
    assert [r[1:] for r in _audit(server.dsn, "resume_limit") if r[0] in operators] == [
        ("*", None, {"limit": "llm"}, 1)]
    assert [r[1:] for r in _audit(server.dsn, "set_pool_weight") if r[0] in operators] == [
        ("*", None, {"pool": "gpu", "tenant": "globex", "weight": 2.0}, 1)]
    assert [r[1:] for r in _audit(server.dsn, "raise_budget") if r[0] in admins] == [
        ("acme", "acme-b1", {"tokens": [100, 500], "cost": None}, 1)]


def test_proxy_headers_are_ignored_unless_turned_on(server, module_dsn, shared,
                                                    tmp_path):
    forged = {"X-Forwarded-User": "mallory", "X-Forwarded-Groups": "jobrunner-admins"}
    with client(server, None) as anon:
        r = anon.get("/console/limits", headers=forged, follow_redirects=False)
        assert r.status_code == 303 and "/console/login" in r.headers["location"]
        assert anon.get("/console/events?topic=overview", headers=forged).status_code == 401
        assert anon.post("/console/limits/llm/pause", headers=forged,
                         data={"csrf": "x"}).status_code == 401
    proxied = ConsoleServer(module_dsn, tmp_path, "--console-proxy-auth",
                            "--console-proxy-user-header", "X-Auth-User",
                            "--console-proxy-admin-group", "ops").start()
    try:
        with client(proxied, None) as c:
            # (the default header names are not these: ignored too)
            assert c.get("/console/limits", headers=forged,
                         follow_redirects=False).status_code == 303
            reader = c.get("/console/limits", headers={"X-Auth-User": "alice",
                                                       "X-Forwarded-Groups": "dev"})
            assert reader.status_code == 200 and 'id="who-role" class="role role-read"' in \
                reader.text and "Pause" not in reader.text
            refused = c.post("/console/limits/llm/pause", data={"csrf": csrf_of(reader.text)},
                             headers={"X-Auth-User": "alice"})
            assert refused.status_code == 403
            admin = {"X-Auth-User": "bob", "X-Forwarded-Groups": "dev, ops"}
            page = c.get("/console/limits", headers=admin).text
            assert "role-admin" in page and "proxy:bob" in page
            token = csrf_of(page)
            assert token != csrf_of(reader.text)
            assert c.post("/console/limits/llm/pause", data={"csrf": csrf_of(reader.text)},
                          headers=admin).status_code == 403
            done = c.post("/console/limits/llm/pause", data={"csrf": token}, headers=admin,
                          follow_redirects=False)
            assert done.status_code == 303
            c.post("/console/limits/llm/resume", data={"csrf": token}, headers=admin)
    finally:
        proxied.stop()
    assert [r[0] for r in _audit(module_dsn, "pause_limit")][-1] == "proxy:bob"


def test_a_batch_id_with_slashes_has_its_pages(server, shared):
    """A BatchRun's batch id is namespace/name/uid: its links (%2F) reach its pages."""
    batch = "ops/nightly-29412345/0a1b2c3d"
    with client(server, server.key("acme")) as c:
        schedules = c.get("/console/schedules").text
        link = "/console/batches/ops%2Fnightly-29412345%2F0a1b2c3d"
        assert f'href="{link}"' in schedules
        page = c.get(link)
        assert page.status_code == 200 and f'<span id="batch-id">{batch}</span>' in page.text
        assert re.findall(r'<tr class="task" data-key="([^"]+)"',
                          c.get(f"{link}/tasks").text) == ["n"]
        assert c.get(f"{link}/tasks/n").status_code == 200
        assert c.get(f"{link}/export.jsonl").status_code == 200


# -- schedules: the controller's rows, "Trigger now" ----------------------------------
@pytest.fixture(scope="module")
def schedule_rows(server: ConsoleServer, shared) -> dict:
    """Two schedules as the controller writes them (jobrunner/operator/schedule_db.py):
    acme's ops/nightly (whose runs `shared` enqueued) and globex's ops/report."""
    import datetime as dt

    from jobrunner.store import schedules
    utc = dt.UTC
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        schedules.put_state(conn, schedules.ScheduleState(
            "ops", "nightly", "acme", "45 6 * * *", "Europe/Paris", False, "Forbid",
            "Scheduled", "next start time 2025-12-04T05:45:00Z",
            dt.datetime(2025, 12, 4, 5, 45, tzinfo=utc),
            dt.datetime(2025, 12, 3, 5, 45, tzinfo=utc), None, ("nightly-29412345",)))
        assert not schedules.put_state(conn, schedules.ScheduleState(  # (unchanged: no write)
            "ops", "nightly", "acme", "45 6 * * *", "Europe/Paris", False, "Forbid",
            "Scheduled", "next start time 2025-12-04T05:45:00Z",
            dt.datetime(2025, 12, 4, 5, 45, tzinfo=utc),
            dt.datetime(2025, 12, 3, 5, 45, tzinfo=utc), None, ("nightly-29412345",)))
        schedules.put_state(conn, schedules.ScheduleState(
            "ops", "report", "globex", "@hourly", None, True, "Allow", "Suspended",
            "spec.suspend is true: no new runs", None, None, None, ()))
    return {"acme": "ops/nightly", "globex": "ops/report"}


def _section(html: str, schedule: str) -> str:
    start = html.index(f'data-schedule="{schedule}"')
    end = html.find("<section", start)
    return html[start:end if end > 0 else len(html)]


def test_schedules_show_next_and_last_run_and_history_to_their_tenant(server, schedule_rows):
    with client(server, server.key("acme")) as c:
        page = c.get("/console/schedules").text
    nightly = _section(page, "ops/nightly")
    assert "<code>45 6 * * *</code> in Europe/Paris" in nightly
    assert "concurrency Forbid" in nightly and "suspended" not in nightly
    assert re.search(r'class="next-run">2025-12-04 05:45:00 UTC<', nightly)
    assert re.search(r'class="last-run">2025-12-03 05:45:00 UTC<', nightly)
    assert 'class="active">nightly-29412345<' in nightly
    # its runs, found by their batch ids, under it (not among the unknown schedules')
    assert "ops/nightly-29412345/0a1b2c3d" in nightly and "ops/nightly-manual-now" in nightly
    assert "Runs of other schedules" not in page
    assert "ops/report" not in page  # (globex's)
    assert 'class="trigger">Trigger now<' not in page  # (a read key sees no action)
    with client(server, server.key("*")) as c:
        page = c.get("/console/schedules").text
    report = _section(page, "ops/report")
    assert 'class="paused suspended"' in report and 'class="next-run">-<' in report


def test_trigger_now_needs_an_admin_csrf_and_the_tenant_and_is_audited(server, schedule_rows):
    url = "/console/schedules/ops/nightly/trigger"

    def requests() -> list[tuple]:
        with psycopg.connect(server.dsn) as conn:
            return conn.execute("SELECT id, namespace, name, tenant_id, requested_by, "
                                "taken_at FROM agent_schedule_trigger ORDER BY id").fetchall()

    with client(server, server.key("acme")) as c:
        token = csrf_of(c.get("/console/schedules").text)
        refused = c.post(url, data={"csrf": token})
        assert refused.status_code == 403 and "role is read" in refused.text
    admin = server.key("acme", "admin")
    with client(server, admin) as c:
        page = c.get("/console/schedules").text
        assert 'class="trigger">Trigger now<' in _section(page, "ops/nightly")
        token = csrf_of(page)
        assert c.post(url, data={}).status_code == 403
        assert c.post(url, data={"csrf": "0" * 64}).status_code == 403
        assert c.post(url, data={"csrf": token},
                      headers={"Origin": "https://evil.example"}).status_code == 403
        # globex's schedule is not acme's to trigger (nor to see: not found, as a batch)
        other = c.post("/console/schedules/ops/report/trigger", data={"csrf": token})
        assert other.status_code == 404
        assert c.post("/console/schedules/ops/nope/trigger",
                      data={"csrf": token}).status_code == 404
        assert requests() == []
        done = c.post(url, data={"csrf": token}, follow_redirects=False)
        assert done.status_code == 303 and "done=triggered-" in done.headers["location"]
        with psycopg.connect(server.dsn) as conn:
            key_id = conn.execute("SELECT key_id FROM api_key WHERE tenant_id = 'acme' AND "
                                  "role = 'admin' ORDER BY created_at DESC").fetchone()[0]
        [(trigger, ns, name, tenant, by, taken)] = requests()
        assert (ns, name, tenant, by, taken) == ("ops", "nightly", "acme", key_id, None)
        page = c.get(done.headers["location"]).text
        assert f"Trigger request {trigger} sent" in page
        assert re.search(rf'data-trigger="{trigger}" data-outcome="waiting"', page)
        # the controller's answer (jobrunner/operator/schedule_db.py), shown on the page
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            from jobrunner.store import schedules
            assert schedules.answer_trigger(conn, trigger, outcome="started",
                                            run_name=f"nightly-manual-console-{trigger}",
                                            message="started")
            assert not schedules.answer_trigger(conn, trigger, outcome="refused",
                                                run_name=None, message="twice")
        page = c.get("/console/schedules").text
        assert f"started nightly-manual-console-{trigger}" in page
        audit = c.get("/console/audit").text
        assert "trigger_schedule" in audit
    assert [r[1:] for r in _audit(server.dsn, "trigger_schedule")] == [
        ("acme", None, {"namespace": "ops", "name": "nightly", "trigger": trigger}, 1)]
    with client(server, server.key("globex")) as c:  # (acme's request is not globex's)
        assert f'data-trigger="{trigger}"' not in c.get("/console/schedules").text


def test_the_task_page_lists_every_attempt_with_its_worker_times_and_error(server):
    """Five attempts of one task, each ended another way (failed, rate limited, released,
    expired, acked) by a different worker: the task page lists all five, oldest first,
    with the worker that held each, how it ended and its error; each start is its
    claim's, not a later heartbeat's (the test's own clock around each call is the
    witness: one machine, one clock)."""
    batch = "acme-attempts"
    witness: list[tuple[str, float, float, float, float]] = []  # worker, claim, end spans
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        queue = Queue(conn, Timing(visibility_timeout=1.0, backoff_base=0.0))
        queue.enqueue(batch, "acme", [TaskSpec("t", {"doc": "x"})])

        def claim(who: str):
            before = time.time()
            (lease,) = queue.claim(batch, who)
            return lease, before, time.time()

        def ended(who: str, spans: tuple, end) -> None:
            before = time.time()
            end()
            witness.append((who, spans[1], spans[2], before, time.time()))

        lease, *span = claim("w1")
        time.sleep(0.3)  # a heartbeat later than the claim moves updated_at, not the start
        assert queue.heartbeat("w1", [lease]) == {lease.id}
        ended("w1", (lease, *span), lambda: queue.fail("w1", lease, "ValueError: first"))
        lease, *span = claim("w2")
        ended("w2", (lease, *span), lambda: queue.complete(
            "w2", [Outcome(lease, False, error="HTTP 429: slow down", throttle_after=0.0)]))
        lease, *span = claim("w3")
        ended("w3", (lease, *span), lambda: queue.release("w3", [lease]))
        lease, *span = claim("w4")
        time.sleep(1.3)  # (its lease of 1 s runs out)
        ended("w4", (lease, *span), lambda: queue.expire())
        # (any worker's sweep may rescue it: the other tests' workers share the database;
        # it ends from the lease's deadline on)
        witness[-1] = (*witness[-1][:3], lease.locked_until.timestamp(), witness[-1][4])
        lease, *span = claim("w5")
        ended("w5", (lease, *span), lambda: queue.ack("w5", lease, {"ok": True}))
        rows = conn.execute(
            "SELECT worker, started_at, ended_at FROM agent_task_attempt WHERE batch_id = %s"
            " ORDER BY ended_at", (batch,)).fetchall()
        final = conn.execute("SELECT lease_owner, leased_at, finished_at FROM agent_work_queue"
                             " WHERE batch_id = %s", (batch,)).fetchone()

    recorded = [*rows, final]
    assert [r[0] for r in recorded] == ["w1", "w2", "w3", "w4", "w5"]
    # One clock: the database's now() (its transaction's start, in microseconds) is read
    # after the call began and before it returned; the slack is rounding only.
    slack = 0.001
    for (who, c0, c1, e0, e1), (_, started, finished) in zip(witness, recorded, strict=True):
        assert c0 - slack <= started.timestamp() <= c1 + slack, who
        assert e0 - slack <= finished.timestamp() <= e1 + slack, who

    with client(server, server.key("acme")) as c:
        page = c.get(f"/console/batches/{batch}/tasks/t").text
    shown = re.findall(r'<tr class="attempt outcome-([a-z_]+)"><td class="num">(\d+)</td>'
                       r'<td>([^<]*)</td>', page)
    assert shown == [("failed", "1", "w1"), ("rate_limited", "2", "w2"),
                     ("released", "2", "w3"), ("expired", "2", "w4"), ("acked", "3", "w5")]
    assert "ValueError: first" in page and "HTTP 429: slow down" in page
    assert "lease expired: w4 did not heartbeat" in page
