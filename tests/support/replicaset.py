"""A PostgreSQL replica set for the failover tests: a primary and a streaming hot standby,
both from the embedded build the other tests use (jobrunner.embedded.bin_dir()), each on
127.0.0.1 on a port of its own.

- The standby is a pg_basebackup of the primary (-X stream, a physical replication slot
  made by -C -S, standby.signal and primary_conninfo written by -R).
- Synchronous mode: synchronous_standby_names = '*' on the primary (synchronous_commit
  stays at its default, on), so a commit returns only once the standby has flushed it;
  set only after the standby streams, and reset on a standby before it is promoted, so
  a primary that has lost its standby keeps accepting writes until a new one joins
  (Patroni's non-strict synchronous_mode; a strict setup would stop writing instead).
  Asynchronous mode: no synchronous standby.
- Failover: kill -9 of the primary's postmaster and every child process (a node lost:
  nothing flushed, nothing said to the clients beyond the kernel closing the sockets),
  then pg_promote() on the standby once it has replayed all it received (all it can:
  see _replayed_all_it_can).
- Switchback: the old primary's data directory is set aside (kept for a post-mortem:
  what had it committed that the new primary never got?), a fresh pg_basebackup of the
  new primary is started in its place on the old port as a standby, and the next
  failover promotes it again. A new base backup rather than pg_rewind: it needs neither
  wal_log_hints nor checksums nor a clean shutdown of the dead server, and this
  database is small.

As root, every server process and tool runs as the embedded server's dedicated user,
like jobrunner.embedded does (EmbeddedPostgres._run).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from jobrunner.local.embedded import PG_USER, EmbeddedPostgres, free_port

REPLICATION_SETTINGS = """
# written by tests/support/replicaset.py
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
hot_standby = on
wal_receiver_status_interval = 1s
# (a standby whose primary died retries, and notices a promotion request, sooner)
wal_retrieve_retry_interval = 100ms
"""


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # (the command name, in parentheses, may hold spaces: split after it)
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie nobody reaped is dead all the same


def _chown_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, PG_USER, PG_USER)


@dataclass
class Failover:
    """One failover, as the tests measure it (times: time.time(), the servers' clock)."""

    number: int
    old: int  # node index of the primary that was killed
    new: int  # node index of the standby promoted
    killed_at: float
    promoted_at: float
    fork_lsn: str  # all the new primary had received from the old one
    at_fork: Any  # what the on_fork hook read on the standby, just before promotion
    old_data: Path | None = None  # the dead primary's data, once set aside

    @property
    def promotion_seconds(self) -> float:
        return self.promoted_at - self.killed_at


class ReplicaSet:
    def __init__(self, synchronous: bool, root: Path | None = None) -> None:
        self.synchronous = synchronous
        self.root = Path(root or tempfile.mkdtemp(prefix="jobrunner-replicaset-"))
        self.nodes = [EmbeddedPostgres(self.root / f"node{i}", port=free_port())
                      for i in range(2)]
        self.primary = 0
        self.failovers: list[Failover] = []
        self._rebuild: threading.Thread | None = None
        self._rebuild_error: BaseException | None = None
        self.events: list[tuple[float, str]] = []  # (time.time(), what): see save_logs

    def _event(self, what: str) -> None:
        self.events.append((time.time(), what))

    # -- addresses ------------------------------------------------------------------
    @property
    def standby(self) -> int:
        return 1 - self.primary

    @property
    def password(self) -> str:
        return self.nodes[0].password

    def node_dsn(self, i: int, dbname: str = "postgres") -> str:
        return make_conninfo(host="127.0.0.1", port=self.nodes[i].port, user="postgres",
                             password=self.password, dbname=dbname)

    def dsn(self, dbname: str = "postgres") -> str:
        """What a client of a replica set is given: every node, the primary wanted."""
        return make_conninfo(host="127.0.0.1,127.0.0.1",
                             port=f"{self.nodes[0].port},{self.nodes[1].port}",
                             user="postgres", password=self.password, dbname=dbname,
                             target_session_attrs="read-write")

    def _admin(self, i: int) -> psycopg.Connection:
        return psycopg.connect(self.node_dsn(i), autocommit=True, connect_timeout=5)

    # -- life cycle -----------------------------------------------------------------
    def start(self) -> ReplicaSet:
        first = self.nodes[0]
        first.init()
        with (first.data / "postgresql.conf").open("a") as conf:
            conf.write(REPLICATION_SETTINGS)
        first.start()
        self._add_standby(1, source=0)
        return self

    def _add_standby(self, i: int, source: int) -> None:
        """Node i becomes a fresh standby of `source`, streaming (and synchronous in that
        mode) when this returns."""
        node = self.nodes[i]
        node.root.mkdir(parents=True, exist_ok=True)
        _chown_to_server_user(node.root)
        node.root.chmod(0o700)
        if node.root != self.nodes[source].root:
            shutil.copy2(self.nodes[source].password_file, node.password_file)
        slot = f"standby_node{i}"
        with self._admin(source) as conn:
            # (a slot left by this node's previous life as a standby of the same source)
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                         " WHERE slot_name = %s AND NOT active", (slot,))
        self._event(f"node{i}: base backup of node{source}")
        node._run([str(node.bin / "pg_basebackup"), "-D", str(node.data),
                   "-d", self.node_dsn(source) + f" application_name=node{i}",
                   "-X", "stream", "-C", "-S", slot, "-R", "-c", "fast"], timeout=300)
        self._event(f"node{i}: starting as a standby")
        node.start()
        with self._admin(source) as conn:
            self._wait(lambda: conn.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            ).fetchone()[0] >= 1, f"node{i} to stream from node{source}")
            self._event(f"node{i}: streaming")
            if self.synchronous:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                conn.execute("SELECT pg_reload_conf()")
                self._wait(lambda: conn.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                ).fetchone()[0] >= 1, f"node{i} to be a synchronous standby")
                self._event(f"node{i}: synchronous standby")

    @staticmethod
    def _wait(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica set: timed out waiting for {what}")
            time.sleep(0.05)

    @staticmethod
    def _replayed_all_it_can(conn: psycopg.Connection) -> Callable[[], bool]:
        """A predicate for _wait, on a standby whose primary is dead: true once it has
        replayed every whole record it received, nothing more to come.

        Replaying up to pg_last_wal_receive_lsn() is not always possible: a walsender
        sends what its primary flushed, and the walwriter flushes whole pages, so a
        primary killed then leaves the standby with the head of a record whose tail
        never comes; replay stops at its start for good. (No acknowledged commit is in
        such a record: a commit returns once its record was flushed whole, on the
        synchronous standby too.) So, once the walreceiver no longer streams (the
        received WAL can only stay as it is): either replay reached what was received,
        or the startup process waits because no source has the WAL it needs next
        (RecoveryRetrieveRetryInterval; RecoveryWalStream, between its retries) and the
        replay position read by the next poll is the same. Each wait seen means all it
        could replay was, so a position read after one is final; the same position
        read before one, in the previous poll, rules out a replay racing the reads."""
        previous: list[Any] = [None]

        def predicate() -> bool:
            receiver_gone, caught_up, waiting, replayed = conn.execute(
                "SELECT NOT EXISTS (SELECT FROM pg_stat_wal_receiver"
                "                   WHERE status = 'streaming'),"
                " coalesce(pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(), false),"
                " EXISTS (SELECT FROM pg_stat_activity WHERE backend_type = 'startup'"
                "         AND wait_event IN ('RecoveryRetrieveRetryInterval',"
                "                            'RecoveryWalStream')),"
                " pg_last_wal_replay_lsn()").fetchone()
            if not receiver_gone:
                previous[0] = None
                return False
            if caught_up:
                return True
            done = waiting and previous[0] is not None and previous[0] == replayed
            previous[0] = replayed if waiting else None
            return done

        return predicate

    def kill_primary(self) -> None:
        """kill -9 of the primary's postmaster and all its children at once."""
        node = self.nodes[self.primary]
        pid = int((node.data / "postmaster.pid").read_text().split()[0])
        # Stopped first, it forks no backend between the scan and the kill: one that
        # escaped would live on, attached to the dead server's shared memory.
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        victims = [pid, *_children(pid)]
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._wait(lambda: all(_gone(v) for v in victims), "the killed processes to go",
                   timeout=30)

    def hold_back_standby(self, seconds: float) -> None:
        """Asynchronous mode: cut the standby off its primary for `seconds` (its
        primary_conninfo pointed at a closed port), so that it lags that far behind when
        the primary dies, as a standby under write load or across zones can."""
        if self.synchronous:
            raise ValueError("a synchronous standby cut off would stop every commit")
        with self._admin(self.standby) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=1'")
            conn.execute("SELECT pg_reload_conf()")
        with self._admin(self.primary) as conn:
            self._wait(lambda: conn.execute(
                "SELECT count(*) FROM pg_stat_replication").fetchone()[0] == 0,
                "the standby to disconnect")
        self._event(f"node{self.standby}: cut off from its primary")
        time.sleep(seconds)

    def failover(self, on_fork: Callable[[psycopg.Connection], Any] | None = None,
                 on_promoted: Callable[[int], None] | None = None,
                 lag: float = 0.0) -> Failover:
        """Kill the primary, promote the standby. With `lag` (asynchronous mode), the
        standby is cut off that many seconds before (hold_back_standby). on_fork(conn)
        reads the standby once it has replayed all it can of what it received (the
        surviving history at the fork); the promotion follows at once. on_promoted(node) runs right
        after it (repointing a PgBouncer, say)."""
        self.wait_rebuilt()
        if lag:
            self.hold_back_standby(lag)
        old, new = self.primary, self.standby
        killed_at = time.time()
        self.kill_primary()
        self._event(f"node{old}: killed")
        with self._admin(new) as conn:
            self._wait(self._replayed_all_it_can(conn),
                       "the standby to replay all it can of what it received")
            fork_lsn, replayed, short = conn.execute(
                "SELECT pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn(),"
                " pg_last_wal_replay_lsn() < pg_last_wal_receive_lsn()").fetchone()
            fork_lsn = str(fork_lsn)
            if short:
                self._event(f"node{new}: replayed up to {replayed} of {fork_lsn} received"
                            " (the rest: a record whose tail never came)")
            at_fork = on_fork(conn) if on_fork else None
            if self.synchronous:
                # Without a standby of its own yet, the new primary must not wait for one.
                conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
                conn.execute("SELECT pg_reload_conf()")
            if not conn.execute("SELECT pg_promote(true, 60)").fetchone()[0]:
                raise RuntimeError(f"node{new} was not promoted within 60 s")
        promoted_at = time.time()
        self._event(f"node{new}: promoted")
        self.primary = new
        if on_promoted:
            on_promoted(new)
        record = Failover(len(self.failovers) + 1, old, new, killed_at, promoted_at, fork_lsn,
                          at_fork)
        self.failovers.append(record)
        return record

    def rebuild_old_primary(self, record: Failover, *, background: bool = False) -> None:
        """The killed node becomes a standby of the new primary again (see the module's
        docstring); its dead data directory is kept in record.old_data."""
        def rebuild() -> None:
            try:
                node = self.nodes[record.old]
                aside = self.root / f"failover{record.number}-node{record.old}"
                aside.mkdir()
                _chown_to_server_user(aside)
                aside.chmod(0o700)
                node.data.rename(aside / "pgdata")
                shutil.copy2(node.password_file, aside / "password")
                record.old_data = aside
                self._add_standby(record.old, source=record.new)
            except BaseException as exc:
                self._rebuild_error = exc
                raise

        if background:
            self._rebuild = threading.Thread(target=rebuild, name="rebuild", daemon=True)
            self._rebuild.start()
        else:
            rebuild()

    @property
    def rebuilding(self) -> bool:
        return self._rebuild is not None and self._rebuild.is_alive()

    def wait_rebuilt(self) -> None:
        if self._rebuild is not None:
            self._rebuild.join()
            self._rebuild = None
        if self._rebuild_error is not None:
            raise RuntimeError("rebuilding the old primary failed") from self._rebuild_error

    def post_mortem(self, record: Failover, read: Callable[[psycopg.Connection], Any],
                    dbname: str = "postgres") -> Any:
        """Start the dead primary's data directory on its own, on a port no client knows,
        and read it: after crash recovery it holds everything the old primary had
        committed when it was killed, including what never reached the standby."""
        if record.old_data is None:
            raise RuntimeError("the old primary's data was not set aside (no rebuild yet)")
        server = EmbeddedPostgres(record.old_data, port=free_port())
        # (the pid in it is dead, but might belong to another process by now)
        (server.data / "postmaster.pid").unlink(missing_ok=True)
        server.start()
        try:
            dsn = make_conninfo(host="127.0.0.1", port=server.port, user="postgres",
                                password=self.password, dbname=dbname)
            with psycopg.connect(dsn, autocommit=True) as conn:
                return read(conn)
        finally:
            server.stop("immediate")

    def save_logs(self, folder: Path) -> None:
        """The event log and each server's log, for a failed run's post-mortem."""
        (folder / "replicaset-events.log").write_text("".join(
            time.strftime("%H:%M:%S", time.localtime(t)) + f"{t % 1:.3f}"[1:] + f" {what}\n"
            for t, what in self.events))
        for i, node in enumerate(self.nodes):
            if node.log_file.exists():
                shutil.copy(node.log_file, folder / f"node{i}-postgres.log")

    def stop(self) -> None:
        if self._rebuild is not None:
            self._rebuild.join(300)
        for node in self.nodes:
            try:
                node.stop("immediate")
            except Exception:
                pass

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
