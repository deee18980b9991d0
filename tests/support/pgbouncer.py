"""A PgBouncer (Debian's package) in transaction pooling mode in front of a test server;
`repoint` moves it to another server as an operator does after a failover (the ini
rewritten, then a reload)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from jobrunner.local.embedded import PG_USER


def available() -> bool:
    return shutil.which("pgbouncer") is not None


class PgBouncer:
    def __init__(self, server_dsn: str, pool_size: int = 20,
                 settings: dict[str, str] | None = None) -> None:
        self.server = conninfo_to_dict(server_dsn)
        self.pool_size = pool_size
        self.settings = settings or {}  # more [pgbouncer] settings
        self.dir = Path(tempfile.mkdtemp(prefix="jobrunner-pgbouncer-"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc: subprocess.Popen | None = None

    @property
    def dsn(self) -> str:
        s = self.server
        return (f"postgresql://{s['user']}:{s['password']}@127.0.0.1:{self.port}/"
                f"{s.get('dbname', 'postgres')}")

    def _write_ini(self) -> None:
        s = self.server
        extra = "".join(f"{name} = {value}\n" for name, value in self.settings.items())
        (self.dir / "pgbouncer.ini").write_text(f"""
[databases]
* = host={s['host']} port={s['port']}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = scram-sha-256
auth_file = {self.dir / 'userlist.txt'}
pool_mode = transaction
default_pool_size = {self.pool_size}
max_client_conn = 1000
server_reset_query =
ignore_startup_parameters = extra_float_digits,options,application_name
logfile = {self.dir / 'pgbouncer.log'}
{extra}""")

    def start(self) -> PgBouncer:
        s = self.server
        (self.dir / "userlist.txt").write_text(f'"{s["user"]}" "{s["password"]}"\n')
        self._write_ini()
        ids: dict = {}
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            for path in [self.dir, *self.dir.iterdir()]:
                shutil.chown(path, PG_USER, PG_USER)
            ids = {"user": PG_USER, "group": PG_USER, "extra_groups": []}
        self.proc = subprocess.Popen(["pgbouncer", str(self.dir / "pgbouncer.ini")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     **ids)
        deadline = time.monotonic() + 20
        while True:
            try:
                psycopg.connect(self.dsn, connect_timeout=2, prepare_threshold=None).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    log = (self.dir / "pgbouncer.log")
                    raise RuntimeError("pgbouncer did not start: " + (
                        log.read_text()[-2000:] if log.exists() else "no log")) from None
                time.sleep(0.2)

    def repoint(self, host: str, port: int) -> None:
        """Send new server connections to host:port: the ini rewritten and reloaded
        (SIGHUP). Connections to the old server are closed once they are released."""
        self.server = {**self.server, "host": host, "port": str(port)}
        self._write_ini()  # (rewritten in place: still owned by the server's user)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self, keep_log: Path | None = None) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        log = self.dir / "pgbouncer.log"
        if keep_log is not None and log.exists():
            shutil.copy(log, keep_log)
        shutil.rmtree(self.dir, ignore_errors=True)
