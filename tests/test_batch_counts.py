"""The open batches' counts behind `batches.retrieve` (jobrunner/server/counts.py): however
many clients poll one batch, a replica counts it about once per half `max_age`, and no
retrieve answers with figures older than `max_age`.

Real PostgreSQL and a real batch; the number of counts is the number of `batch_counts`
statements the store ran (its function wrapped), the staleness is checked against the
moment the test's own update committed."""

from __future__ import annotations

import threading
import time

from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.server.counts import LiveCounts
from jobrunner.store import batch_api

MAX_AGE = 0.5
POLLERS, SECONDS = 8, 3.0


def test_pollers_share_one_count_and_never_see_figures_older_than_max_age(
        dsn, conn, monkeypatch) -> None:
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {}) for i in range(2000)])
    conn.commit()
    counted = []
    real = batch_api.task_counts

    def counting(c, batch_id):
        counted.append(time.monotonic())
        return real(c, batch_id)

    monkeypatch.setattr(batch_api, "task_counts", counting)

    live = LiveCounts(max_age=MAX_AGE)
    stop = threading.Event()
    # (what the server's counter thread does: app.py, every max_age / 4)
    reads: list[tuple[float, int]] = []  # (when a read began, its done count)
    errors: list[BaseException] = []
    done_at: list[float] = []
    with ConnectionPool(dsn, min_size=1, max_size=POLLERS + 1,
                        kwargs={"row_factory": dict_row}) as pool:
        def refresher() -> None:
            while not stop.wait(MAX_AGE / 4):
                with pool.connection() as c:
                    live.refresh(c)

        def poller() -> None:
            try:
                while not stop.is_set():
                    began = time.monotonic()
                    with pool.connection() as c:
                        reads.append((began, live.read(c, "b")["completed"]))
            except BaseException as exc:  # (reported by the test thread)
                errors.append(exc)

        threads = [threading.Thread(target=refresher)] + [
            threading.Thread(target=poller) for _ in range(POLLERS)]
        start = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(SECONDS / 2)
        conn.execute("UPDATE agent_work_queue SET status = 'done', finished_at = now()"
                     " WHERE batch_id = 'b' AND task_key IN ('t1', 't2', 't3')")
        conn.commit()
        done_at.append(time.monotonic())
        time.sleep(SECONDS / 2)
        stop.set()
        for t in threads:
            t.join(10)
        elapsed = time.monotonic() - start

    assert not errors, errors
    assert len(reads) >= 3 * len(counted), (len(reads), len(counted))
    # The counter thread's, at most one per half max_age, and the readers' own when it
    # falls behind (a starved thread): one at a time, each fresh for max_age.
    bound = elapsed / (MAX_AGE / 2) + elapsed / MAX_AGE + 1
    assert len(counted) <= bound, (len(counted), bound)
    # Every read that began max_age after the update committed shows it.
    late = [n for began, n in reads if began >= done_at[0] + MAX_AGE]
    assert late and all(n == 3 for n in late), sorted(set(late))
    assert any(n == 0 for _, n in reads)  # (the pollers did start before the update)


def test_without_the_counter_thread_a_read_recounts_figures_older_than_max_age(
        dsn, conn) -> None:
    """The counter thread may fall behind (a busy replica): a read then counts for
    itself rather than answer with figures older than max_age."""
    Queue(conn).enqueue("b", "acme", [TaskSpec(f"t{i}", {}) for i in range(10)])
    conn.commit()
    live = LiveCounts(max_age=MAX_AGE)
    with ConnectionPool(dsn, min_size=1, max_size=2, kwargs={"row_factory": dict_row}) as pool:
        with pool.connection() as c:
            assert live.read(c, "b")["completed"] == 0
        conn.execute("UPDATE agent_work_queue SET status = 'done', finished_at = now()"
                     " WHERE batch_id = 'b' AND task_key = 't1'")
        conn.commit()
        committed = time.monotonic()
        with pool.connection() as c:
            early = live.read(c, "b")["completed"]  # (cached: within max_age, may lag)
        time.sleep(max(0.0, committed + MAX_AGE - time.monotonic()) + 0.01)
        with pool.connection() as c:
            assert live.read(c, "b")["completed"] == 1
    assert early in (0, 1)
