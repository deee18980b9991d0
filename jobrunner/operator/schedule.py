"""BatchRunSchedule: BatchRuns on a cron schedule, in the style of CronJob.

One async kopf daemon per schedule sleeps until its next start time (or until the
schedule or one of its runs changes), then converges with `sync_schedule`, which keeps
no state of its own: everything it needs is in the schedule's status and its runs.

Never two runs for one start time, restarts included: a run's name is derived from its
start time (<schedule>-<minutes since the epoch>, as CronJob names its Jobs), so a second
attempt gets AlreadyExists; the start times already handled are those up to
status.lastScheduleTime / lastSkippedTime and the newest run's scheduled-at annotation.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import kopf

from jobrunner.operator import kube, schedule_db
from jobrunner.operator.config import GROUP, PLURAL, VERSION
from jobrunner.operator.database import DatabaseProblem
from jobrunner.operator.jobs import api_error_detail
from jobrunner.operator.kube import ApiError
from jobrunner.operator.schedule_times import (
    BadSchedule,
    Due,
    check_trigger_value,
    due,
    format_time,
    manual_run_name,
    parse_schedule,
    parse_time,
    run_name,
)
from jobrunner.operator.status import event, get_condition, set_condition
from jobrunner.store.schedules import REFUSED, STARTED, ScheduleState

SCHEDULES = "batchrunschedules"
KIND = "BatchRunSchedule"
API_VERSION = f"{GROUP}/{VERSION}"
LABEL = "jobrunner.dev/schedule"  # on each run: the schedule that made it
SCHEDULED_AT = "jobrunner.dev/scheduled-at"  # on each scheduled run: its start time
TRIGGER = "jobrunner.dev/trigger"  # on a schedule: start a run now, named by the value
TERMINAL = ("Succeeded", "Failed", "Cancelled")
# Upper bound of a daemon's sleep: it wakes on every change of the schedule or of its
# runs anyway; this only bounds the effect of a missed watch event or a clock jump.
MAX_SLEEP = 60.0
log = logging.getLogger("jobrunner.controller.schedules")

_wake: dict[str, asyncio.Event] = {}


@kopf.daemon(GROUP, VERSION, SCHEDULES, cancellation_timeout=1, backoff=5)
async def run_schedule(stopped: kopf.DaemonStopped, namespace: str, name: str, uid: str,
                       **_: Any) -> None:
    wake = _wake.setdefault(uid, asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await asyncio.to_thread(sync_schedule, namespace, name, uid)
                schedule_db.ensure_poller(namespace, name, start_requested)
            except ApiError as exc:
                log.warning("schedule %s/%s: HTTP %s %s", namespace, name, exc.status,
                            api_error_detail(exc))
                delay = 5.0
            except Exception:
                log.exception("schedule %s/%s: sync failed", namespace, name)
                delay = 10.0
            try:
                await asyncio.wait_for(wake.wait(), timeout=max(0.05, delay))
            except TimeoutError:
                pass
    finally:
        _wake.pop(uid, None)
        schedule_db.forget(namespace, name)


@kopf.on.event(GROUP, VERSION, SCHEDULES)
async def schedule_changed(uid: str, namespace: str, name: str, body: kopf.Body,
                           **kwargs: Any) -> None:
    """Spec, suspend, a trigger annotation: act now, not at the next start time. Deleted:
    its row in the database goes (schedule_db.py). No finalizer: the row of a schedule
    deleted while the controller was down is pruned by its database's poller."""
    if kwargs.get("type") == "DELETED":
        spec = dict(body.get("spec") or {})
        await asyncio.to_thread(schedule_db.deleted, namespace, name, spec)
        return
    if uid in _wake:
        _wake[uid].set()


