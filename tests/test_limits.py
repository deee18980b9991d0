"""Flow control (issue 16, docs/flow-control.md): limits shared by every worker, checked
and charged in the claim; settlement by reported usage; rate-limited answers; budgets.
Real PostgreSQL, real worker processes; times are the database's."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jobrunner.model.errors import BadInput
from jobrunner.model.types import Outcome, Timing
from jobrunner.model.usage import Usage, read_usage_file
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store import flowcontrol as limits
from tests.support.figures import show
from tests.support.limits_handlers import LOG_DDL, MAX_START_LAG, max_in_window
from tests.support.processes import cli, start_worker, wait_for

H = "tests.support.limits_handlers"


@pytest.fixture
def log_table(conn):
    conn.execute(LOG_DDL)
    conn.commit()


# A test's witness of each 429's block of a limit: when it was written (clock_timestamp()
# of the UPDATE, which commits at once: jobrunner/store/flowcontrol.py block_limits) and
# until when.
BLOCK_LOG_DDL = """
CREATE TABLE block_log (at timestamptz, blocked_until timestamptz);
CREATE FUNCTION block_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.blocked_until IS DISTINCT FROM OLD.blocked_until THEN
        INSERT INTO block_log VALUES (clock_timestamp(), NEW.blocked_until);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER block_log AFTER UPDATE ON agent_limit FOR EACH ROW EXECUTE FUNCTION block_log();
