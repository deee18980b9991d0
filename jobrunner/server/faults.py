"""Fault injection for the crash tests: with JOBRUNNER_SERVE_FAULT_FILE set, the replica
that reaches the point the file names first removes the file (so only one replica
does) and kills itself with SIGKILL, as `kill -9` would, at exactly that point."""

from __future__ import annotations

import os
import signal

FAULT_ENV = "JOBRUNNER_SERVE_FAULT_FILE"


def point(name: str) -> None:
    path = os.environ.get(FAULT_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            if f.read().strip() != name:
                return
        os.unlink(path)
    except OSError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
