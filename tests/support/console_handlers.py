"""The handler of the console's tests (tests/test_console*.py): it sleeps
payload.sleep seconds, and fails while the file payload.fail_while exists (so a test
makes tasks die, then lets their requeue succeed by removing the file)."""

from __future__ import annotations

import os
import time

from jobrunner import Task


def handle(task: Task) -> dict:
    time.sleep(float(task.payload.get("sleep", 0)))
    flag = task.payload.get("fail_while")
    if flag and os.path.exists(flag):
        raise ValueError(f"task {task.key} refused: {flag} exists")
    return {"doc": task.payload.get("doc"), "key": task.key}
