"""Test helpers that run jobrunner as real processes: the CLI, workers, and waiting on them.

Tests import these from here (not from conftest); conftest's autouse fixture kills every
worker `start_worker` started when a test ends, passed or failed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# Workers started by start_worker, reaped after each test (tests/conftest.py).
spawned: list[subprocess.Popen] = []


def child_env(dsn: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if dsn:
        env["JOBRUNNER_DATABASE_URL"] = dsn
    env.update(extra)
    return env


def cli(*args: str, dsn: str | None = None, input: str | None = None, check: bool = False,
        timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m jobrunner ARGS` as a real process."""
    return subprocess.run([sys.executable, "-m", "jobrunner", *args], input=input, text=True,
                          capture_output=True, env=env or child_env(dsn), cwd=REPO,
                          timeout=timeout, check=check)


def start_worker(dsn: str, batch: str, handler: str, *extra: str, log: Path | None = None,
                 env: dict[str, str] | None = None, pool: str | None = None
                 ) -> subprocess.Popen:
    """A worker process of the batch, or with `pool` a pool worker (batch not used)."""
    target = ["--pool", pool] if pool is not None else ["--batch", batch]
    args = [sys.executable, "-m", "jobrunner", "worker", *target, "--handler", handler,
            "--log-level", "info", *extra]
    stream = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(args, env=env or child_env(dsn), cwd=REPO, stdout=stream,
                            stderr=stream, start_new_session=True)
    spawned.append(proc)
    return proc


def wait_for(predicate, timeout: float = 60, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class ServerProcess:
    """A server binary a test talks to (Jaeger, Prometheus): started with its log in
    `root`, waited for until `_ready()`, stopped when the `with` block ends."""

    name = "server"
    root: Path
    proc: subprocess.Popen | None = None

    def _launch(self, args: list[str]) -> None:
        self.log = self.root / f"{self.name}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n"
                                   + self.log.read_text()[-3000:])
            time.sleep(0.2)

    def _ready(self) -> bool:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
