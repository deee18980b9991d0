"""Hundreds of calls in flight in one worker process (issue 30, item 3), on a real worker
process and a real server:

- 300 async tasks in flight in one process run on its event loop (a handful of threads,
  not 300), and their leases are renewed by ONE statement per heartbeat interval;
- a lease stolen from one of 50 in-flight async tasks is fenced: that task's coroutine
  is cancelled, its outcome never recorded, the thief's lease untouched; the others end
  done;
- a slow claim path does not idle slots: claims refill every free slot at once, so the
  number of claim statements does not grow with the number of slots.

Statements are counted by a witness this test owns: a statement-level trigger on the
queue table that records, per UPDATE statement, the connection's application_name, the
statement's text and how many rows it changed (a transition table). The worker's own
counters are not used.
"""

from __future__ import annotations

import signal
import time

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.figures import show
from tests.support.processes import start_worker, wait_for

HANDLER = "tests.support.handlers:async_wait"

WITNESS = """
CREATE TABLE stmt_witness (app text, query text, n_rows int, at timestamptz);
CREATE FUNCTION stmt_witness() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO stmt_witness
    SELECT current_setting('application_name'), current_query(), count(*), clock_timestamp()
    FROM changed;
    IF current_setting('application_name') LIKE 'jobrunner-worker %%'
       AND to_regclass('slow_claims') IS NOT NULL THEN
        PERFORM pg_sleep((SELECT seconds FROM slow_claims));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER stmt_witness AFTER UPDATE ON agent_work_queue
REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION stmt_witness();
"""
# the heartbeat's statement (sql/queries/tasks.sql, task_heartbeat), nothing else sets this
HEARTBEAT = "%SET locked_until = now() + make_interval(secs => $%AS t(id, attempt)%"


def _witness(conn, slow_claims: float | None = None) -> None:
    conn.execute(WITNESS)
    if slow_claims is not None:
        conn.execute("CREATE TABLE slow_claims (seconds float)")
        conn.execute("INSERT INTO slow_claims VALUES (%s)", (slow_claims,))
    conn.commit()


def _one(conn, sql: str, *args):
    row = conn.execute(sql, args).fetchone()
    conn.rollback()
    return row


def _stop(worker) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
    worker.wait(60)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def test_300_in_flight_tasks_are_heartbeated_by_one_statement_per_interval(
        dsn, conn, tmp_path, capsys):
    _witness(conn)
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 6}) for i in range(300)])
    worker = start_worker(dsn, "b", HANDLER, "--concurrency", "300", "--batch-size", "300",
                          "--visibility-timeout", "3", "--heartbeat", "0.5",
                          log=tmp_path / "w.log")
    try:
        wait_for(lambda: _one(conn, "SELECT count(*) AS n FROM agent_work_queue "
                                    "WHERE status = 'leased'")["n"] == 300,
                 timeout=30, what="300 tasks in flight")
        threads = _threads(worker.pid)
        window_start = _one(conn, "SELECT clock_timestamp() AS t")["t"]
        time.sleep(3.0)
        rows = conn.execute(
            "SELECT app, n_rows FROM stmt_witness WHERE query LIKE %s AND at >= %s",
            (HEARTBEAT, window_start)).fetchall()
        conn.rollback()
        leased = _one(conn, "SELECT count(*) AS n FROM agent_work_queue "
                            "WHERE status = 'leased'")["n"]
    finally:
        _stop(worker)
    show(capsys, f"300 async tasks in flight: {len(rows)} heartbeat statement(s) in 3 s at a "
         f"0.5 s interval, rows renewed each: {sorted({r['n_rows'] for r in rows})}; the "
         f"process had {threads} threads")
    assert leased == 300  # (still all in flight while watched: the window meant something)
    # Every 0.5 s one statement renews all 300 leases: 6 in 3 s (+-1 for the window's
    # edges and the heartbeat thread's 0.25 s tick). One per task would be 1,800.
    assert 4 <= len(rows) <= 8, rows
    assert all(r["n_rows"] == 300 for r in rows), rows
    assert len({r["app"] for r in rows}) == 1
    # On the event loop, not a thread per task (main, heartbeat, notifier, the loop,
    # psycopg's and the default executor's few)
    assert threads < 40, threads


