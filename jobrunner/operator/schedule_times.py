"""When a BatchRunSchedule fires: cron expressions in a time zone, the missed start times
after a downtime, the starting deadline, and the deterministic names of the runs.

Pure functions of (expression, zone, times): no Kubernetes, no clock of their own, so the
unit tests pin every case (DST included) and the controller stays a thin loop around them.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

# The macros Kubernetes CronJob accepts (robfig/cron), as plain 5-field expressions.
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# CronJob's cap: beyond this many missed start times the controller stops counting (and
# says so), so a schedule that was down for a year costs 100 steps, not 500,000.
MAX_MISSED = 100
# A trigger-now value becomes part of a run's name: a DNS label fragment.
TRIGGER_VALUE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
UTC = dt.UTC


class BadSchedule(ValueError):
    """spec.schedule or spec.timeZone cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Schedule:
    expression: str  # as written in the spec (a macro stays a macro, for messages)
    cron: str  # the 5-field form
    zone: ZoneInfo

    def after(self, t: dt.datetime) -> dt.datetime:
        """The first start time strictly after `t` (UTC)."""
        return next(CronSim(self.cron, t.astimezone(self.zone))).astimezone(UTC)

    def latest_at_or_before(self, t: dt.datetime) -> dt.datetime | None:
        """The last start time at or before `t` (UTC), None if there is none in 5 years."""
        # cronsim's reverse iteration is strictly before its start; start times have
        # second 0, so "before the next whole second" is "at or before t".
        start = t.astimezone(self.zone).replace(microsecond=0) + dt.timedelta(seconds=1)
        try:
            found = next(CronSim(self.cron, start, reverse=True))
        except StopIteration:
            return None
        return found.astimezone(UTC)


def parse_schedule(expression: str, time_zone: str | None) -> Schedule:
    expression = (expression or "").strip()
    if not expression:
        raise BadSchedule("spec.schedule is empty: give a 5-field cron expression such as "
                          "'0 2 * * *' or a macro such as @daily")
    if re.match(r"^(CRON_)?TZ=", expression):
        raise BadSchedule("spec.schedule must not contain TZ= or CRON_TZ=: set spec.timeZone")
    if expression.startswith("@"):
        cron = MACROS.get(expression.lower())
        if cron is None:
            raise BadSchedule(f"spec.schedule {expression!r}: unknown macro; use one of "
                              f"{', '.join(sorted(MACROS))} or a 5-field cron expression")
    else:
        cron = " ".join(expression.split())
        fields = cron.split(" ")
        if len(fields) != 5:
            raise BadSchedule(f"spec.schedule {expression!r}: {len(fields)} field(s), expected "
                              "5 (minute hour day-of-month month day-of-week)")
    try:
        zone = ZoneInfo(time_zone or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise BadSchedule(f"spec.timeZone {time_zone!r} is not an IANA time zone name "
                          "(e.g. Europe/Paris, America/New_York, Etc/UTC)") from None
    try:
        CronSim(cron, dt.datetime(2000, 1, 1, tzinfo=zone))
    except CronSimError as exc:
        raise BadSchedule(f"spec.schedule {expression!r}: {exc}") from None
    return Schedule(expression, cron, zone)


@dataclass(frozen=True)
class Due:
    """What is due at `now`, given the last start time already handled (`earliest`)."""
    time: dt.datetime | None  # the latest start time in (earliest, now], if any
    late: bool  # `time` is older than startingDeadlineSeconds: skip it
    missed: int  # earlier start times in (earliest, time) that will never run (capped)
    capped: bool  # more than MAX_MISSED start times were missed: `missed` is a lower bound
    next_time: dt.datetime  # the first start time after now


def due(schedule: Schedule, *, earliest: dt.datetime, now: dt.datetime,
        deadline_seconds: int | None, cap: int = MAX_MISSED) -> Due:
    """CronJob's rule: only the most recent missed start time may run; older ones are
    reported, never run (a controller back after a week does not start 10,000 runs)."""
    next_time = schedule.after(now)
    latest = schedule.latest_at_or_before(now)
    if latest is None or latest <= earliest:
        return Due(None, False, 0, False, next_time)
    late = deadline_seconds is not None and (now - latest).total_seconds() > deadline_seconds
    missed, t = 0, earliest
    while True:  # bounded by `cap` steps whatever the downtime
        t = schedule.after(t)
        if t >= latest:
            break
        missed += 1
        if missed > cap:
            return Due(latest, late, cap, True, next_time)
    return Due(latest, late, missed, False, next_time)


def run_name(schedule_name: str, scheduled: dt.datetime) -> str:
    """CronJob's naming: the scheduled time in minutes since the epoch. Deterministic, so a
    restarted controller that tries again gets AlreadyExists, never a second run."""
    return f"{schedule_name}-{int(scheduled.timestamp()) // 60}"


def manual_run_name(schedule_name: str, value: str) -> str:
    return f"{schedule_name}-manual-{value}"


def check_trigger_value(value: str) -> str | None:
    """Why a trigger annotation value cannot name a run (None when it can)."""
    if TRIGGER_VALUE.match(value):
        return None
    return (f"trigger value {value!r} must be 1-40 lowercase letters, digits or '-' "
            "(starting and ending with a letter or digit), e.g. $(date +%s)")


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


def format_time(t: dt.datetime) -> str:
    return t.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
