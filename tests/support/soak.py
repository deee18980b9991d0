"""The soak both fault tests run (tests/test_chaos.py: server restarts; tests/test_failover.py:
primary failovers): a batch with one task.once effect per task (tests/support/chaos.py's
handler), 8 worker processes killed with -9 at random and replaced, faults injected as the
batch progresses, then what the surviving history says.

Tasks are enqueued, and everything is read, through `direct`: a DSN that reaches the
current primary (a replica set's multi-host DSN follows it).

Every worker exit of every generation is counted and classified: killed by the soak (its
SIGKILL), clean (exit 0, drained) or a crash (anything else: a claim that raised, a worker
that gave up). A crash fails the soak, even though the soak replaces the worker as a Job
would replace a failed pod: a replaced crash is still a bug the batch happened to survive.

Mutual exclusion per shard is checked by a witness independent of the queue: each handler
execution writes its start and end to a file of its own (tests/support/chaos.py), a killed
worker's running execution ends when the soak saw it die, and no two executions of one
shard may overlap in time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.worker.executor import EXIT_WEDGED
from tests.support.figures import show
from tests.support.processes import child_env, start_worker

BATCH = "chaos"
NEIGHBOUR = "chaos-neighbour"  # another tenant's batch in the pool (run_soak with a pool)
SCHEMA = """
CREATE TABLE chaos_raw (id bigserial PRIMARY KEY, task_key text, shard_key text, attempt int,
                        worker text, started_at timestamptz, ended_at timestamptz);
CREATE TABLE chaos_effect (task_key text, attempt int, worker text);
"""
WORKER_ARGS = ("--exit-when-drained", "--visibility-timeout", "3", "--heartbeat", "1",
               "--backoff-base", "0.05", "--backoff-cap", "0.5", "--log-level", "warning")
N_SHARDS, N_WORKERS, N_POISON = 50, 8, 3
# Kills come with the batch's progress, not with time: one each KILL_EVERY finished tasks
# (drawn uniformly), plus one a moment after each fault, inside its window. Kills every
# 0.5-2 s made the soak's work follow the machine's load: 29 kills in the 35 s of the
# direct soak alone, 230 in a CI run where it shared the cores (384 s), each kill a new
# worker process (0.4 s of CPU to start) and leases to wait out, so the busier the
# machine, the more work the soak made for it. Now both runs do the same work.
KILL_EVERY = (100, 250)  # about 57 kills in 10,000 tasks
KILL_AFTER_FAULT = (0.2, 1.5)  # seconds


@dataclass
class Fault:
    """An action taken once `at` tasks are finished and `ready()` says so."""

    at: int
    action: Callable[[], None]
    ready: Callable[[], bool] = lambda: True


@dataclass
class Monitor:
    """Samples live leases per shard from the table itself, on a direct connection."""

    dsn: str
    samples: int = 0
    overlaps: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=2) as conn:
                    while not self.stop.is_set():
                        rows = conn.execute(
                            # (a shard is a tenant's: two tenants may use one key)
                            "SELECT tenant_id, shard_key, count(*) FROM agent_work_queue"
                            " WHERE status = 'leased' AND shard_key IS NOT NULL"
                            " GROUP BY tenant_id, shard_key HAVING count(*) > 1").fetchall()
                        self.samples += 1
                        self.overlaps.extend(rows)
                        time.sleep(0.02)
            except psycopg.Error:
                time.sleep(0.2)


@dataclass
class Exit:
    """One worker process's end. `at` is time.time() once the soak saw it gone: no later
    than the process's real end plus one poll (0.1 s), never earlier."""

    slot: int
    pid: int
    code: int
    at: float
    kind: str  # "killed" (by the soak's SIGKILL), "clean" (0), "wedged" (EXIT_WEDGED), "crash"
    log_tail: str = ""


@dataclass(frozen=True)
class Execution:
    """One handler execution, as its own process wrote it down (host clock)."""

    tenant: str
    shard: str
    key: str
    attempt: int
    worker: str
    start: float
    end: float
    ended: bool  # False: its end line is missing, `end` is when its process was seen gone


def read_witness(directory: Path, exits: list[Exit]) -> list[Execution]:
    gone = {e.pid: e.at for e in exits}
    runs: list[Execution] = []
    for path in directory.glob("*.log"):
        pid = int(path.stem)
        open_runs: dict[str, list[float]] = {}
        for line in path.read_text().splitlines():
            kind, at, run = line.split(" ", 2)
            if kind == "S":
                open_runs.setdefault(run, []).append(float(at))
            else:
                tenant, shard, key, attempt, worker = run.split(" ")
                runs.append(Execution(tenant, shard, key, int(attempt), worker,
                                      open_runs[run].pop(), float(at), True))
        for run, starts in open_runs.items():
            for start in starts:
                tenant, shard, key, attempt, worker = run.split(" ")
                # (a process that left an execution open must have exited: every
                # worker is waited for before the witness is read)
                runs.append(Execution(tenant, shard, key, int(attempt), worker, start,
                                      gone[pid], False))
    return runs