"""


def _jsonl(tasks: list[dict]) -> str:
    return "".join(json.dumps(t) + "\n" for t in tasks)


def _workers(dsn, batch, n, handler, tmp_path, *extra):
    return [start_worker(dsn, batch, handler, "--exit-when-drained", "--worker-id", f"w{i}",
                         *extra, log=tmp_path / f"w{i}.log") for i in range(n)]


def _finish(workers, tmp_path, timeout=180):
    for i, w in enumerate(workers):
        code = w.wait(timeout)
        assert code == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]


def _epochs(conn, column: str, batch_filter: str = "") -> list[float]:
    rows = conn.execute(f"SELECT extract(epoch FROM {column}) AS t FROM limit_log"
                        f" {batch_filter} ORDER BY 1").fetchall()
    return [float(r["t"]) for r in rows]


def test_request_limit_is_shared_by_8_workers_and_used(dsn, conn, log_table, tmp_path,
                                                        capsys):
    cli("limit", "set", "api", "--requests", "20", "--per", "2", dsn=dsn, check=True)
    Queue(conn).enqueue("req", "t", [TaskSpec(f"k{i:03d}", {"sleep": 0.05}, limits=("api",))
                                     for i in range(200)])
    workers = _workers(dsn, "req", 8, f"{H}:paced", tmp_path)
    _finish(workers, tmp_path)
    assert Queue(conn).counts("req")["done"] == 200
    claimed = _epochs(conn, "claimed_at")
    started = _epochs(conn, "started_at")
    assert len(claimed) == 200
    # The limit's guarantee, on the database clock of the claims (docs/flow-control.md):
    # never more than 20 in any 2 s window.
    assert max_in_window(claimed, 2.0) <= 20
    # An independent witness: the handlers' own start times (what the API would see),
    # written by the handler, not by the limiter. A start follows its claim by the claim's
    # commit, the hand-off to a thread and the log's INSERT: start_lag at most (the
    # largest measured; MAX_START_LAG bounds it), so the starts in any 2 s window belong
    # to claims of a window of 2 + start_lag s, which the limit (10/s, 20 at once) holds
    # to 20 + 10 * start_lag.
    lags = [r["s"] - r["c"] for r in conn.execute(
        "SELECT extract(epoch FROM claimed_at)::float8 AS c,"
        " extract(epoch FROM started_at)::float8 AS s FROM limit_log").fetchall()]
    start_lag = max(0.5, max(lags))  # (never tighter than the 0.5 s it always allowed)
    assert min(lags) >= 0 and start_lag <= MAX_START_LAG, (min(lags), start_lag)
    most = max_in_window(started, 2.0)
    show(capsys, f"request limit 20 per 2 s, 8 workers: handler starts at most {most} per 2 s "
         f"(bound {20 + math.ceil(10 * start_lag)}), claims at most "
         f"{max_in_window(claimed, 2.0)}; claim -> start {min(lags) * 1000:.0f}.."
         f"{max(lags) * 1000:.0f} ms; whole batch {started[-1] - started[0]:.1f} s")
    assert most <= 20 + math.ceil(10 * start_lag)
    # Used, not just respected: 200 requests at 10/s ideally take 20 s.
    assert started[-1] - started[0] <= 1.25 * 20


def test_token_limit_settles_estimates_with_reported_usage(dsn, conn, log_table, tmp_path):
    cli("limit", "set", "tok", "--tokens", "2000", "--per", "2", dsn=dsn, check=True)
    # Even tasks estimate 50 and use 200 (too low), odd ones estimate 400 and use 100.
    tasks = [TaskSpec(f"k{i:02d}", {"actual": 200 if i % 2 == 0 else 100, "sleep": 0.05},
                      limits=("tok",), tokens=50 if i % 2 == 0 else 400) for i in range(40)]
    Queue(conn).enqueue("tok", "t", tasks)
    workers = _workers(dsn, "tok", 4, f"{H}:paced", tmp_path)
    _finish(workers, tmp_path)
    rows = conn.execute("SELECT extract(epoch FROM claimed_at)::float8 AS c,"
                        " extract(epoch FROM reported_at)::float8 AS r, tokens,"
                        " CASE WHEN tokens = 200 THEN 50 ELSE 400 END AS estimate"
                        " FROM limit_log ORDER BY claimed_at").fetchall()
    assert len(rows) == 40 and all(r["r"] is not None for r in rows)
    times = [r["c"] for r in rows]
    # The documented bound (docs/flow-control.md): the actual tokens of the tasks claimed
    # in any window of 2 s stay within the limit plus one task's tokens, as long as each
    # task reports before the next claim of the limit is admitted; a task still in flight
    # (claimed, not yet settled) when a later one of the window was admitted may add
    # what it used beyond its estimate. (Under CI load reports come late: those, counted.)
    worst, worst_late = 0, 0
    for t in times:
        window = [r for r in rows if t <= r["c"] < t + 2.0]
        late = [r for r in window
                if any(o["c"] > r["c"] and r["r"] > o["c"] for o in window)]
        allowance = 2000 + 200 + sum(max(0, r["tokens"] - r["estimate"]) for r in late)
        used = sum(r["tokens"] for r in window)
        assert used <= allowance, (used, allowance, len(late))
        worst = max(worst, used)
        worst_late = max(worst_late, len([r for r in late if r["tokens"] > r["estimate"]]))
    print(f"tokens: at most {worst} per 2 s (underestimates settled after a later claim of "
          f"the window: at most {worst_late})")
    span = times[-1] - times[0]
    print(f"6,000 tokens over {span:.1f} s")
    # Settled by actual usage (6,000 tokens: ~6 s at 1,000/s), not by the estimates
    # (9,000: ~9 s), which would also have let the too-low ones overrun the limit.
    assert span < 8.5
    usage = Queue(conn).usage("tok")
    assert usage.tokens == 6000 and usage.by_status["done"]["attempts"] == 40


class _Api(BaseHTTPRequestHandler):
    """An OpenAI-ish endpoint: POST /flaky answers 429 (Retry-After: 1) to its 5th, 6th
    and 30th request; POST /always answers 429 (Retry-After: 0.05) every time."""

    lock = threading.Lock()
    seen: list[tuple[float, str, int]] = []
    count = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        cls = type(self)
        with cls.lock:
            cls.count += 1
            n = cls.count
            status = 429 if self.path == "/always" or n in (5, 6, 30) else 200
            cls.seen.append((time.time(), self.path, status))
        body = json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode()
        self.send_response(status)
        if status == 429:
            self.send_header("Retry-After", "0.05" if self.path == "/always" else "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api_server():
    _Api.seen, _Api.count = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_429_pauses_the_limit_for_every_worker_without_burning_attempts(
        dsn, conn, log_table, tmp_path, api_server, capsys):
    cli("limit", "set", "llm", "--requests", "50", "--per", "1", dsn=dsn, check=True)
    # When each pause begins: the instant the worker's block of the limit is written (a
    # trigger of this test, on the database clock). The pause cannot begin at the
    # handler's 429 itself: the worker writes the block after the handler returns, and a
    # claim in between (a few ms) is not paused yet.
    conn.execute(BLOCK_LOG_DDL)
    conn.commit()
    tasks = [{"key": f"k{i:02d}", "limits": ["llm"],
              "payload": {"url": f"{api_server}/flaky", "limit": "llm", "sleep": 0.05}}
             for i in range(40)]
    cli("enqueue", "--batch", "flaky", "--tenant", "t", "--max-attempts", "1", "-",
        dsn=dsn, input=_jsonl(tasks), check=True)
    workers = _workers(dsn, "flaky", 4, f"{H}:http_call", tmp_path)
    _finish(workers, tmp_path)
    rows = conn.execute("SELECT status, attempts, throttles FROM agent_work_queue"
                        " WHERE batch_id = 'flaky'").fetchall()
    # max_attempts is 1: a 429 that used an attempt would have ended its task dead.
    assert {r["status"] for r in rows} == {"done"} and {r["attempts"] for r in rows} == {1}
    assert sum(r["throttles"] or 0 for r in rows) == 3
    # The pause, measured from the handlers' side (database clock, written by them): once
    # a 429's block of the limit is written (Retry-After: 1), no handler starts until the
    # block ends, except those whose claim came before it: a start follows its claim by
    # at most `lag` (measured here, per task), so none starts in (block + lag, until).
    rows = conn.execute("SELECT extract(epoch FROM claimed_at)::float8 AS c,"
                        " extract(epoch FROM started_at)::float8 AS s,"
                        " extract(epoch FROM rate_limited_at)::float8 AS r"
                        " FROM limit_log").fetchall()
    blocks = [(b["at"], b["until"]) for b in conn.execute(
        "SELECT extract(epoch FROM at)::float8 AS at,"
        " extract(epoch FROM blocked_until)::float8 AS until FROM block_log ORDER BY at")]
    lag = max(r["s"] - r["c"] for r in rows)
    answers = sorted(r["r"] for r in rows if r["r"] is not None)
    # Three 429s, and a block written for each, except that the 5th and 6th calls (4
    # workers) can be answered in the same instant: the later of the two writes then sets
    # no later blocked_until (greatest(), as it should: one pause), and the trigger logs
    # changes only, so two 429s may show as one block (a CI run: 429s 2 ms apart).
    assert len(answers) == 3 and 2 <= len(blocks) <= 3 and lag < 0.5, (answers, blocks, lag)
    # each block follows a handler's 429 (the worker writes it once the handler returns)
    delays = [at - max(a for a in answers if a <= at) for at, _ in blocks]
    assert all(0 <= d < 1.0 for d in delays), delays
    for at, until in blocks:
        assert 0.9 < until - at <= 1.0, (at, until)  # now() + Retry-After 1 s, now() <= at
        inside = sorted(r["s"] - at for r in rows if at + lag < r["s"] < until)
        assert inside == [], (at, inside)
    after = [r["s"] - blocks[-1][1] for r in rows if r["s"] > blocks[-1][0] + lag]
    show(capsys, f"429 pause (Retry-After 1 s), handler side: 429 -> block written "
         f"{max(delays) * 1000:.0f} ms at most; claim -> start at most {lag * 1000:.0f} ms; "
         f"no start in (block + {lag:.2f} s, block + 1 s) for {len(blocks)} blocks; first "
         f"start after the last block ended: {min(after):+.2f} s" if after else "")
    # ... and the server's side: nothing reached it from 0.6 s after a 429 to the end of
    # the second (before 0.6 s, calls of tasks claimed before the pause may still arrive:
    # a worker's first call imports its HTTP client, a few hundred ms under load)
    for at, _, status in sorted(_Api.seen):
        if status == 429:
            paused = [t for t, _, _ in _Api.seen if at + 0.6 < t < at + 0.95]
            assert paused == [], (at, paused)
    blocked = limits.list_limits(conn, ["llm"])[0]
    assert blocked.blocked_seconds >= 1.5  # two separate pauses of about a second


def test_an_endpoint_that_always_says_429_ends_the_task_dead(dsn, conn, log_table, tmp_path,
                                                             api_server):
    cli("limit", "set", "llm", "--requests", "1000", "--per", "1", dsn=dsn, check=True)
    tasks = [{"key": f"k{i}", "limits": ["llm"],
              "payload": {"url": f"{api_server}/always", "limit": "llm"}} for i in range(3)]
    cli("enqueue", "--batch", "always", "--tenant", "t", "-", dsn=dsn, input=_jsonl(tasks),
        check=True)
    workers = _workers(dsn, "always", 2, f"{H}:http_call", tmp_path)
    _finish(workers, tmp_path)
    rows = conn.execute("SELECT status, attempts, throttles, last_error FROM agent_work_queue"
                        " WHERE batch_id = 'always'").fetchall()
    assert {r["status"] for r in rows} == {"dead"}
    assert {r["throttles"] for r in rows} == {20}
    assert all(r["attempts"] <= 1 for r in rows)
    assert all("rate limited 20 times" in r["last_error"] for r in rows), rows[0]
    assert all("RateLimited" in r["last_error"] for r in rows)


LEASE_LOG = """
CREATE TABLE lease_log (task_id bigint, attempt int, leased boolean, at timestamptz,
                        error text);
