"""BatchRunSchedule on the real cluster (issue 19): four schedules side by side over two
start times of `* * * * *`, with the controller killed just before the second and started
again after it:

- `every` (Allow, successfulRunsHistoryLimit 1): runs named by their start times, exactly
  one per start time across the restart; the older one deleted once the newer succeeded,
  its batch's results untouched;
- `forbid` (Forbid, a long task): the second start time is skipped while the first run is
  active;
- `replace` (Replace, long tasks): the first run is deleted at the second start time, its
  tasks cancelled (pending and running), its pods gone, and the new run runs;
- `manual` (suspended): jobrunner.dev/trigger=<value> starts <name>-manual-<value> once,
  also after that run is deleted; no scheduled run while suspended.

`kubectl get brs -w` and `kubectl get br -w` run throughout; their transcript is printed
(docs/schedules.md).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import threading
import time

import psycopg
from psycopg.rows import dict_row

from jobrunner.queue.client import Queue
from tests.support.handlers import EXEC_LOG_DDL

from .operator_support import events_of, get, pods_of, with_test_handlers

UTC = dt.UTC
FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


def _schedule(name: str, template_spec: dict, **spec) -> dict:
    return {"apiVersion": "jobrunner.dev/v1alpha1", "kind": "BatchRunSchedule",
            "metadata": {"name": name},
            "spec": {"schedule": "* * * * *", **spec,
                     "batchRunTemplate": {"metadata": {"labels": {"team": "e2e"}},
                                          "spec": with_test_handlers(template_spec)}}}


def _quick(tenant: str) -> dict:
    return {"tenant": tenant, "workers": 1, "handler": "tests.support.handlers:noop",
            "shards": [{"key": f"k{i}", "payload": {}} for i in range(2)], **FAST}


def _slow(tenant: str, tasks: int) -> dict:
    return {"tenant": tenant, "workers": 1, "handler": "tests.support.handlers:record",
            "shards": [{"key": f"k{i}", "payload": {"sleep": 300}} for i in range(tasks)],
            **FAST}


def _minutes(t: dt.datetime) -> int:
    return int(t.timestamp()) // 60


def _next_boundary(t: dt.datetime) -> dt.datetime:
    return dt.datetime.fromtimestamp((_minutes(t) + 1) * 60, UTC)


def _sleep_until(t: dt.datetime) -> None:
    time.sleep(max(0.0, (t - dt.datetime.now(UTC)).total_seconds()))


def _runs(k8s, ns: str, schedule: str) -> dict[str, dict]:
    out = k8s.kubectl("get", "batchruns", "-n", ns, "-l", f"jobrunner.dev/schedule={schedule}",
                      "-o", "json").stdout
    return {r["metadata"]["name"]: r for r in json.loads(out)["items"]}


def _wait(what: str, probe, timeout: float, controller=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.5)
    tail = controller.output()[-5000:] if controller else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


def _status(k8s, ns: str, name: str) -> dict:
    return (get(k8s, "brs", name, ns) or {}).get("status") or {}


def test_schedules_fire_by_the_minute_forbid_replace_history_restart_and_trigger(
        k8s, namespace, dsn, operator):
    ns = namespace
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EXEC_LOG_DDL)
    # kubectl watches one resource type at a time: one watch each, lines merged in the
    # order they arrive, stamped with the wall clock
    lines: list[str] = []
    lock = threading.Lock()

    def follow(kind: str) -> subprocess.Popen:
        proc = subprocess.Popen([k8s._bin("kubectl"), "get", kind, "-n", ns, "-w",
                                 "--output-watch-events"],
                                env=k8s.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

        def pump() -> None:
            for line in proc.stdout:
                with lock:
                    lines.append(f"{dt.datetime.now(UTC):%H:%M:%S}  {line.rstrip()}")

        threading.Thread(target=pump, daemon=True).start()
        return proc

    watches = [follow("brs"), follow("br")]
    try:
        _run(k8s, ns, dsn, operator)
    finally:
        for w in watches:
            w.terminate()
            w.wait(10)
        with lock:
            print("\n$ kubectl get brs -w --output-watch-events &\n"
                  "$ kubectl get br -w --output-watch-events\n" + "\n".join(lines))


def _run(k8s, ns: str, dsn: str, operator) -> None:
    schedules = [
        _schedule("every", _quick("every"), successfulRunsHistoryLimit=1),
        _schedule("forbid", _slow("forbid", 1), concurrencyPolicy="Forbid"),
        _schedule("replace", _slow("replace", 2), concurrencyPolicy="Replace"),
        _schedule("manual", _quick("manual"), suspend=True, timeZone="Europe/Paris"),
    ]
    k8s.kubectl("apply", "-n", ns, "-f", "-",
                input="\n---\n".join(json.dumps(s) for s in schedules))
    created = {s["metadata"]["name"]: dt.datetime.fromisoformat(
        get(k8s, "brs", s["metadata"]["name"], ns)["metadata"]["creationTimestamp"]
        .replace("Z", "+00:00")) for s in schedules}
    first = {name: _next_boundary(t) for name, t in created.items()}
    print(f"schedules created at {created['every']:%H:%M:%S}; first start time "
          f"{first['every']:%H:%M:%S}")
    _bad_input(k8s, ns, operator)

    # --- the first start time: one run each, named by it
    for name in ("every", "forbid", "replace"):
        run = f"{name}-{_minutes(first[name])}"
        _wait(f"BatchRun {run}", lambda n=name, r=run: r in _runs(k8s, ns, n),
              timeout=(first[name] - dt.datetime.now(UTC)).total_seconds() + 60,
              controller=operator)
    every1, replace1 = (f"every-{_minutes(first['every'])}",
                        f"replace-{_minutes(first['replace'])}")
    br = _runs(k8s, ns, "every")[every1]
    assert br["metadata"]["labels"]["team"] == "e2e"
    assert br["metadata"]["annotations"]["jobrunner.dev/scheduled-at"] == (
        first["every"].strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert br["metadata"]["ownerReferences"][0]["kind"] == "BatchRunSchedule"
    st = _wait("every's lastScheduleTime", lambda: (s := _status(k8s, ns, "every")).get(
        "lastScheduleTime") and s, 30)
    assert st["lastScheduleTime"] == first["every"].strftime("%Y-%m-%dT%H:%M:%SZ")
    assert "TemplateValid" in {c["type"] for c in st["conditions"]}

    # --- trigger now (a suspended schedule: only the trigger starts runs)
    k8s.kubectl("annotate", "brs", "manual", "-n", ns, "jobrunner.dev/trigger=t1")
    t0 = time.monotonic()
    _wait("manual-manual-t1", lambda: "manual-manual-t1" in _runs(k8s, ns, "manual"), 30,
          controller=operator)
    print(f"trigger-now: run created {time.monotonic() - t0:.1f}s after the annotation")
    _wait("lastTrigger t1", lambda: _status(k8s, ns, "manual").get("lastTrigger") == "t1", 30)
    k8s.kubectl("delete", "br", "manual-manual-t1", "-n", ns, "--wait=true", "--timeout=60s")

    # --- the second start time, with the controller down across it
    now = dt.datetime.now(UTC)
    second = _next_boundary(now + dt.timedelta(seconds=12))
    active_replace = [a["name"] for a in _wait(
        "replace's active run", lambda: _status(k8s, ns, "replace").get("active"), 30)]
    assert active_replace == [replace1], active_replace
    replace1_batch = _wait("replace1's batchId", lambda: (
        (get(k8s, "br", replace1, ns) or {}).get("status") or {}).get("batchId"), 60)
    replace1_job = _wait("replace1's Job", lambda: (
        (get(k8s, "br", replace1, ns) or {}).get("status") or {}).get("jobName"), 60)
    _sleep_until(second - dt.timedelta(seconds=6))
    operator.kill()
    killed_at = dt.datetime.now(UTC)
    _sleep_until(second + dt.timedelta(seconds=2))
    operator.start()
    print(f"controller killed at {killed_at:%H:%M:%S}, started again at "
          f"{dt.datetime.now(UTC):%H:%M:%S}, across the start time {second:%H:%M:%S}")
    every2, replace2, forbid2 = (f"every-{_minutes(second)}", f"replace-{_minutes(second)}",
                                 f"forbid-{_minutes(second)}")
    _wait(every2, lambda: every2 in _runs(k8s, ns, "every"), 120, controller=operator)
    _wait(replace2, lambda: replace2 in _runs(k8s, ns, "replace"), 60, controller=operator)

    # Forbid: skipped while the first run is active, with an Event
    st = _wait("forbid's lastSkippedTime", lambda: (s := _status(k8s, ns, "forbid")).get(
        "lastSkippedTime") and s, 60)
    assert st["lastSkippedTime"] == second.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert forbid2 not in _runs(k8s, ns, "forbid")
    assert len(_runs(k8s, ns, "forbid")) == 1

    # Replace: the old run goes (foreground: after its pods), its tasks end cancelled
    _wait(f"{replace1} deleted", lambda: get(k8s, "br", replace1, ns) is None, 120,
          controller=operator)
    assert not [p for p in pods_of(k8s, ns)
                if (p["metadata"].get("labels") or {}).get("job-name") == replace1_job]
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        old = Queue(conn).counts(replace1_batch)
    print(f"replaced run {replace1}: tasks {old}")
    assert old == {"pending": 0, "leased": 0, "done": 0, "dead": 0, "cancelled": 2}, old
    _wait(f"{replace2} running a task", lambda: (r := get(k8s, "br", replace2, ns)) and (
        st := r.get("status") or {}).get("phase") == "Running" and (
        st.get("counts") or {}).get("leased", 0) >= 1, 120, controller=operator)

    # history limit: every2 succeeded, so every1 is deleted; its results stay
    every1_batch = f"{ns}/{every1}/"
    _wait(f"{every1} deleted by the history limit", lambda: every1 not in _runs(
        k8s, ns, "every"), 120, controller=operator)
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        batch = conn.execute("SELECT batch_id FROM agent_batch WHERE batch_id LIKE %s",
                             (every1_batch + "%",)).fetchone()["batch_id"]
        kept = Queue(conn).counts(batch)
    assert kept == {"pending": 0, "leased": 0, "done": 2, "dead": 0, "cancelled": 0}, kept
    st = _wait("every's lastSuccessfulTime", lambda: (s := _status(k8s, ns, "every")).get(
        "lastSuccessfulTime") and s, 30)
    assert st["lastScheduleTime"] == second.strftime("%Y-%m-%dT%H:%M:%SZ")

    # exactly one run per start time, the restart included: never a second one, never
    # the deleted one again
    assert set(_runs(k8s, ns, "every")) == {every2}
    assert set(_runs(k8s, ns, "replace")) == {replace2}
    # the trigger is not replayed after its run was deleted; suspend held; a new value runs
    assert _runs(k8s, ns, "manual") == {}
    k8s.kubectl("annotate", "brs", "manual", "-n", ns, "--overwrite",
                "jobrunner.dev/trigger=t2")
    _wait("manual-manual-t2", lambda: set(_runs(k8s, ns, "manual")) == {"manual-manual-t2"},
          30, controller=operator)

    reasons: dict[str, set[str]] = {}
    for e in events_of(k8s, ns):
        if e["involvedObject"]["kind"] == "BatchRunSchedule":
            reasons.setdefault(e["involvedObject"]["name"], set()).add(e["reason"])
    assert {"SuccessfulCreate", "SuccessfulDelete"} <= reasons["every"], reasons
    assert "RunAlreadyActive" in reasons["forbid"], reasons
    assert {"SuccessfulCreate", "ReplacedRun"} <= reasons["replace"], reasons
    print(k8s.kubectl("get", "brs", "-n", ns).stdout)


def _bad_input(k8s, ns: str, operator) -> None:
    """Refused at apply (CRD rules), or reported in conditions (and Events)."""
    shared = _schedule("shared", {**_quick("x"), "batchId": "one-batch"})
    r = k8s.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(shared), check=False)
    assert r.returncode != 0 and "batchId must not be set" in r.stderr, r.stderr
    bad = [_schedule("bad-template", {**_quick("x"), "workers": 0}),
           _schedule("bad-zone", _quick("x"), timeZone="Mars/Olympus")]
    k8s.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(json.dumps(b) for b in bad))

    def stalled(name: str) -> dict | None:
        conds = {c["type"]: c for c in _status(k8s, ns, name).get("conditions") or []}
        stall = conds.get("Stalled")
        return conds if stall and stall["status"] == "True" else None

    conds = _wait("bad-template Stalled", lambda: stalled("bad-template"), 30,
                  controller=operator)
    assert conds["TemplateValid"]["status"] == "False"
    assert "spec.workers" in conds["TemplateValid"]["message"], conds["TemplateValid"]
    print(f"refused template: {conds['TemplateValid']['message']}")
    conds = _wait("bad-zone Stalled", lambda: stalled("bad-zone"), 30, controller=operator)
    assert conds["Ready"]["reason"] == "InvalidSchedule"
    assert "'Mars/Olympus' is not an IANA time zone" in conds["Ready"]["message"]
    k8s.kubectl("delete", "brs", "bad-template", "bad-zone", "-n", ns, "--wait=false")