def shard_overlaps(runs: list[Execution]) -> list[tuple[Execution, Execution]]:
    """Pairs of executions of one shard (tenant, shard key) that overlapped in time."""
    by_shard: dict[tuple[str, str], list[Execution]] = {}
    for r in runs:
        if r.shard != "-":
            by_shard.setdefault((r.tenant, r.shard), []).append(r)
    pairs = []
    for shard_runs in by_shard.values():
        shard_runs.sort(key=lambda r: r.start)
        latest = shard_runs[0]
        for r in shard_runs[1:]:
            if r.start < latest.end:
                pairs.append((latest, r))
            if r.end > latest.end:
                latest = r
    return pairs


@dataclass
class SoakResult:
    tasks: int  # designed to succeed (N_POISON more are designed to die)
    kills: int
    faults: int
    elapsed: float
    counts: dict[str, int]
    stuck: int
    dead_keys: list[str]
    effects: int
    duplicate_effects: int
    # The ledger and the effects table, row for row (same task, attempt and worker):
    # written in one transaction, they must survive or vanish together.
    effects_without_ledger: int
    ledger_without_effect: int
    done_without_effect: int
    raw: int
    overlaps: list
    samples: int
    acked_overlaps: int
    killed: dict[int, float] = field(default_factory=dict)  # worker pid -> when (time.time())
    # With a pool: the other tenant's batch, (tasks, its status counts after the run).
    neighbour: tuple[int, dict[str, int]] | None = None
    exits: list[Exit] = field(default_factory=list)
    executions: list[Execution] = field(default_factory=list)
    execution_overlaps: list[tuple[Execution, Execution]] = field(default_factory=list)

    def exit_counts(self) -> dict[str, int]:
        return {kind: sum(e.kind == kind for e in self.exits)
                for kind in ("killed", "clean", "wedged", "crash")}

    @property
    def crashes(self) -> list[Exit]:
        return [e for e in self.exits if e.kind == "crash"]

    def exits_figure(self) -> str:
        c = self.exit_counts()
        return (f"worker_exits={len(self.exits)} (killed_by_soak={c['killed']} "
                f"clean={c['clean']} wedged={c['wedged']} crashed={c['crash']}) "
                f"executions_witnessed={len(self.executions)} "
                f"shard_execution_overlaps={len(self.execution_overlaps)}")

    @property
    def reexecutions(self) -> int:
        return self.raw - self.tasks

    @property
    def lost_tasks(self) -> int:
        return self.tasks + N_POISON - self.counts["done"] - self.counts["dead"]

    def assert_nothing_lost_or_duplicated(self, excused: Callable[[Execution, Execution], bool]
                                          = lambda a, b: False) -> None:
        """What must hold after any of the faults: every task ended, none stuck, every
        effect exactly once and with its ledger row, no two live leases of a shard, no
        two executions of a shard at once (but the pairs `excused` says a fault explains),
        and no worker crashed."""
        assert self.crashes == [], "\n".join(
            f"worker slot {e.slot} pid {e.pid} exited {e.code}:\n{e.log_tail}"
            for e in self.crashes[:3])
        assert self.exit_counts()["killed"] == self.kills
        # Every execution the queue recorded (chaos_raw) was also seen by the witness.
        assert len(self.executions) >= self.raw
        overlaps = [p for p in self.execution_overlaps if not excused(*p)]
        assert overlaps == [], overlaps[:5]
        assert self.counts["leased"] == 0 and self.counts["pending"] == 0 and self.stuck == 0
        assert self.counts["done"] == self.tasks
        assert sorted(self.dead_keys) == [f"poison-{i}" for i in range(N_POISON)]
        assert self.effects == self.tasks and self.duplicate_effects == 0
        assert (self.effects_without_ledger, self.ledger_without_effect,
                self.done_without_effect) == (0, 0, 0)
        assert self.overlaps == [] and self.samples > 50
        assert self.acked_overlaps == 0
        if self.neighbour is not None:
            n, counts = self.neighbour
            assert counts["done"] == n and counts["pending"] == counts["leased"] == 0, counts


