"""What a worker holds, shared by its roles: producer, executor, completer, heartbeat.

Guarantees:
- Every lease the worker holds is in exactly one of three places: `buffer` (claimed,
  not started), `running` (a handler thread has it) or `unacked` (finished, its outcome
  not yet recorded in the database). The one exception: outcomes inside the statement
  that is recording them. So the heartbeat renews everything the worker holds, and
  shutdown releases everything it has not finished.
- One lock guards the three, the slot count `active` and `stats`, so a task moves from
  one place to the next in one critical section: it is never in two at once.
- The lifecycle events only ever go one way (set, never cleared), except `wake`, which
  is the claim loop's alarm clock.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from jobrunner.model.types import Lease, Outcome
from jobrunner.runtime.task import Task


@dataclass(slots=True)
class Running:
    """A task a handler thread has (or is about to have)."""

    lease: Lease
    task: Task
    future: Future | None = None  # None: chained on the thread of the task before it
    lost_at: float | None = None  # when the executor first saw its lease lost


class WorkerState:
    __slots__ = ("active", "buffer", "closing", "force_stop", "lock", "running", "stats",
                 "stopping", "unacked", "unacked_since", "wake", "wedged")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer: list[Lease] = []
        self.running: dict[int, Running] = {}
        # Handler threads at work: each holds one concurrency slot for as long as it runs
        # task after task (including the ack+claim between two tasks), so the claim loop
        # never claims for a slot a handler thread is about to fill itself.
        self.active = 0
        self.unacked: list[Outcome] = []
        self.unacked_since = 0.0  # when the oldest of `unacked` finished (monotonic)
        self.stats = {"claimed": 0, "done": 0, "failed": 0, "lost": 0, "released": 0,
                      "throttled": 0}
        self.stopping = threading.Event()  # first stop signal: claim nothing more
        self.force_stop = threading.Event()  # give back running tasks now; threads end
        self.closing = threading.Event()  # shutdown has begun: handler threads stop chaining
        self.wake = threading.Event()  # ends the claim loop's sleep early
        self.wedged = False  # a handler ignored its lost lease: the process must go

    def winding_down(self) -> bool:
        return (self.stopping.is_set() or self.force_stop.is_set() or self.closing.is_set()
                or self.wedged)

    def sleep(self, seconds: float) -> None:
        self.wake.wait(seconds)
        self.wake.clear()

    def in_flight(self) -> bool:
        with self.lock:
            return bool(self.running) or bool(self.buffer)

    def running_count(self) -> int:
        with self.lock:
            return len(self.running)

    def held(self) -> tuple[list[Running], list[Lease]]:
        """The running tasks whose lease is not known lost, and every lease the worker
        holds: theirs, the buffer's and those of outcomes waiting for their ack."""
        with self.lock:
            entries = [e for e in self.running.values() if not e.task.lease_lost.is_set()]
            leases = ([e.lease for e in entries] + self.buffer
                      + [o.lease for o in self.unacked])
        return entries, leases
