"""A worker process's settings and its id."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jobrunner.model.errors import BadInput
from jobrunner.model.types import Timing
from jobrunner.runtime.task import Task


def default_worker_id(base: str | None = None) -> str:
    """Unique per process start: a restarted pod with the same name is a new owner."""
    base = base or os.environ.get("JOBRUNNER_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"
    return f"{base}-{secrets.token_hex(3)}"


@dataclass
class WorkerConfig:
    dsn: str
    batch_id: str | None  # None: a pool worker (pool below)
    handler: Callable[[Task], Any]
    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 1
    batch_size: int = 1
    visibility_timeout: float = 600.0
    heartbeat_interval: float | None = None  # default: visibility_timeout / 3
    backoff_base: float = 1.0
    backoff_cap: float = 3600.0
    max_throttles: int = 20  # rate-limited answers (RateLimited, exit 76) before dead
    exit_when_drained: bool = False
    # Idle sleep between polls when no notifier is connected (--no-listen, or behind a
    # transaction pooler without a direct listen DSN).
    idle_poll: tuple[float, float] = (0.2, 0.5)
    # With a connected notifier a waiting worker sleeps until a note, a known retry time
    # or a limit's room. Before it does, it asks when its batch's (or pool's) earliest
    # pending task is due (task_next_due, one index probe). Nothing pending, or nothing
    # due before the sleep would end: this slow poll, which only covers notes that were
    # lost (every transition that makes a task claimable sends one, but one: below). The
    # poll is that look again, not a claim; it claims only if a task is due.
    idle_fallback: tuple[float, float] = (30.0, 90.0)
    # ... a task due now that its claim did not get: its shard is busy (an ack that frees
    # a shard sends no note: a NOTIFY per ack would cost every task one), a concurrent
    # claim held its row, its limit is full or its budget spent. It looks again this
    # often (seconds: at 30-90 s the chaos soak, whose shards are busy, ran 10 minutes).
    idle_blocked: tuple[float, float] = (5.0, 15.0)
    # For this long after a claim that got tasks, or an ack, an idle worker still polls
    # at idle_poll: work that no note announces (the shard its own ack released, rows a
    # concurrent claim held locked for an instant) is found as quickly as before.
    idle_warm: float = 2.0
    # --exit-when-drained, its batch still open with nothing to claim (tasks leased by
    # others): how often it looks whether the batch is done. No note says so.
    drain_poll: tuple[float, float] = (1.0, 3.0)
    # The maintenance leader's sweep interval (expired leases, due reduces); without a
    # notifier, every worker sweeps this often, as before leadership existed.
    expire_interval: float = 1.0
    # A worker that does not lead still sweeps this often (jittered): it rescues what it
    # can see while the leader is gone (a node lost, so its lock is not released yet): a
    # fleet of W workers sweeps every 30 s / W on average (docs/guarantees.md).
    backstop_interval: float = 30.0
    # The notifier's direct DSN (LISTEN and the leader's advisory lock need a session of
    # their own): default $JOBRUNNER_LISTEN_DATABASE_URL, else `dsn` unless behind a
    # transaction pooler (jobrunner/worker/notifier.py).
    listen_dsn: str | None = None
    grace_period: float = 30.0
    lost_lease_grace: float = 10.0
    claim_timeout_ms: int = 5000
    heartbeat_timeout_ms: int = 3000
    listen: bool = True
    max_tasks: int | None = None
    # A finished task's ack may wait this long while the worker still has claimed tasks
    # to start, so that the acks of a claimed batch go out together with the next claim
    # (one round trip, one commit). Its lease is heartbeated meanwhile.
    max_ack_delay: float = 0.5
    # Claim across every open batch of this pool instead of one batch
    # (jobrunner/store/workerpools.py).
    pool: str | None = None

    def __post_init__(self) -> None:
        if (self.batch_id is None) == (self.pool is None):
            raise BadInput("a worker serves either one batch or one pool: give exactly one "
                           "of batch_id and pool")
        if self.heartbeat_interval is None:
            self.heartbeat_interval = self.visibility_timeout / 3
        checks = [
            (self.concurrency >= 1, "concurrency must be at least 1"),
            (self.concurrency <= 1000, "concurrency must be at most 1000"),
            (1 <= self.batch_size <= 1000, "batch size must be between 1 and 1000"),
            (0 < self.visibility_timeout <= 7 * 86400,
             "visibility timeout must be > 0 and at most 7 days"),
            (0 < self.heartbeat_interval < self.visibility_timeout / 2,
             "heartbeat interval must be > 0 and less than half the visibility timeout"),
            (self.backoff_base > 0 and self.backoff_cap >= self.backoff_base,
             "backoff base must be > 0 and the cap at least the base"),
            (self.grace_period >= 0, "grace period must not be negative"),
            (1 <= self.max_throttles <= 10000, "max throttles must be between 1 and 10000"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInput(message)

    @property
    def timing(self) -> Timing:
        return Timing(self.visibility_timeout, self.backoff_base, self.backoff_cap,
                      self.max_throttles)