def run_soak(direct: str, worker_dsn: str, tmp_path: Path, *, tasks: int, label: str,
             faults: list[Fault], extra_env: dict[str, str] | None = None,
             worker_args: tuple[str, ...] = WORKER_ARGS, pool: str | None = None,
             handler: str = "tests.support.chaos:handle") -> SoakResult:
    """With `pool`, the batch is enqueued into that worker pool, next to a second tenant's
    batch of the pool (done by the same workers, checked for loss too), and the workers
    are the pool's (`worker --pool`)."""
    with psycopg.connect(direct, row_factory=dict_row) as conn:
        conn.execute(SCHEMA)
        worker_user = conninfo_to_dict(worker_dsn).get("user")
        if worker_user and worker_user != conninfo_to_dict(direct).get("user"):
            # (workers of a role of their own, docs/security.md: the handler's own tables)
            conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON chaos_raw, chaos_effect TO {};"
                                 " GRANT USAGE ON SEQUENCE chaos_raw_id_seq TO {}").format(
                                     sql.Identifier(worker_user), sql.Identifier(worker_user)))
        conn.commit()
        specs = [TaskSpec(f"t{i:05d}", {}, shard_key=f"shard-{i % N_SHARDS}", max_attempts=50)
                 for i in range(tasks)]
        specs += [TaskSpec(f"poison-{i}", {"poison": True}, shard_key=f"shard-{i}")
                  for i in range(N_POISON)]
        Queue(conn).enqueue(BATCH, "acme", specs, pool=pool)
        if pool is not None:
            Queue(conn).enqueue(NEIGHBOUR, "other-tenant", [
                TaskSpec(f"n{i:05d}", {"noop": True}, shard_key=f"shard-{i % N_SHARDS}")
                for i in range(tasks // 10)], pool=pool)

    witness = tmp_path / f"{label}-witness"
    witness.mkdir()
    env = child_env(worker_dsn, JOBRUNNER_SOAK_WITNESS=str(witness), **(extra_env or {}))

    def spawn(i: int):
        size = "1" if i % 2 else "4"
        return start_worker(worker_dsn, BATCH, handler, *worker_args,
                            "--batch-size", size, env=env, log=tmp_path / f"{label}-w{i}.log",
                            pool=pool)

    monitor = Monitor(direct)
    watcher = threading.Thread(target=monitor.run, daemon=True)
    watcher.start()
    workers = {i: spawn(i) for i in range(N_WORKERS)}
    kills = applied = 0
    killed: dict[int, float] = {}
    exits: list[Exit] = []
    reaped: set[int] = set()

    def reap(i: int, by_soak: bool = False) -> None:
        """Count the exit of slot i's process (once)."""
        w = workers[i]
        if w.pid in reaped:
            return
        reaped.add(w.pid)
        code = w.returncode
        kind = ("killed" if by_soak and code == -signal.SIGKILL
                else "clean" if code == 0
                # the documented exit of a worker whose sync handler kept running after its
                # lease was lost (blocked on a database that stopped answering): by design,
                # its supervisor replaces it; counted, and not a crash
                else "wedged" if code == EXIT_WEDGED else "crash")
        tail = ""
        if kind == "crash":
            log = tmp_path / f"{label}-w{i}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            # (the slot's log holds every generation: the traceback's own frames and its
            # error line, not the rich box's library frames that fill its last 3,000 bytes)
            lines = text.splitlines()[-400:]
            tail = "\n".join(line for line in lines
                             if "jobrunner" in line or "Error" in line or "error" in line
                             )[-3000:]
        exits.append(Exit(i, w.pid, code, time.time(), kind, tail))
    plan = sorted(faults, key=lambda f: f.at)
    started = time.monotonic()

    def finished_count() -> int:
        try:
            with psycopg.connect(direct, connect_timeout=2) as c:
                return c.execute("SELECT count(*) FROM agent_work_queue WHERE status IN"
                                 " ('done', 'dead')").fetchone()[0]
        except psycopg.Error:
            return -1

    rng = random.Random(7)
    next_kill = rng.randint(*KILL_EVERY)  # (a count of finished tasks)
    kill_at = float("inf")  # (a time: set by a fault)
    while time.monotonic() - started < 900:
        finished = finished_count()
        if finished >= tasks + N_POISON + (tasks // 10 if pool is not None else 0):
            break
        if plan and finished >= plan[0].at and plan[0].ready():
            plan.pop(0).action()
            applied += 1
            kill_at = time.monotonic() + rng.uniform(*KILL_AFTER_FAULT)
        for i, w in list(workers.items()):
            if w.poll() is not None:
                reap(i)
                if w.returncode != 0:
                    workers[i] = spawn(i)  # as a Job would replace a failed pod
        if finished >= next_kill or time.monotonic() >= kill_at:
            victim = rng.choice([i for i, w in workers.items() if w.poll() is None] or [0])
            if workers[victim].poll() is None:
                os.killpg(workers[victim].pid, signal.SIGKILL)
                workers[victim].wait()
            if workers[victim].returncode == -signal.SIGKILL:
                killed[workers[victim].pid] = time.time()  # (after its end: an upper bound)
                kills += 1
                reap(victim, by_soak=True)
            else:
                # (it ended by itself, or in the instant between the look and the signal: a
                # drained worker exits 0 at the end of the soak; no kill to count)
                reap(victim)
            workers[victim] = spawn(victim)
            if finished >= next_kill:
                next_kill = finished + rng.randint(*KILL_EVERY)
            else:
                kill_at = float("inf")
        time.sleep(0.1)
    for i, w in workers.items():
        try:
            w.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()
        reap(i)
    monitor.stop.set()
    watcher.join(5)
    elapsed = time.monotonic() - started
    executions = read_witness(witness, exits)

    with psycopg.connect(direct, row_factory=dict_row) as conn:
        q = Queue(conn)
        counts = q.counts(BATCH)
        one = _reader(conn)
        dup_effects = one("SELECT count(*) FROM (SELECT task_key FROM chaos_effect"
                          " GROUP BY task_key HAVING count(*) > 1) d")
        effects = one("SELECT count(*) FROM chaos_effect")
        same_row = ("l.batch_id = %(batch)s AND l.task_key = e.task_key AND l.effect_key = 'effect'"
                    " AND l.attempt = e.attempt AND l.lease_owner = e.worker")
        effects_without_ledger = one(
            "SELECT count(*) FROM chaos_effect e WHERE NOT EXISTS"
            f" (SELECT 1 FROM agent_task_effect l WHERE {same_row})")
        ledger_without_effect = one(
            "SELECT count(*) FROM agent_task_effect l WHERE l.batch_id = %(batch)s"
            f" AND NOT EXISTS (SELECT 1 FROM chaos_effect e WHERE {same_row})")
        done_without_effect = one(
            "SELECT count(*) FROM agent_work_queue q WHERE q.batch_id = %(batch)s"
            " AND q.status = 'done' AND NOT EXISTS"
            " (SELECT 1 FROM chaos_effect e WHERE e.task_key = q.task_key)")
        raw = one("SELECT count(*) FROM chaos_raw")
        # The executions that were acked (the final attempt of each done task, by the
        # worker that acked it) must never have overlapped in time on a shard.
        acked_overlaps = one("""
            WITH acked AS (
                SELECT r.shard_key, r.started_at, r.ended_at, r.task_key
                FROM chaos_raw r JOIN agent_work_queue q
                  ON q.task_key = r.task_key AND q.attempts = r.attempt
                 AND q.lease_owner = r.worker
                WHERE q.batch_id = %(batch)s AND q.status = 'done' AND r.ended_at IS NOT NULL)
            SELECT count(*) FROM acked a JOIN acked b
              ON a.shard_key = b.shard_key AND a.task_key < b.task_key
             AND a.started_at < b.ended_at AND b.started_at < a.ended_at""")
        stuck = q.health(BATCH)["stuck"]
        neighbour = (tasks // 10, q.counts(NEIGHBOUR)) if pool is not None else None
        dead_keys = [r["task_key"] for r in q.list_dead(BATCH)]
    return SoakResult(tasks=tasks, kills=kills, faults=applied, elapsed=elapsed, counts=counts,
                      stuck=stuck, dead_keys=dead_keys, effects=effects,
                      duplicate_effects=dup_effects,
                      effects_without_ledger=effects_without_ledger,
                      ledger_without_effect=ledger_without_effect,
                      done_without_effect=done_without_effect, raw=raw,
                      overlaps=monitor.overlaps, samples=monitor.samples,
                      acked_overlaps=acked_overlaps, killed=killed, neighbour=neighbour,
                      exits=exits, executions=executions,
                      execution_overlaps=shard_overlaps(executions))


def _reader(conn: psycopg.Connection) -> Callable[[str], Any]:
    def one(sql: str) -> Any:
        return next(iter(conn.execute(sql, {"batch": BATCH}).fetchone().values()))

    return one


def report(summary: str, tmp_path: Path, capsys: Any) -> None:
    """The figure line: printed past pytest's capture, so it shows in any CI log."""
    show(capsys, summary)
    (tmp_path / "summary.txt").write_text(summary + "\n")
