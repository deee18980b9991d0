"""BatchRunSchedule logic without a cluster: start times in a time zone (DST included),
missed start times after a downtime (capped), the starting deadline, run names; the CRD
copy; the queue rule Replace relies on (a cancelled batch strands nothing); and the
console's trigger requests, taken once by concurrent pollers (real PostgreSQL)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from pathlib import Path

import psycopg
import pytest
import yaml

from jobrunner.model.validation import TaskSpec
from jobrunner.operator.schedule_times import (
    MAX_MISSED,
    BadSchedule,
    check_trigger_value,
    due,
    manual_run_name,
    parse_schedule,
    run_name,
)
from jobrunner.queue.client import Queue

REPO = Path(__file__).resolve().parent.parent
UTC = dt.UTC


def t(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s).astimezone(UTC)


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize(("expr", "cron"), [
    ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"), ("@hourly", "0 * * * *"),
    ("@weekly", "0 0 * * 0"), ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"),
    ("@annually", "0 0 1 1 *"), ("*/15  2 * * MON-FRI", "*/15 2 * * MON-FRI")])
def test_macros_and_expressions(expr, cron):
    assert parse_schedule(expr, None).cron == cron


@pytest.mark.parametrize(("expr", "zone", "message"), [
    ("", None, "spec.schedule is empty"),
    ("* * * *", None, "4 field(s), expected 5"),
    ("0 0 * * * *", None, "6 field(s), expected 5"),
    ("@fortnightly", None, "unknown macro"),
    ("61 * * * *", None, "Bad minute"),
    ("0 0 30 2 *", None, "Bad day-of-month"),
    ("TZ=Europe/Paris 0 2 * * *", None, "set spec.timeZone"),
    ("0 2 * * *", "Mars/Olympus", "'Mars/Olympus' is not an IANA time zone"),
    ("0 2 * * *", "../etc/passwd", "is not an IANA time zone"),
])
def test_bad_schedules_say_what_is_wrong(expr, zone, message):
    with pytest.raises(BadSchedule, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_schedule(expr, zone)


# ------------------------------------------------------------------ start times
def test_next_and_latest_start_times_every_minute():
    s = parse_schedule("* * * * *", None)
    assert s.after(t("2026-12-04T21:40:00+00:00")) == t("2026-12-04T21:41:00+00:00")
    assert s.after(t("2026-12-04T21:40:59.9+00:00")) == t("2026-12-04T21:41:00+00:00")
    # at or before: the exact start time counts, fractions of a second too
    assert s.latest_at_or_before(t("2026-12-04T21:40:00+00:00")) == t("2026-12-04T21:40:00+00:00")
    assert s.latest_at_or_before(t("2026-12-04T21:40:00.5+00:00")) == t(
        "2026-12-04T21:40:00+00:00")
    assert s.latest_at_or_before(t("2026-12-04T21:40:59+00:00")) == t("2026-12-04T21:40:00+00:00")


def test_time_zone_moves_the_start_time():
    paris = parse_schedule("0 2 * * *", "Europe/Paris")
    assert paris.after(t("2026-12-04T00:00:00+00:00")) == t("2026-12-04T01:00:00+00:00")  # CET
    assert paris.after(t("2026-07-03T23:00:00+00:00")) == t("2026-07-04T00:00:00+00:00")  # CEST


def test_dst_spring_forward_runs_a_missing_time_once_just_after():
    # 2026-03-08 02:30 does not exist in New York: it runs at 03:00 EDT, once
    ny = parse_schedule("30 2 * * *", "America/New_York")
    first = ny.after(t("2026-03-07T12:00:00-05:00"))
    second = ny.after(first)
    assert first == t("2026-03-08T03:00:00-04:00")
    assert second == t("2026-03-09T02:30:00-04:00")


def test_dst_fall_back_runs_a_repeated_time_once():
    # 2026-11-01 01:30 happens twice in New York: one run, at the first (EDT)
    ny = parse_schedule("30 1 * * *", "America/New_York")
    first = ny.after(t("2026-10-31T12:00:00-04:00"))
    second = ny.after(first)
    assert first == t("2026-11-01T01:30:00-04:00")
    assert second == t("2026-11-02T01:30:00-05:00")
    # hourly through the repeated hour: 01:00 EDT, 01:00 EST are distinct instants; no
    # start time is produced twice
    hourly = parse_schedule("0 * * * *", "America/New_York")
    times, cur = [], t("2026-11-01T00:30:00-04:00")
    for _ in range(4):
        cur = hourly.after(cur)
        times.append(cur)
    assert len(set(times)) == 4 and times == sorted(times)


# ------------------------------------------------------------------ what is due
def test_nothing_due_before_the_first_start_time():
    s = parse_schedule("*/5 * * * *", None)
    d = due(s, earliest=t("2026-12-04T21:41:00+00:00"), now=t("2026-12-04T21:44:59+00:00"),
            deadline_seconds=None)
    assert d.time is None and d.next_time == t("2026-12-04T21:45:00+00:00")


def test_due_at_the_start_time_exactly_and_only_once():
    s = parse_schedule("*/5 * * * *", None)
    d = due(s, earliest=t("2026-12-04T21:41:00+00:00"), now=t("2026-12-04T21:45:00+00:00"),
            deadline_seconds=None)
    assert (d.time, d.missed, d.late) == (t("2026-12-04T21:45:00+00:00"), 0, False)
    # once handled (earliest = that time), it is not due again
    again = due(s, earliest=d.time, now=t("2026-12-04T21:49:00+00:00"), deadline_seconds=None)
    assert again.time is None


def test_after_a_downtime_only_the_latest_missed_time_runs():
    s = parse_schedule("0 * * * *", None)
    d = due(s, earliest=t("2026-12-04T10:00:00+00:00"), now=t("2026-12-04T15:20:00+00:00"),
            deadline_seconds=None)
    assert d.time == t("2026-12-04T15:00:00+00:00")
    assert d.missed == 4 and not d.capped and not d.late  # 11:00 .. 14:00 never run


def test_missed_times_scan_is_capped():
    s = parse_schedule("* * * * *", None)
    d = due(s, earliest=t("2025-12-04T10:00:00+00:00"), now=t("2026-12-04T15:20:30+00:00"),
            deadline_seconds=None)
    assert d.time == t("2026-12-04T15:20:00+00:00")
    assert d.capped and d.missed == MAX_MISSED  # a year of minutes, 101 steps scanned


def test_starting_deadline_skips_a_late_start():
    s = parse_schedule("0 * * * *", None)
    on_time = due(s, earliest=t("2026-12-04T14:00:00+00:00"),
                  now=t("2026-12-04T15:00:59+00:00"), deadline_seconds=60)
    late = due(s, earliest=t("2026-12-04T14:00:00+00:00"),
               now=t("2026-12-04T15:01:01+00:00"), deadline_seconds=60)
    assert on_time.time == late.time == t("2026-12-04T15:00:00+00:00")
    assert not on_time.late and late.late


def test_run_names_are_the_start_time_in_minutes():
    at = t("2026-12-04T21:45:00+00:00")
    assert run_name("nightly", at) == f"nightly-{int(at.timestamp()) // 60}"
    # the same start time seen from any zone is the same name: one run per instant
    assert run_name("nightly", at.astimezone(dt.timezone(dt.timedelta(hours=5)))) == run_name(
        "nightly", at)
    assert run_name("nightly", at) != run_name("nightly", at + dt.timedelta(minutes=1))
    assert manual_run_name("nightly", "1733350000") == "nightly-manual-1733350000"


@pytest.mark.parametrize(("value", "ok"), [("1733350000", True), ("retry-2", True),
                                           ("Now", False), ("-x", False), ("a" * 41, False),
                                           ("a b", False)])
def test_trigger_values(value, ok):
    assert (check_trigger_value(value) is None) == ok


# ------------------------------------------------------------------ CRD
def test_chart_ships_the_schedule_crd_byte_identical():
    name = "batchrunschedule.yaml"
    assert (REPO / "charts/jobrunner/crds" / name).read_bytes() == (
        REPO / "crds" / name).read_bytes(), f"cp crds/{name} charts/jobrunner/crds/{name}"


def test_every_schedule_field_is_described():
    crd = yaml.safe_load((REPO / "crds/batchrunschedule.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    blank: list[str] = []

    def walk(node: dict, path: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            here = f"{path}.{key}"
            if path.startswith((".spec", ".status")) and not sub.get("description"):
                blank.append(here)
            walk(sub, here)
        if "items" in node:
            walk(node["items"], path + "[]")

    walk(schema, "")
    assert not blank, blank


def test_chart_rbac_lets_the_controller_run_schedules():
    helpers = (REPO / "charts/jobrunner/templates/_helpers.tpl").read_text()
    assert "batchrunschedules/status" in helpers
    assert "batchrunschedules/finalizers" in helpers
    assert "[get, list, watch, patch, create, delete]" in helpers  # batchruns


# ------------------------------------------------------------------ the queue rule Replace needs
def test_a_cancelled_batch_strands_no_task_released_or_expired(queue: Queue, conn):
    """Replace (and any deletion) cancels a running batch: its pending tasks at once, the
    ones its stopping workers release or leave to expire as they come back."""
    queue.enqueue("b", "acme", [TaskSpec(key=f"t{i}", payload={}) for i in range(3)])
    released, expiring, _ = queue.claim("b", "w-1", limit=3)
    queue.cancel("b")
    assert queue.release("w-1", [released]) == {released.id}
    conn.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'"
                 " WHERE id = %s", (expiring.id,))
    conn.commit()
    assert {r["id"]: r["status"] for r in queue.expire()} == {expiring.id: "cancelled"}
    counts = queue.counts("b")
    print(f"cancelled batch after release + expiry: {counts}")
    assert counts["pending"] == 0 and counts["cancelled"] == 2 and counts["leased"] == 1
    # a batch that was not cancelled still gets its tasks back
    queue.enqueue("c", "acme", [TaskSpec(key="x", payload={})])
    (lease,) = queue.claim("c", "w-2")
    queue.release("w-2", [lease])
    assert queue.counts("c")["pending"] == 1


def test_ticket_grading_schedule_example_matches_its_batchrun():
    """examples/tickets-schedule.yaml runs exactly examples/tickets.yaml every night: the
    template's spec is the BatchRun's (kept in step by this test), it parses as a
    BatchRun, and its schedule has a next start in its time zone."""
    from jobrunner.features.manifest import parse_batchrun

    sched = yaml.safe_load((REPO / "examples/tickets-schedule.yaml").read_text())
    run = yaml.safe_load((REPO / "examples/tickets.yaml").read_text())
    assert sched["kind"] == "BatchRunSchedule"
    assert sched["spec"]["batchRunTemplate"]["spec"] == run["spec"]
    parse_batchrun({**run, "spec": sched["spec"]["batchRunTemplate"]["spec"]})
    s = parse_schedule(sched["spec"]["schedule"], sched["spec"]["timeZone"])
    nxt = s.after(t("2026-12-04T12:00:00+00:00"))
    assert nxt == t("2026-12-05T01:30:00+00:00")  # 02:30 in Berlin (UTC+1 in winter)


# ------------------------------------------------------------------ the console's triggers
def test_trigger_requests_are_taken_once_by_concurrent_polls(dsn):
    """Two controller replicas (or a poll still answering and the next one) poll the same
    database: each request is started once and answered once; a request whose start
    failed for a passing reason stays untaken and the next poll takes it; another
    namespace's requests are left to the controller of that namespace."""
    from jobrunner.operator import schedule_db
    from jobrunner.store import schedules

    with psycopg.connect(dsn, autocommit=True) as c:
        ids = {f"s{i}": schedules.request_trigger(c, namespace="ops", name=f"s{i}",
                                                  tenant_id="acme", requested_by="k")["id"]
               for i in range(6)}
        schedules.request_trigger(c, namespace="elsewhere", name="x", tenant_id="acme",
                                  requested_by="k")
    started: list[int] = []
    lock = threading.Lock()
    away = {"s5"}

    def start(trigger: dict) -> tuple[str, str | None, str]:
        assert trigger["dsn"] == dsn
        with lock:
            started.append(trigger["id"])
        time.sleep(0.2)  # (the API server's answer: the other poll runs meanwhile)
        if trigger["name"] in away:
            raise ConnectionError("the API server is away")
        if trigger["name"] == "s4":
            return schedules.REFUSED, None, "refused: not this tenant's"
        return schedules.STARTED, f"{trigger['name']}-manual-console-{trigger['id']}", "ok"

    answered: list[int] = []
    polls = [threading.Thread(target=lambda: answered.append(
        schedule_db.take(dsn, ["ops"], start))) for _ in range(2)]
    for p in polls:
        p.start()
    for p in polls:
        p.join(30)
    assert sorted(started) == sorted(ids.values())  # each once, across both polls
    assert sum(answered) == 5

    def rows() -> dict[str, tuple]:
        with psycopg.connect(dsn) as c:
            return {r[0]: r[1:] for r in c.execute(
                "SELECT name, outcome, run_name, message, taken_at IS NOT NULL "
                "FROM agent_schedule_trigger ORDER BY id")}

    found = rows()
    assert found["s0"] == ("started", f"s0-manual-console-{ids['s0']}", "ok", True)
    assert found["s4"] == ("refused", None, "refused: not this tenant's", True)
    assert found["s5"] == (None, None, None, False) and found["x"] == (None, None, None, False)
    away.clear()
    started.clear()
    assert schedule_db.take(dsn, ["ops"], start) == 1 and started == [ids["s5"]]
    assert rows()["s5"][0] == "started"
    assert schedule_db.take(dsn, ["ops"], start) == 0


def test_rows_of_schedules_deleted_while_the_controller_was_down_are_pruned(dsn, monkeypatch):
    """The rows of schedules no daemon runs any more go, in the namespaces whose schedules
    this controller runs; another namespace's rows are another controller's."""
    from jobrunner.operator import schedule_db
    from jobrunner.store import schedules

    with psycopg.connect(dsn, autocommit=True) as c:
        for ns, name in (("ops", "kept"), ("ops", "gone"), ("elsewhere", "theirs")):
            schedules.put_state(c, schedules.ScheduleState(
                ns, name, "acme", "@daily", None, False, "Allow", "Scheduled", "", None, None,
                None, ()))
    monkeypatch.setattr(schedule_db, "_registry", {("ops", "kept"): dsn,
                                                   ("ops", "other-db"): "another dsn"})
    assert schedule_db.prune(dsn) == [("ops", "gone")]
    with psycopg.connect(dsn) as c:
        left = c.execute("SELECT namespace, name FROM agent_schedule ORDER BY 1, 2").fetchall()
    assert left == [("elsewhere", "theirs"), ("ops", "kept")]
    assert schedule_db.prune(dsn) == []
