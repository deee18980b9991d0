"""The console's test stack (tests/test_console.py, tests/test_console_browser.py): a
module database, a real `jobrunner serve` process, keys made by the real CLI, batches
enqueued by the real CLI and run by real `jobrunner worker` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from jobrunner.local.embedded import free_port
from tests.support.processes import REPO, child_env, cli, start_worker, wait_for

HANDLER = "tests.support.console_handlers:handle"


def module_database(admin_dsn: str, template: str) -> Iterator[str]:
    """A migrated database of its own (from the tests' template), dropped afterwards."""
    name = f"jr_console_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)))
    yield make_conninfo(admin_dsn, dbname=name)
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


class ConsoleServer:
    """`jobrunner serve` on a free port of 127.0.0.1, its log in `tmp`."""

    def __init__(self, dsn: str, tmp: Path, *args: str) -> None:
        self.dsn, self.tmp, self.port, self.args = dsn, tmp, free_port(), args
        self.proc: subprocess.Popen | None = None
        self.last_answer = "none"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ConsoleServer:
        log = open(self.tmp / "serve.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobrunner", "serve", "--port", str(self.port), *self.args],
            env=child_env(self.dsn), cwd=REPO, stdout=log, stderr=log,
            start_new_session=True)
        try:
            wait_for(self._ready, timeout=60, what="jobrunner serve to answer /readyz")
        except AssertionError as exc:
            self.stop()  # (else it outlives the test, logging on a dropped database)
            tail = (self.tmp / "serve.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{exc}; its last answer: {self.last_answer}; "
                                 f"its log:\n{tail}") from None
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"jobrunner serve exited {self.proc.returncode}")
        try:
            # (the server waits up to 2 s for a database connection before it answers 503:
            # a client that gives up sooner never sees the answer under load)
            r = httpx.get(f"{self.url}/readyz", timeout=5)
            self.last_answer = f"{r.status_code} {r.text[:200]}"
            return r.status_code == 200
        except httpx.HTTPError as exc:
            self.last_answer = repr(exc)
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def key(self, tenant: str, role: str = "read") -> str:
        return cli("api-key", "create", "--tenant", tenant, "--role", role, "--name",
                   f"{role}-{tenant}", dsn=self.dsn, check=True).stdout.strip()


def enqueue(dsn: str, batch: str, tenant: str, rows: Iterable[dict], *,
            max_attempts: int = 1) -> None:
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    cli("enqueue", "-", "--batch", batch, "--tenant", tenant, "--max-attempts",
        str(max_attempts), dsn=dsn, input=lines, check=True)


def worker(dsn: str, batch: str, concurrency: int = 2) -> subprocess.Popen:
    """A real worker of the batch (reaped after the test by tests/conftest.py)."""
    return start_worker(dsn, batch, HANDLER, "--concurrency", str(concurrency),
                        "--backoff-base", "0.05", "--backoff-cap", "0.2")


def counts(dsn: str, batch: str) -> dict[str, int]:
    with psycopg.connect(dsn) as c:
        rows = c.execute("SELECT status::text, count(*) FROM agent_work_queue "
                         "WHERE batch_id = %s GROUP BY 1", (batch,)).fetchall()
    found = dict.fromkeys(("pending", "leased", "done", "dead", "cancelled"), 0)
    found.update({s: int(n) for s, n in rows})
    return found