@kopf.on.event(GROUP, VERSION, PLURAL, labels={LABEL: kopf.PRESENT})
async def run_changed(body: kopf.Body, **_: Any) -> None:
    """A run's phase moved: the schedule's active list, history and lastSuccessfulTime."""
    for ref in body.metadata.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("uid") in _wake:
            _wake[ref["uid"]].set()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def sync_schedule(namespace: str, name: str, uid: str) -> float:
    """Converge one schedule; returns the seconds until it needs to run again."""
    try:
        obj = kube.get_custom(GROUP, VERSION, namespace, SCHEDULES, name)
    except ApiError as exc:
        if exc.status == 404:
            return MAX_SLEEP
        raise
    meta = obj["metadata"]
    if meta.get("uid") != uid or meta.get("deletionTimestamp"):
        return MAX_SLEEP
    return Sync(obj).run()


def start_requested(trigger: dict[str, Any]) -> tuple[str, str | None, str]:
    """What becomes of a console's trigger request, taken by schedule_db's poller from
    the database of the schedules of its namespace: (outcome, run name, message). Only a
    schedule that exists, whose template uses that same database: a request cannot
    start a schedule another database's console does not show."""
    ns, name = trigger["namespace"], trigger["name"]
    try:
        obj = kube.get_custom(GROUP, VERSION, ns, SCHEDULES, name)
    except ApiError as exc:
        if exc.status == 404:
            return REFUSED, None, f"refused: there is no BatchRunSchedule {ns}/{name}"
        raise
    if obj["metadata"].get("deletionTimestamp"):
        return REFUSED, None, f"refused: BatchRunSchedule {ns}/{name} is being deleted"
    try:
        theirs = schedule_db.template_dsn(ns, obj.get("spec") or {})
    except DatabaseProblem as exc:
        return REFUSED, None, f"refused: BatchRunSchedule {ns}/{name}: {exc}"
    if theirs != trigger["dsn"]:
        return (REFUSED, None, f"refused: the runs of BatchRunSchedule {ns}/{name} use "
                "another database")
    return Sync(obj).start_requested(trigger)


