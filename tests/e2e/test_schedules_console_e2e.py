"""The console's schedules on the real cluster (issue 28: "schedules (next run, history)",
"trigger a schedule"): `jobrunner serve` has no Kubernetes access, so

- the controller writes each BatchRunSchedule's state (cron, zone, suspended, next run)
  into the database of its template, and deletes the row with the schedule;
- "Trigger now" (an admin key over HTTP, CSRF token included) inserts a request that the
  controller takes within seconds and answers on its row: a run named
  <schedule>-manual-console-<id> that runs to Succeeded;
- a request the console would not send (another tenant's schedule, a schedule that does
  not exist: a forged row) is refused by the controller, with why on its row, and no run.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import httpx
import psycopg
from psycopg.rows import dict_row

from jobrunner.store import schedules
from tests.support.console import ConsoleServer

from .operator_support import get, wait_phase
from .test_schedules_e2e import _quick, _runs, _schedule, _status, _wait


def _row(dsn: str, table: str, **where) -> dict | None:
    # (a constant table name of this test; the values are parameters)
    clause = " AND ".join(f"{k} = %({k})s" for k in where)
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(f"SELECT * FROM {table} WHERE {clause}", where).fetchone()


def test_the_console_shows_schedules_and_triggers_them_through_the_database(
        k8s, namespace, dsn, operator, tmp_path):
    ns = namespace
    k8s.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(json.dumps(s) for s in (
        _schedule("nightly", _quick("acme"), schedule="0 3 * * *", timeZone="Europe/Paris",
                  concurrencyPolicy="Forbid"),
        _schedule("report", _quick("globex"), schedule="@hourly", suspend=True))))

    # --- the controller writes each schedule's state into the template's database
    nightly = _wait("nightly's row", lambda: (r := _row(dsn, "agent_schedule", namespace=ns,
                                                        name="nightly")) and r["next_run_at"]
                    and r, 60, controller=operator)
    status = _status(k8s, ns, "nightly")
    assert nightly["next_run_at"] == dt.datetime.fromisoformat(
        status["nextScheduleTime"].replace("Z", "+00:00"))
    assert (nightly["tenant_id"], nightly["schedule"], nightly["time_zone"], nightly["suspend"],
            nightly["concurrency_policy"], nightly["ready"]) == (
        "acme", "0 3 * * *", "Europe/Paris", False, "Forbid", "Scheduled")
    report = _wait("report's row", lambda: _row(dsn, "agent_schedule", namespace=ns,
                                                name="report"), 60, controller=operator)
    assert (report["tenant_id"], report["suspend"], report["next_run_at"], report["ready"]) == (
        "globex", True, None, "Suspended")
    print(f"nightly's next run in the database: {nightly['next_run_at']:%Y-%m-%d %H:%M:%S} UTC "
          f"(status.nextScheduleTime {status['nextScheduleTime']})")

    # --- "Trigger now" through the console, as acme's admin
    server = ConsoleServer(dsn, tmp_path).start()
    try:
        admin = server.key("acme", "admin")
        with httpx.Client(base_url=server.url, timeout=10,
                          headers={"Authorization": f"Bearer {admin}"}) as c:
            page = c.get("/console/schedules").text
            assert f'data-schedule="{ns}/nightly"' in page and f"{ns}/report" not in page
            assert f"{nightly['next_run_at']:%Y-%m-%d %H:%M:%S} UTC" in page
            token = re.search(r'name="csrf" value="([0-9a-f]+)"', page)[1]
            assert c.post(f"/console/schedules/{ns}/report/trigger",
                          data={"csrf": token}).status_code == 404  # (globex's)
            sent = c.post(f"/console/schedules/{ns}/nightly/trigger", data={"csrf": token},
                          follow_redirects=False)
            assert sent.status_code == 303, sent.text
            trigger = int(re.search(r"triggered-(\d+)", sent.headers["location"])[1])
            t0 = time.monotonic()
            run = f"nightly-manual-console-{trigger}"
            answer = _wait("the controller's answer", lambda: (r := _row(
                dsn, "agent_schedule_trigger", id=trigger)) and r["taken_at"] and r, 30,
                controller=operator)
            print(f"trigger {trigger} answered {time.monotonic() - t0:.1f}s after the POST: "
                  f"{answer['outcome']} {answer['run_name']}")
            assert (answer["outcome"], answer["run_name"]) == ("started", run)
            assert set(_runs(k8s, ns, "nightly")) == {run}
            br = get(k8s, "br", run, ns)
            assert br["metadata"]["annotations"]["jobrunner.dev/trigger"] == (
                f"console-{trigger}")
            wait_phase(k8s, run, ns, ("Succeeded",), timeout=180)

            # --- forged requests: the controller checks the tenant and the schedule itself
            with psycopg.connect(dsn, autocommit=True) as conn:
                foreign = schedules.request_trigger(conn, namespace=ns, name="report",
                                                    tenant_id="acme",
                                                    requested_by="forged")["id"]
                missing = schedules.request_trigger(conn, namespace=ns, name="nope",
                                                    tenant_id="*",
                                                    requested_by="forged")["id"]
            for request, why in ((foreign, "is not the tenant of this schedule's runs"),
                                 (missing, f"there is no BatchRunSchedule {ns}/nope")):
                refused = _wait(f"request {request} answered", lambda r=request: (
                    row := _row(dsn, "agent_schedule_trigger", id=r)) and row["taken_at"]
                    and row, 30, controller=operator)
                assert refused["outcome"] == "refused" and refused["run_name"] is None
                assert why in refused["message"], refused["message"]
            assert _runs(k8s, ns, "report") == {}
            page = c.get("/console/schedules").text
            assert f"started {run}" in page
            assert "is not the tenant of this schedule" in page  # (acme's own request)
    finally:
        server.stop()

    # --- a deleted schedule's row goes with it
    k8s.kubectl("delete", "brs", "report", "-n", ns, "--wait=true", "--timeout=60s")
    _wait("report's row deleted", lambda: _row(dsn, "agent_schedule", namespace=ns,
                                               name="report") is None, 30, controller=operator)
    assert _row(dsn, "agent_schedule", namespace=ns, name="nightly") is not None