def test_a_lease_stolen_from_an_in_flight_async_task_is_fenced(dsn, conn, tmp_path):
    marks = tmp_path / "marks"
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 4, "marks": str(marks)})
                                      for i in range(50)])
    worker = start_worker(dsn, "b", HANDLER, "--concurrency", "50", "--visibility-timeout",
                          "3", "--heartbeat", "0.5", "--exit-when-drained",
                          log=tmp_path / "w.log")
    try:
        wait_for(lambda: _one(conn, "SELECT count(*) AS n FROM agent_work_queue "
                                    "WHERE status = 'leased'")["n"] == 50,
                 timeout=30, what="50 tasks in flight")
        # Someone else takes t7 over (as after an expiry and a new claim), for an hour.
        conn.execute("UPDATE agent_work_queue SET lease_owner = 'intruder', "
                     "attempts = attempts + 1, locked_until = now() + interval '1 hour' "
                     "WHERE task_key = 't7'")
        conn.commit()
        wait_for(lambda: _one(conn, "SELECT count(*) AS n FROM agent_work_queue "
                                    "WHERE status = 'done'")["n"] == 49,
                 timeout=30, what="the other 49 done")
        time.sleep(1.0)
        r = _one(conn, "SELECT status, lease_owner, result FROM agent_work_queue "
                       "WHERE task_key = 't7'")
    finally:
        _stop(worker)
    log = (tmp_path / "w.log").read_text()
    finished = {line.split()[0] for line in marks.read_text().splitlines()}
    assert (r["status"], r["lease_owner"], r["result"]) == ("leased", "intruder", None)
    assert "t7" not in finished  # its coroutine was cancelled, not left to run to its end
    assert len(finished) == 49
    assert "lease lost" in log and "'lost': 1" in log, log[-2000:]


def test_a_slow_claim_path_does_not_idle_slots(dsn, conn, tmp_path, capsys):
    # Every statement of the worker's queue connection (claims, acks with them) takes
    # 0.2 s more on the server. Claiming a slot at a time, 200 tasks would need 200
    # claims, 40 s of them; refilling every free slot at once, a few per slot-cycle.
    _witness(conn, slow_claims=0.2)
    marks = tmp_path / "marks"
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {"sleep": 0.5, "marks": str(marks)})
                                      for i in range(200)])
    start = time.monotonic()
    worker = start_worker(dsn, "b", HANDLER, "--concurrency", "50", "--exit-when-drained",
                          log=tmp_path / "w.log")
    try:
        assert worker.wait(60) == 0
    finally:
        _stop(worker)
    wall = time.monotonic() - start
    claims = _one(conn, "SELECT count(*) AS n FROM stmt_witness "
                        "WHERE app LIKE 'jobrunner-worker %%'")["n"]
    spans = [tuple(map(float, line.split()[1:])) for line in marks.read_text().splitlines()]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    busy = sum(e - s for s, e in spans) / (50 * (last - first))
    show(capsys, f"slow claims (+0.2 s each), 200 tasks of 0.5 s at concurrency 50: "
         f"{claims} statements of the queue connection, {wall:.1f} s in all, slots busy "
         f"{busy:.0%} from the first start to the last end")
    assert Queue(conn).counts("b")["done"] == 200
    # 200 / 50 = 4 refills at least; each refill's statement is slow, so the tasks that
    # finish meanwhile are claimed together by the next one. A claim per slot: 200.
    assert claims <= 40, claims
    # 0.5 s of work to 0.2 s+ of claim per cycle: at best about 70 % busy; a claim per
    # slot on the one queue connection would leave them mostly idle (under 10 %).
    assert busy >= 0.4, busy