class Sync:
    """One pass over one schedule (fresh from the API server)."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj
        meta = obj["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.generation = meta.get("generation")
        self.spec: dict[str, Any] = obj.get("spec") or {}
        self.st: dict[str, Any] = obj.get("status") or {}
        self.new: dict[str, Any] = {}
        self.conditions: list[dict[str, Any]] = list(self.st.get("conditions") or [])
        self.now = _now()
        self.refusal: str | None = None  # why the last _create made no run

    def _event(self, type_: str, reason: str, message: str) -> None:
        # Schedule messages carry names, times and API errors, no credentials: posted as
        # they are.
        event(self.obj, type_, reason, message, redact=False)

    # ------------------------------------------------------------------ the pass
    def run(self) -> float:
        runs = self._runs()
        active = [r for r in runs if _is_active(r)]
        delay = MAX_SLEEP
        try:
            schedule = parse_schedule(self.spec.get("schedule", ""), self.spec.get("timeZone"))
        except BadSchedule as exc:
            self._invalid("InvalidSchedule", str(exc))
            schedule = None
        valid = schedule is not None and self._template_valid()
        if valid:
            self._trigger(active)
            due_now = self._due(schedule, runs)
            if not self.spec.get("suspend"):
                if due_now.time is not None:
                    active = self._start(due_now, active)
                self.new["nextScheduleTime"] = format_time(due_now.next_time)
                delay = (due_now.next_time - _now()).total_seconds() + 0.2
                self._ready(True, "Scheduled", f"next start time {format_time(due_now.next_time)}"
                            f" ({schedule.expression} in {schedule.zone.key})")
            else:
                self.new["nextScheduleTime"] = None
                self._ready(True, "Suspended", "spec.suspend is true: no new runs")
        runs = self._history(self._runs() if valid else runs)
        active = [r for r in runs if _is_active(r)]
        self.new["active"] = [_ref(r) for r in active]
        self.new["activeCount"] = len(active)
        succeeded = [t for r in runs if _phase(r) == "Succeeded"
                     and (t := parse_time((r.get("status") or {}).get("completionTime")))]
        last_ok = parse_time(self.st.get("lastSuccessfulTime"))
        if succeeded and (last_ok is None or max(succeeded) > last_ok):
            self.new["lastSuccessfulTime"] = format_time(max(succeeded))
        self.new["observedGeneration"] = self.generation
        self.new["conditions"] = self.conditions
        self._patch_status()
        schedule_db.record(self.ns, self.name, self.spec, self._db_state())
        return min(MAX_SLEEP, max(0.05, delay))

    def _db_state(self) -> ScheduleState | None:
        """What the console shows of the schedule (None: its template names no tenant,
        which the dry run refuses anyway)."""
        tenant = ((self.spec.get("batchRunTemplate") or {}).get("spec") or {}).get("tenant")
        if not isinstance(tenant, str) or not tenant:
            return None
        st = {**self.st, **self.new}
        ready = get_condition(self.conditions, "Ready") or {}
        return ScheduleState(
            namespace=self.ns, name=self.name, tenant_id=tenant,
            schedule=str(self.spec.get("schedule", "")), time_zone=self.spec.get("timeZone"),
            suspend=bool(self.spec.get("suspend")),
            concurrency_policy=self.spec.get("concurrencyPolicy") or "Allow",
            ready=ready.get("reason") or "", message=ready.get("message") or "",
            next_run_at=parse_time(st.get("nextScheduleTime")),
            last_schedule_at=parse_time(st.get("lastScheduleTime")),
            last_successful_at=parse_time(st.get("lastSuccessfulTime")),
            active_runs=tuple(a["name"] for a in st.get("active") or []))

    # ------------------------------------------------------------------ validity
    def _invalid(self, reason: str, message: str) -> None:
        previous = get_condition(self.conditions, "Stalled")
        self._ready(False, reason, message)
        self.conditions = set_condition(self.conditions, "Stalled", True, reason, message,
                                        self.generation)
        if not (previous and previous.get("status") == "True"
                and previous.get("reason") == reason and previous.get("message") == message):
            self._event("Warning", reason, message)

    def _ready(self, ok: bool, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, "Ready", ok, reason, message,
                                        self.generation)
        if ok:
            self.conditions = set_condition(self.conditions, "Stalled", False, reason, message,
                                            self.generation)

    def _template_valid(self) -> bool:
        """A server-side dry run of the BatchRun, once per spec generation: the API server
        applies crds/batchrun.yaml's schema and rules, the one source of truth."""
        cond = get_condition(self.conditions, "TemplateValid")
        if cond and cond.get("observedGeneration") == self.generation:
            if cond.get("status") != "True":
                self._invalid("InvalidTemplate", cond.get("message") or "")
            return cond.get("status") == "True"
        body = self._manifest(f"{self.name}-", {}, {})
        body["metadata"]["generateName"] = body["metadata"].pop("name")
        try:
            kube.create_custom(GROUP, VERSION, self.ns, PLURAL, body, dry_run=True)
        except ApiError as exc:
            if exc.status not in (400, 422):
                raise
            message = (f"spec.batchRunTemplate is not a valid BatchRun: "
                       f"{api_error_detail(exc)}")
            self.conditions = set_condition(self.conditions, "TemplateValid", False,
                                            "InvalidTemplate", message, self.generation)
            self._invalid("InvalidTemplate", message)
            return False
        self.conditions = set_condition(self.conditions, "TemplateValid", True, "DryRunPassed",
                                        "the API server accepts the BatchRun template "
                                        "(server-side dry run)", self.generation)
        return True

    # ------------------------------------------------------------------ start times
    def _due(self, schedule: Any, runs: list[dict[str, Any]]) -> Due:
        handled = [parse_time(self.obj["metadata"].get("creationTimestamp")),
                   parse_time(self.st.get("lastScheduleTime")),
                   parse_time(self.st.get("lastSkippedTime")),
                   *(parse_time((r["metadata"].get("annotations") or {}).get(SCHEDULED_AT))
                     for r in runs)]
        earliest = max(t for t in handled if t is not None)
        deadline = self.spec.get("startingDeadlineSeconds")
        return due(schedule, earliest=earliest, now=self.now, deadline_seconds=deadline)

    def _start(self, d: Due, active: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert d.time is not None
        at = format_time(d.time)
        if d.missed:
            more = "more than " if d.capped else ""
            reason = "TooManyMissedTimes" if d.capped else "MissedSchedule"
            self._event("Warning", reason,
                        f"{more}{d.missed} start time(s) before {at} were missed (controller down "
                        "or schedule suspended) and will not run; only the latest is considered")
        if d.late:
            late = int((self.now - d.time).total_seconds())
            self._event("Warning", "MissedSchedule",
                        f"start time {at} missed by {late}s, more than startingDeadlineSeconds "
                        f"{self.spec.get('startingDeadlineSeconds')}: skipped")
            self.new["lastSkippedTime"] = at
            return active
        policy = self.spec.get("concurrencyPolicy") or "Allow"
        if active and policy == "Forbid":
            names = ", ".join(r["metadata"]["name"] for r in active)
            self._event("Normal", "RunAlreadyActive",
                        f"start time {at} skipped (concurrencyPolicy Forbid): {names} still active")
            self.new["lastSkippedTime"] = at
            return active
        if active and policy == "Replace":
            for r in active:
                self._replace(r, at)
            active = []
        name = run_name(self.name, d.time)
        created = self._create(name, {}, {SCHEDULED_AT: at}, f"start time {at}")
        if created is None:
            self.new["lastSkippedTime"] = at
            return active
        self.new["lastScheduleTime"] = at
        return [*active, created]

    def _replace(self, run: dict[str, Any], at: str) -> None:
        """Delete the active run; foreground, so it stays visible (deleting) until its Job
        and pods are gone. Its finalizer cancels the pending tasks; the tasks its workers
        release when stopped become cancelled too (the batch is cancelled)."""
        name = run["metadata"]["name"]
        try:
            kube.delete_custom(GROUP, VERSION, self.ns, PLURAL, name,
                               propagation_policy="Foreground", uid=run["metadata"]["uid"])
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise
            return
        self._event("Normal", "ReplacedRun",
                    f"deleted active run {name} for start time {at} (concurrencyPolicy Replace): "
                    "its pending tasks are cancelled, its workers stop")

    # ------------------------------------------------------------------ trigger now
    def _trigger(self, active: list[dict[str, Any]]) -> None:
        value = (self.obj["metadata"].get("annotations") or {}).get(TRIGGER)
        if not value or value == self.st.get("lastTrigger"):
            return
        self.new["lastTrigger"] = value
        problem = check_trigger_value(value)
        if problem:
            self._event("Warning", "InvalidTrigger", f"{TRIGGER}: {problem}; no run")
            return
        self._create(manual_run_name(self.name, value), {}, {TRIGGER: value},
                     f"{TRIGGER}={value}")

    def start_requested(self, trigger: dict[str, Any]) -> tuple[str, str | None, str]:
        """A console's trigger request (schedule_db.py): the run the annotation would
        make, named by the request's id, if the requester's tenant is the template's (an
        operator's key, tenant '*', may trigger any schedule)."""
        template = (self.spec.get("batchRunTemplate") or {}).get("spec") or {}
        requester = trigger["tenant_id"]
        if requester not in ("*", template.get("tenant")):
            # (the schedule's tenant is not named: the requester is of another tenant)
            return (REFUSED, None, f"refused: the key's tenant {requester!r} is not the "
                    "tenant of this schedule's runs")
        value = f"console-{trigger['id']}"
        name = manual_run_name(self.name, value)
        created = self._create(name, {}, {TRIGGER: value},
                               f"console trigger {trigger['id']} by {trigger['requested_by']}")
        if created is None:
            return REFUSED, None, self.refusal or f"BatchRun {name} was not created"
        return STARTED, name, f"started BatchRun {name}"

    # ------------------------------------------------------------------ runs
    def _manifest(self, name: str, labels: dict[str, str], annotations: dict[str, str]
                  ) -> dict[str, Any]:
        template = self.spec.get("batchRunTemplate") or {}
        tmeta = template.get("metadata") or {}
        return {
            "apiVersion": API_VERSION, "kind": "BatchRun",
            "metadata": {
                "name": name, "namespace": self.ns,
                "labels": {**(tmeta.get("labels") or {}), **labels, LABEL: self.name},
                "annotations": {**(tmeta.get("annotations") or {}), **annotations},
                "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND,
                                     "name": self.name, "uid": self.uid,
                                     "controller": True, "blockOwnerDeletion": True}]},
            "spec": template.get("spec") or {}}

    def _create(self, name: str, labels: dict[str, str], annotations: dict[str, str],
                why: str) -> dict[str, Any] | None:
        """Create the run, or find it made by an earlier attempt; None if refused."""
        body = self._manifest(name, labels, annotations)
        try:
            created = kube.create_custom(GROUP, VERSION, self.ns, PLURAL, body)
        except ApiError as exc:
            if exc.status == 409:
                existing = kube.get_custom(GROUP, VERSION, self.ns, PLURAL, name)
                if _owned_by(existing, self.uid):
                    return existing  # made by an earlier pass (a restart): not a second one
                self.refusal = (f"BatchRun {name} ({why}) exists and does not belong to "
                                "this schedule")
                self._event("Warning", "FailedCreate", self.refusal)
                return None
            if exc.status in (400, 403, 422):
                self.refusal = f"BatchRun {name} ({why}) refused: {api_error_detail(exc)}"
                self._event("Warning", "FailedCreate", self.refusal)
                return None
            raise
        self._event("Normal", "SuccessfulCreate", f"created BatchRun {name} ({why})")
        return created

    def _runs(self) -> list[dict[str, Any]]:
        found = kube.list_custom(GROUP, VERSION, self.ns, PLURAL,
                                 label_selector=f"{LABEL}={self.name}")
        return [r for r in found.get("items") or [] if _owned_by(r, self.uid)]

    def _history(self, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Delete the finished runs beyond the history limits, oldest first. A finished
        run's finalizer only cancels tasks still pending: a Succeeded run has none, so
        its results and reduce result stay in the database untouched."""
        keep = {"Succeeded": int(self.spec.get("successfulRunsHistoryLimit", 3)),
                "Failed": int(self.spec.get("failedRunsHistoryLimit", 1))}
        gone: set[str] = set()
        for kind, limit in keep.items():
            finished = sorted(
                (r for r in runs if not r["metadata"].get("deletionTimestamp")
                 and (_phase(r) == kind or (kind == "Failed" and _phase(r) == "Cancelled"))),
                key=lambda r: (r["metadata"].get("creationTimestamp") or "",
                               r["metadata"]["name"]))
            for r in finished[:max(0, len(finished) - limit)]:
                name = r["metadata"]["name"]
                try:
                    kube.delete_custom(GROUP, VERSION, self.ns, PLURAL, name,
                                       propagation_policy="Background",
                                       uid=r["metadata"]["uid"])
                except ApiError as exc:
                    if exc.status not in (404, 409):
                        raise
                gone.add(name)
                self._event("Normal", "SuccessfulDelete",
                            f"deleted {_phase(r)} BatchRun {name} (history limit {limit})")
        return [r for r in runs if r["metadata"]["name"] not in gone]

    def _patch_status(self) -> None:
        changed = {k: v for k, v in self.new.items() if self.st.get(k) != v}
        if changed:
            kube.patch_custom_status(GROUP, VERSION, self.ns, SCHEDULES, self.name,
                                     {"status": changed})


def _phase(run: dict[str, Any]) -> str | None:
    return (run.get("status") or {}).get("phase")


def _is_active(run: dict[str, Any]) -> bool:
    return not run["metadata"].get("deletionTimestamp") and _phase(run) not in TERMINAL


def _owned_by(run: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in run["metadata"].get("ownerReferences") or [])


def _ref(run: dict[str, Any]) -> dict[str, str]:
    meta = run["metadata"]
    return {"apiVersion": API_VERSION, "kind": "BatchRun", "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta["uid"]}