CREATE FUNCTION log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_log VALUES (NEW.id, CASE WHEN NEW.status = 'leased' THEN NEW.attempts
                                               ELSE OLD.attempts END,
                                  NEW.status = 'leased', clock_timestamp(), NEW.last_error);
    RETURN NEW;
END $$;
CREATE TRIGGER log_lease AFTER UPDATE OF status ON agent_work_queue FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          AND (OLD.status = 'leased' OR NEW.status = 'leased'))
    EXECUTE FUNCTION log_lease();
"""


def test_max_concurrent_holds_across_8_workers_under_kill_9(dsn, conn, log_table, tmp_path):
    conn.execute(LEASE_LOG)
    conn.commit()
    cli("limit", "set", "gpu", "--max-concurrent", "3", dsn=dsn, check=True)
    extra = ("--visibility-timeout", "3", "--heartbeat", "1")
    q = Queue(conn)
    q.enqueue("conc", "t", [TaskSpec(f"k{i:02d}", {"sleep": 0.4}, limits=("gpu",))
                            for i in range(40)])
    workers = _workers(dsn, "conc", 8, f"{H}:paced", tmp_path, *extra)
    killed = 0
    deadline = time.monotonic() + 30
    while killed < 3 and time.monotonic() < deadline:
        owners = [r["lease_owner"] for r in conn.execute(
            "SELECT lease_owner FROM agent_work_queue WHERE status = 'leased'").fetchall()]
        conn.rollback()
        victims = [i for i, w in enumerate(workers) if w.poll() is None
                   and any(o and o.startswith(f"w{i}-") for o in owners)]
        if victims:
            i = victims[0]
            os.killpg(workers[i].pid, signal.SIGKILL)  # mid-task: its slot stays taken
            workers[i].wait()
            killed += 1
            workers[i] = start_worker(dsn, "conc", f"{H}:paced", "--exit-when-drained",
                                      "--worker-id", f"w{i}", *extra, log=tmp_path / f"w{i}.log")
        time.sleep(0.7)
    assert killed == 3
    wait_for(lambda: q.counts("conc")["done"] == 40, timeout=120, what="the batch")
    _finish(workers, tmp_path)
    expired = conn.execute("SELECT count(*) AS n FROM lease_log WHERE NOT leased"
                           " AND error LIKE 'lease expired%%'").fetchone()["n"]
    assert expired >= 1  # killed workers' slots were freed by lease expiry
    # Interval join on the database clock: every lease from its claim to its end.
    overlaps = conn.execute("""
        WITH iv AS (
            SELECT s.task_id, s.attempt, s.at AS start,
                   (SELECT min(e.at) FROM lease_log e WHERE e.task_id = s.task_id
                      AND NOT e.leased AND e.at >= s.at) AS stop
            FROM lease_log s WHERE s.leased)
        SELECT a.task_id, a.start, count(*) AS live
        FROM iv a JOIN iv b ON b.start <= a.start AND b.stop > a.start
        GROUP BY a.task_id, a.start HAVING count(*) > 3""").fetchall()
    assert overlaps == []
    most = conn.execute("""
        WITH iv AS (
            SELECT s.at AS start, (SELECT min(e.at) FROM lease_log e WHERE e.task_id = s.task_id
                      AND NOT e.leased AND e.at >= s.at) AS stop
            FROM lease_log s WHERE s.leased)
        SELECT max((SELECT count(*) FROM iv b WHERE b.start <= a.start AND b.stop > a.start))
               AS n FROM iv a""").fetchone()["n"]
    assert most == 3  # the limit was used, not just respected
    assert conn.execute("SELECT count(*) AS n FROM agent_limit_lease").fetchone()["n"] == 0


def test_budget_stops_claims_overshoot_at_most_in_flight_and_raising_resumes(
        dsn, conn, log_table, tmp_path):
    q = Queue(conn)
    q.enqueue("bud", "t", [TaskSpec(f"k{i:02d}", {"tokens": 100, "sleep": 0.2})
                           for i in range(40)])
    r = cli("budget", "set", "--batch", "bud", "--tokens", "1000", dsn=dsn)
    assert r.returncode == 0, r.stderr
    workers = _workers(dsn, "bud", 4, f"{H}:spend_at_end", tmp_path)

    def stopped() -> bool:
        counts = q.counts("bud")
        return counts["leased"] == 0 and q.usage("bud", by_status=False).exhausted

    wait_for(stopped, timeout=90, what="the budget to stop the batch")
    time.sleep(1.0)  # workers keep polling: nothing more is claimed
    counts = q.counts("bud")
    used = q.usage("bud")
    assert counts["leased"] == 0 and counts["pending"] > 0
    assert used.exhausted and used.tokens >= 1000
    # overshoot: at most what was in flight (4 workers x 1 task x 100 tokens)
    assert used.tokens - 1000 <= 4 * 100
    assert used.tokens == 100 * counts["done"]
    data = json.loads(cli("usage", "--batch", "bud", "--json", dsn=dsn, check=True).stdout)
    assert data["exhausted"] is True and data["total"]["tokens"] == used.tokens
    assert data["budget"] == {"tokens": 1000, "cost": None}
    assert data["by_status"]["done"]["tokens"] == used.tokens
    status = json.loads(cli("status", "--batch", "bud", "--json", dsn=dsn, check=True).stdout)
    assert status["tokens"] == used.tokens and status["budget_exhausted"] is True
    cli("budget", "set", "--batch", "bud", "--tokens", "100000", dsn=dsn, check=True)
    _finish(workers, tmp_path)
    assert q.counts("bud")["done"] == 40
    final = q.usage("bud")
    assert final.tokens == 4000 and not final.exhausted
    assert final.cost == Decimal("0.40")


def test_usage_is_kept_per_attempt_and_adds_up(dsn, conn, tmp_path):
    q = Queue(conn)
    q.enqueue("att", "t", [TaskSpec("a"), TaskSpec("b")])
    workers = _workers(dsn, "att", 1, f"{H}:fails_once_after_spending", tmp_path,
                       "--backoff-base", "0.05", "--backoff-cap", "0.1")
    _finish(workers, tmp_path)
    rows = conn.execute("SELECT attempt, tokens, input_tokens, output_tokens, cost, reports"
                        " FROM agent_task_usage ORDER BY task_id, attempt").fetchall()
    assert [(r["attempt"], r["tokens"], r["reports"]) for r in rows] == [
        (1, 15, 2), (2, 15, 2), (1, 15, 2), (2, 15, 2)]
    assert {(r["input_tokens"], r["output_tokens"], r["cost"]) for r in rows} == {
        (7, 3, Decimal("0.25"))}
    used = q.usage("att")
    assert (used.tokens, used.cost) == (60, Decimal("1.00"))
    assert used.by_status == {"done": {"tasks": 2, "attempts": 4, "tokens": 60,
                                       "input_tokens": 28, "output_tokens": 12,
                                       "cost": Decimal("1.00")}}


def test_command_handler_reports_usage_and_exit_76_throttles(dsn, conn, tmp_path):
    cli("limit", "set", "api", "--requests", "100", "--per", "1", dsn=dsn, check=True)
    marks = tmp_path / "marks"
    marks.mkdir()
    command = (
        'echo \'{"input_tokens": 10, "output_tokens": 5, "cost": 0.5}\' '
        '>> "$JOBRUNNER_USAGE_FILE"; '
        f'if [ ! -e "{marks}/$JOBRUNNER_TASK_KEY" ]; then touch "{marks}/$JOBRUNNER_TASK_KEY"; '
        'echo \'{"retry_after": 0.3, "limit": "api"}\' >> "$JOBRUNNER_USAGE_FILE"; exit 76; fi; '
        'echo \'{"ok": true}\'')
    cli("enqueue", "--batch", "cmd", "--tenant", "t", "--max-attempts", "1", "-", dsn=dsn,
        input=_jsonl([{"key": f"k{i}", "limits": ["api"]} for i in range(3)]), check=True)
    r = cli("worker", "--batch", "cmd", "--handler-cmd", command, "--exit-when-drained",
            dsn=dsn, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = conn.execute("SELECT status, attempts, throttles, result FROM agent_work_queue"
                        " WHERE batch_id = 'cmd'").fetchall()
    assert [(r["status"], r["attempts"], r["throttles"], r["result"]) for r in rows] == [
        ("done", 1, 1, {"ok": True})] * 3
    used = Queue(conn).usage("cmd")
    assert (used.tokens, used.input_tokens, used.output_tokens, used.cost) == (
        90, 60, 30, Decimal("3.0"))
    assert limits.list_limits(conn, ["api"])[0].blocked_seconds > 0


# -- in-process: what the claim statement does ------------------------------------------
def test_a_report_settles_the_token_limit_at_once_not_at_the_ack(conn):
    """When the settlement happens, checked rather than excused: the lane's token clock
    moves by (actual - estimate) tokens' worth of time in the report's own transaction,
    while the task is still leased; the ack changes nothing more. (The 8-worker test
    below measures the bound this gives; a settlement deferred to the ack would let every
    claim before the ack spend on the estimate.)"""
    q = Queue(conn)
    limits.set_limit(conn, "tok", tokens=1000, per=1)
    q.enqueue("st", "t", [TaskSpec("a", tokens=50, limits=("tok",))])
    (lease,) = q.claim("st", "w1")

    def tat() -> float:
        t = conn.execute("SELECT extract(epoch FROM max(token_tat))::float8 AS t"
                         " FROM agent_limit_lane WHERE limit_name = 'tok'").fetchone()["t"]
        conn.commit()
        return t

    charged = tat()
    limits.record_usage(conn, lease.id, lease.attempt, Usage(tokens=550))
    settled = tat()
    assert settled - charged == pytest.approx(0.5, abs=1e-3)  # 500 tokens more, at 1000/s
    assert q.counts("st")["leased"] == 1  # before the ack
    limits.record_usage(conn, lease.id, lease.attempt, Usage(tokens=100))  # a second report
    assert tat() - settled == pytest.approx(0.1, abs=1e-3)  # adds all of its tokens
    assert q.ack("w1", lease, None)
    assert tat() - settled == pytest.approx(0.1, abs=1e-3)  # the ack settles nothing


def test_full_limits_are_skipped_and_other_tasks_proceed(conn):
    q = Queue(conn)
    limits.set_limit(conn, "slow", requests=1, per=3600)
    q.enqueue("mix", "t", [TaskSpec(f"a{i}", limits=("slow",)) for i in range(5)]
              + [TaskSpec(f"b{i}") for i in range(3)])
    first = q.claim("mix", "w1", limit=10)
    # one request per hour: one task of the limit, and every task without it
    assert sorted(lease.key for lease in first) == ["a0", "b0", "b1", "b2"]
    assert q.claim("mix", "w1", limit=10) == [] and q.limit_wait and q.limit_wait > 3000
    assert q.counts("mix") == {"pending": 4, "leased": 4, "done": 0, "dead": 0,
                               "cancelled": 0}


def test_a_group_claim_is_admitted_only_if_it_fits_the_window(conn):
    q = Queue(conn)
    limits.set_limit(conn, "ten", requests=10, per=3600)
    q.enqueue("grp", "t", [TaskSpec(f"a{i:02d}", limits=("ten",)) for i in range(30)])
    # An idle limit admits at most `requests` at once, then one per interval (6 min).
    assert len(q.claim("grp", "w1", limit=30)) == 10
    assert q.claim("grp", "w1", limit=30) == []
    # Idle for n - 1 intervals: a group of n fits (here 5 intervals: 6 tasks).
    conn.execute("UPDATE agent_limit_lane SET request_tat = now() - interval '30 min'")
    conn.commit()
    assert len(q.claim("grp", "w1", limit=30)) == 6


def test_concurrency_slots_free_on_ack_fail_throttle_release_and_expiry(conn):
    q = Queue(conn, Timing(visibility_timeout=60, backoff_base=0.001, backoff_cap=0.001))
    limits.set_limit(conn, "one", max_concurrent=1)
    q.enqueue("slots", "t", [TaskSpec(f"k{i}", limits=("one",)) for i in range(8)])

    def take() -> list:
        leases = q.claim("slots", "w", limit=5)
        assert len(leases) <= 1
        assert q.claim("slots", "w2", limit=5) == []  # the slot is taken
        return leases

    (lease,) = take()
    assert q.ack("w", lease, {"ok": 1})
    (lease,) = take()
    assert q.fail("w", lease, "boom") == "pending"
    time.sleep(0.01)
    (lease,) = take()
    assert q.complete("w", [Outcome(lease, False, error="429", throttle_after=0.0)])
    (lease,) = take()
    assert q.release("w", [lease]) == {lease.id}
    (lease,) = take()
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'"
                 " WHERE id = %s", (lease.id,))
    conn.commit()
    assert len(q.expire()) == 1
    (lease,) = take()
    assert conn.execute("SELECT count(*) AS n FROM agent_limit_lease").fetchone()["n"] == 1
    conn.rollback()


# -- bad input -----------------------------------------------------------------------------
def _nothing_written(conn, batch: str) -> bool:
    n = conn.execute("SELECT count(*) AS n FROM agent_work_queue WHERE batch_id = %s",
                     (batch,)).fetchone()["n"]
    conn.rollback()
    return n == 0


def test_unknown_limit_refuses_the_whole_enqueue(dsn, conn):
    cli("limit", "set", "api", "--requests", "5", dsn=dsn, check=True)
    lines = _jsonl([{"key": "ok", "limits": ["api"]}, {"key": "bad", "limits": ["api", "nope"]}])
    r = cli("enqueue", "--batch", "B", "--tenant", "t", "-", dsn=dsn, input=lines)
    assert r.returncode == 2
    assert "unknown limit 'nope'" in r.stderr and "task 'bad'" in r.stderr
    assert _nothing_written(conn, "B")
    with pytest.raises(BadInput, match="unknown limit 'gone'"):
        Queue(conn).enqueue("B2", "t", [TaskSpec("x")], limits=["gone"])
    assert _nothing_written(conn, "B2")


@pytest.mark.parametrize("line, message", [
    ({"key": "a", "limits": "api"}, "limits must be a list of limit names"),
    ({"key": "a", "limits": [""]}, "limit name must not be empty"),
    ({"key": "a", "limits": [3]}, "limit name must be a string"),
    ({"key": "a", "tokens": -5}, "tokens must be between 0"),
    ({"key": "a", "tokens": 1.5}, "tokens must be a whole number"),
])
def test_bad_limits_and_tokens_in_enqueue_lines(dsn, conn, line, message):
    cli("limit", "set", "api", "--requests", "5", dsn=dsn, check=True)
    r = cli("enqueue", "--batch", "B", "--tenant", "t", "-", dsn=dsn,
            input=_jsonl([{"key": "fine"}, line]))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert _nothing_written(conn, "B")


@pytest.mark.parametrize("args, message", [
    (["--requests", "0"], "requests must be greater than 0"),
    (["--requests", "-3"], "requests must be greater than 0"),
    (["--tokens", "0"], "tokens must be greater than 0"),
    (["--max-concurrent", "-1"], "max concurrent must be greater than 0"),
    (["--requests", "5", "--per", "0"], "per must be greater than 0"),
    (["--requests", "5", "--per", "-2"], "per must be greater than 0"),
    ([], "give at least one of --requests, --tokens, --max-concurrent"),
])
def test_bad_limit_values_are_refused_and_nothing_is_written(dsn, conn, args, message):
    r = cli("limit", "set", "x", *args, dsn=dsn)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert json.loads(cli("limit", "list", "--json", dsn=dsn, check=True).stdout) == []


def test_limit_cli_set_update_list_delete(dsn, conn):
    r = cli("limit", "set", "api", "--requests", "60", "--tokens", "90000", dsn=dsn)
    assert r.returncode == 0 and "created limit api: 60 requests and 90000 tokens per 60s" \
        in r.stdout, r.stdout + r.stderr
    r = cli("limit", "set", "api", "--max-concurrent", "4", "--per", "30", dsn=dsn, check=True)
    assert "updated limit api" in r.stdout
    (row,) = json.loads(cli("limit", "list", "--json", dsn=dsn, check=True).stdout)
    assert {k: row[k] for k in ("name", "requests", "tokens", "per_seconds", "max_concurrent",
                                "in_flight", "blocked_until")} == {
        "name": "api", "requests": 60, "tokens": 90000, "per_seconds": 30.0,
        "max_concurrent": 4, "in_flight": 0, "blocked_until": None}
    assert "api" in cli("limit", "list", dsn=dsn, check=True).stdout
    Queue(conn).enqueue("B", "t", [TaskSpec("a", limits=("api",))])
    r = cli("limit", "delete", "api", dsn=dsn)
    assert r.returncode == 2 and "named by 1 pending or leased task" in r.stderr
    Queue(conn).cancel("B")
    cli("limit", "delete", "api", dsn=dsn, check=True)
    assert json.loads(cli("limit", "list", "--json", dsn=dsn, check=True).stdout) == []
    r = cli("limit", "delete", "api", dsn=dsn)
    assert r.returncode == 2 and "no limit named 'api'" in r.stderr


def test_batch_defaults_apply_to_tasks_without_their_own(conn):
    q = Queue(conn)
    limits.set_limit(conn, "a", requests=100)
    limits.set_limit(conn, "b", tokens=1000)
    q.enqueue("D", "t", [TaskSpec("own", limits=("b",), tokens=7), TaskSpec("default")],
              limits=["a"], tokens=42)
    rows = {r["task_key"]: (r["limits"], r["tokens"]) for r in conn.execute(
        "SELECT task_key, limits, tokens FROM agent_work_queue WHERE batch_id = 'D'")}
    assert rows == {"own": (["b"], 7), "default": (["a"], 42)}
    conn.rollback()


def test_bad_usage_reports_are_refused():
    with pytest.raises(BadInput, match="tokens must be between 0"):
        limits.Usage.of(tokens=-1)
    with pytest.raises(BadInput, match="cost must be between 0"):
        limits.Usage.of(cost=-0.5)
    assert limits.Usage.of(input_tokens=3, output_tokens=4).tokens == 7
    reports, throttled = read_usage_file(
        '{"tokens": 5}\nnot json\n{"retry_after": 2, "limit": "x"}\n{"cost": "bad"}\n')
    assert [u.tokens for u in reports] == [5]
    assert throttled is not None and (throttled.retry_after, throttled.limit) == (2.0, "x")


def test_rate_limited_error_is_exported():
    import jobrunner

    exc = jobrunner.RateLimited(retry_after=12, limit="openai")
    assert (exc.retry_after, exc.limit) == (12.0, "openai")
    assert jobrunner.RateLimited(retry_after="nonsense").retry_after == 30.0


def test_the_two_claim_statements_share_their_ack_half():
    """ack_and_claim and ack_and_claim_limited (docs/flow-control.md, "Two claim
    statements") must ack, release and tag rows identically: the shared text is kept
    identical, so a change to one that is not made to the other fails here."""
    from jobrunner.store.sqlfiles import query

    plain, limited = query("task_ack_and_claim"), query("task_ack_and_claim_limited")

    def between(text: str, start: str, end: str) -> str:
        return text[text.index(start):text.index(end, text.index(start))]

    assert between(plain, "WITH lockable AS", "candidates AS (") == between(
        limited, "WITH lockable AS", "candidates AS (")
    assert between(plain, "SELECT 'acked' AS outcome", "FROM claimed") == between(
        limited, "SELECT 'acked' AS outcome", "FROM claimed")
    for cte in ("one_per_shard AS (", "shard_leases AS (", "claimed AS ("):
        assert cte in plain and cte in limited
