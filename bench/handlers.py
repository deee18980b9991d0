"""The benchmark's task bodies for jobrunner workers."""

from __future__ import annotations

import json
import os
import time

from jobrunner import Task


def noop(task: Task) -> None:
    """The throughput workload: does nothing, like the peers' no-op tasks."""
    return None


def stamp(task: Task) -> dict:
    """Latency: the wall-clock time the handler started (same host as the harness)."""
    return {"started": time.time()}


def sleepy(task: Task) -> None:
    """Recovery: appends {attempt, started} to payload.log, then sleeps payload.seconds
    while its lease holds."""
    with open(task.payload["log"], "a") as out:
        out.write(json.dumps({"attempt": task.attempt, "started": time.time(),
                              "pid": os.getpid()}) + "\n")
    end = time.monotonic() + float(task.payload.get("seconds", 60))
    while time.monotonic() < end:
        task.check_lease()
        time.sleep(0.05)


def stamp_or_fail_first(task: Task) -> dict:
    """Wake-up and retry latency (bench/idle_fleet.py): like `stamp`, but a task with
    payload.fail_first fails its first attempt (retried after the worker's backoff)."""
    if task.payload.get("fail_first") and task.attempt == 1:
        raise RuntimeError("first attempt fails on purpose")
    return {"started": time.time()}


def openai_sync(task: Task) -> object:
    """The OpenAI-compatible handler without its async form: a handler thread per call,
    as every worker ran it before (bench/in_flight.py's sync rows)."""
    from jobrunner.features.openai_batch import handle

    return handle(task)
