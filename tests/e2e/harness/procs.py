"""Small helpers for child processes that must never outlive the harness."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover
    _libc = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def preexec_for_current_thread():
    """PR_SET_PDEATHSIG fires when the *thread* that forked exits, so only use it
    from the main thread or from a thread that outlives the child."""
    return _die_with_parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def terminate_group(popen: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, wait ``grace`` seconds, then SIGKILL it."""
    if popen.poll() is None:
        kill_group(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    kill_group(popen.pid, signal.SIGKILL)  # stragglers in the group, too
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


class Proc:
    """A long-running control-plane process in its own session, logging to a file."""

    def __init__(self, name: str, argv, log_path: Path, env=None, cwd=None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = env
        self.cwd = cwd
        self.popen: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                log.write(
                    f"\n===== {time.strftime('%H:%M:%S')} starting {self.name} =====\n".encode()
                )
                log.flush()
                pre = (
                    _die_with_parent
                    if threading.current_thread() is threading.main_thread()
                    else None
                )
                self.popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                    preexec_fn=pre,
                )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        with self._lock:
            if self.popen is not None:
                terminate_group(self.popen, grace)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def wait_for(cond, proc: Proc | None, timeout: float, what: str,
             error: type[Exception] = RuntimeError, interval: float = 0.2) -> None:
    """Poll `cond` until it is true; fail at once when `proc` (what it waits on) exits,
    and after `timeout` with `what` and the tail of `proc`'s log. An exception from
    `cond` counts as not yet (the process may not listen yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception:
            pass
        if proc is not None and not proc.alive():
            raise error(f"{proc.name} exited:\n{proc.log_tail()}")
        time.sleep(interval)
    tail = proc.log_tail() if proc is not None else ""
    raise error(f"timed out after {timeout}s waiting for {what}\n{tail}")
