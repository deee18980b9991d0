"""Reduce: a step that runs once, after every task of its batch is terminal, and whose
return value is the batch's result (docs/results.md, "Reduce").

Guarantees:
- The reduce runs as a task of its own (key REDUCE_KEY) that is inserted only once the
  batch is settled, so it has a lease, heartbeat, fencing, retries and the effects
  helper like any task, and a crash re-runs it.
- Settled is decided from the rows (the SQL function jobrunner_batch_settled: no task
  pending or leased; with onDead fail, none dead), never from a counter. The trigger
  (`trigger`) is one named query, reduce_enqueue, run after locking the batch row: the
  insert is idempotent on the unique key (batch_id, task_key) and sets
  agent_batch.reduce_enqueued_at in the same statement, so any number of callers at any
  moment enqueue at most one reduce per batch, ever. Whoever may see the batch settle
  calls it: a worker's drain check, every worker's maintenance tick, the operator's
  reconcile. The lock orders it with enqueue (which refuses new tasks once the reduce
  was enqueued) and with cancel (a cancelled batch never reduces).
- The batch's result is written by the reduce task through `task.once` (fenced on its
  lease, recorded in the effects ledger): at most once, and never by a worker that lost
  the lease. An attempt that finds it written already returns without running the step
  again; so the result is the step's return value in the first attempt that committed.
- A worker's drain check counts a reduce that is due but not yet enqueued (it enqueues
  it) and one that is pending or running: no worker of the batch exits drained while
  its reduce has still to run, so a Job's pods stay until it is done.
"""

from __future__ import annotations

import inspect
import json
import logging
import shlex
import shutil
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import psycopg

from jobrunner.features.results import ITERSIZE
from jobrunner.model import validation
from jobrunner.model.errors import BadInput, PermanentError
from jobrunner.observability import tracing
from jobrunner.queue.client import dumps_result
from jobrunner.runtime.task import Task
from jobrunner.runtime.taskhandlers import (
    CommandHandler,
    PythonHandler,
    async_form,
    has_async,
    importable,
)
from jobrunner.store import db, effects, worker_waits
from jobrunner.store import reduce as reduce_store
from jobrunner.store import results as result_store

if TYPE_CHECKING:
    from jobrunner.queue.client import Queue

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

REDUCE_KEY = validation.REDUCE_KEY  # the reduce task's key: reserved, refused by enqueue
ON_DEAD = ("fail", "skip", "include")
RESULT_EFFECT = "jobrunner:batch-result"  # its effects-ledger key
STATUS_RESULT_BYTES = 4096  # a larger result is not copied into a BatchRun's status
_LEASE_CHECK_EVERY = 1000  # results between two lease checks of the input stream


@dataclass(frozen=True)
class ReduceSpec:
    """`reduce: {handler: MODULE:FUNC}` or `{command: [...]}`, with `onDead`."""

    handler: str | None = None
    command: tuple[str, ...] | None = None
    on_dead: str = "fail"
    max_attempts: int = 8

    def as_json(self) -> dict[str, Any]:
        step: dict[str, Any] = ({"handler": self.handler} if self.handler
                                else {"command": list(self.command or ())})
        return {**step, "onDead": self.on_dead, "maxAttempts": self.max_attempts}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReduceSpec:
        command = raw.get("command")
        return cls(handler=raw.get("handler"), command=tuple(command) if command else None,
                   on_dead=raw.get("onDead") or "fail",
                   max_attempts=int(raw.get("maxAttempts") or 8))

    def describe(self) -> str:
        return self.handler or shlex.join(self.command or ())


def parse_reduce(raw: Any, where: str, max_attempts: int = 8) -> ReduceSpec | None:
    """spec.reduce of a manifest (the CRD applies the same rules)."""
    if raw is None:
        return None
    at = f"{where}: spec.reduce"
    handler, command = validation.parse_step(raw, at, ("handler", "command", "onDead"),
                                             "onDead")
    on_dead = raw.get("onDead", "fail")
    if on_dead not in ON_DEAD:
        raise BadInput(f"{at}.onDead must be one of {', '.join(ON_DEAD)}, got {on_dead!r}")
    return ReduceSpec(handler=handler, command=tuple(command) if command else None,
                      on_dead=on_dead, max_attempts=max_attempts)


# -- the step itself ------------------------------------------------------------------
Reducer = Callable[[Task, Iterator[dict[str, Any]]], Any]


def load(spec: ReduceSpec) -> Callable[[Task, Callable[[], Iterator[dict[str, Any]]]], Any]:
    """The step as a callable of (task, open_inputs); BadInput says exactly what is wrong
    (a module that does not import, a function that does not take (task, results), a
    command that is not there)."""
    if spec.handler:
        python = PythonHandler(spec.handler)
        try:
            inspect.signature(python.fn).bind(None, None)
        except TypeError:
            raise BadInput(f"reduce handler {spec.handler!r} must take two arguments: "
                           "(task, results)") from None
        except ValueError:
            pass  # (no signature to inspect: a builtin; let the call tell)

        def run_python(task: Task, open_inputs: Callable[[], Iterator[dict[str, Any]]]) -> Any:
            return python(task, open_inputs())

        return run_python
    argv = list(spec.command or ())
    program = argv[0] if argv else ""
    if not program or (shutil.which(program) is None):
        raise BadInput(f"reduce command {spec.describe()!r}: program {program!r} not found")
    command = CommandHandler(argv)

    def run_command(task: Task, open_inputs: Callable[[], Iterator[dict[str, Any]]]) -> Any:
        def feed(pipe: IO[bytes]) -> None:
            for item in open_inputs():
                pipe.write(json.dumps(item, ensure_ascii=False).encode() + b"\n")

        return command(task, feed)

    return run_command


def check_loadable(spec: ReduceSpec, paths: Sequence[str] = ()) -> None:
    """Load the step once, as a worker would (with `paths` importable too), so that a bad
    one is refused before anything is written."""
    with importable(paths):
        load(spec)


def inputs(conn: psycopg.Connection, task: Task, include_dead: bool) -> Iterator[dict[str, Any]]:
    """The batch's results in task key order, streamed through a server-side cursor:
    {"key", "status", "result", "error", "attempts"} per task (done: result; with onDead
    include also dead: error). The lease is checked as the rows go by: a reduce whose
    lease was lost stops at the next check (LeaseLost)."""
    rows = result_store.stream(conn, reduce_store.INPUTS, {
        "batch_id": task.batch_id, "include_dead": include_dead}, ITERSIZE)
    try:
        for n, (key, status, result, error, attempts) in enumerate(rows, 1):
            if n % _LEASE_CHECK_EVERY == 0:
                task.check_lease()
            yield {"key": key, "status": status,
                   "result": json.loads(result) if result is not None else None,
                   "error": error, "attempts": attempts}
    finally:
        rows.close()


class WithReduce:
    """A worker's handler: the batch's own tasks go to its handler, the reduce task to
    the batch's reduce step (read from the batch when it runs)."""

    def __init__(self, handler: Callable[[Task], Any], dsn: str) -> None:
        self.handler = handler
        self.dsn = dsn
        self._steps: dict[str, Callable[..., Any]] = {}

    def __call__(self, task: Task) -> Any:
        if task.key != REDUCE_KEY:
            return self.handler(task)
        return self.reduce(task)

    @property
    def has_async(self) -> bool:
        return has_async(self.handler)

    def async_form(self, task: Task) -> Callable[[Task], Awaitable[Any]] | None:
        # (the reduce step reads and writes the database: a handler thread runs it)
        return None if task.key == REDUCE_KEY else async_form(self.handler, task)

    def _step(self, spec: ReduceSpec) -> Callable[..., Any]:
        key = json.dumps(spec.as_json(), sort_keys=True)
        if key not in self._steps:
            try:
                self._steps[key] = load(spec)
            except BadInput as exc:
                raise PermanentError(str(exc)) from None
        return self._steps[key]

    def reduce(self, task: Task) -> Any:
        with _connection(self.dsn, task) as conn:
            st = state(conn, task.batch_id)
            if st is None or st.spec is None:
                raise PermanentError(f"batch {task.batch_id!r} has no reduce step")
            done = _stored_marker(conn, task)
            if done is not None:
                # An earlier attempt stored the result and died before its ack.
                return done
            step = self._step(st.spec)
            include = st.spec.on_dead == "include"
            opened: list[Iterator[dict[str, Any]]] = []

            def open_inputs() -> Iterator[dict[str, Any]]:
                if opened:
                    raise RuntimeError("the results of a reduce can be read once")
                opened.append(inputs(conn, task, include))
                return opened[0]

            try:
                value = step(task, open_inputs)
            finally:
                for it in opened:
                    it.close()  # type: ignore[attr-defined]
        task.check_lease()
        try:
            encoded = dumps_result(value)
        except (TypeError, ValueError) as exc:
            raise PermanentError(f"reduce returned a value that is not JSON: {exc}") from None
        size = len(encoded.encode())

        def store(c: psycopg.Connection) -> dict[str, Any]:
            reduce_store.store_result(c, task.batch_id, encoded, size)
            return {"result_bytes": size, "attempt": task.attempt}

        marker = task.once(RESULT_EFFECT, store)
        log.info("batch %s: reduce done (attempt %d); result %d bytes", task.batch_id,
                 task.attempt, marker.get("result_bytes", size))
        return marker


@contextmanager
def _connection(dsn: str, task: Task) -> Iterator[psycopg.Connection]:
    # Its own connection: the step may hold it for a long stream, while task.once takes
    # one of the effects pool's.
    conn = db.connect(dsn, autocommit=True, purpose=f"jobrunner-reduce {task.worker_id}")
    try:
        yield conn
    finally:
        conn.close()


def _stored_marker(conn: psycopg.Connection, task: Task) -> dict[str, Any] | None:
    row = effects.lookup(conn, {"batch_id": task.batch_id, "task_key": task.key,
                                "effect_key": RESULT_EFFECT})
    return None if row is None else (row["result"] or {})


# -- state and the trigger ----------------------------------------------------------
@dataclass(frozen=True)
class ReduceState:
    spec: ReduceSpec | None
    cancelled: bool
    enqueued: bool  # the trigger fired (the task may have been deleted by retention since)
    task_status: str | None  # of the reduce task, when it exists
    attempts: int | None
    max_attempts: int | None
    last_error: str | None
    reduced: bool  # the result is stored
    result_bytes: int | None
    due: bool  # settled and not enqueued yet: the next trigger enqueues it
    tenant_id: str = ""

    @property
    def configured(self) -> bool:
        return self.spec is not None

    @property
    def running(self) -> bool:
        """Enqueued and not finished: pending (waiting for a worker) or leased."""
        return self.task_status in ("pending", "leased")

    def phase(self, counts: Mapping[str, int] | None = None) -> str:
        """One word: none, waiting (for the batch's tasks), due, pending, running, done,
        failed (the reduce task is dead), skipped (onDead fail with dead tasks), cancelled."""
        if self.spec is None:
            return "none"
        status = self.task_status
        if status == "leased":
            return "running"
        if status == "pending":
            return status
        if self.reduced:
            return "done"
        if status in ("dead", "done"):  # (done without a result: cannot happen; say so)
            return "failed"
        if status == "cancelled":
            return status
        if self.cancelled:
            return "cancelled"
        if self.due:
            return "due"
        if (counts is not None and self.spec.on_dead == "fail" and counts.get("dead")
                and not counts.get("pending") and not counts.get("leased")):
            return "skipped"
        return "waiting"

    def describe(self, counts: Mapping[str, int] | None = None) -> str:
        phase = self.phase(counts)
        spec = self.spec
        if spec is None:
            return "no reduce step"
        what = {
            "waiting": "waits for the batch's tasks",
            "due": "due: every task is terminal",
            "pending": "enqueued, waiting for a worker",
            "running": f"running (attempt {self.attempts} of {self.max_attempts})",
            "done": "done" + (f", result {self.result_bytes:,} bytes"
                              if self.result_bytes is not None else ""),
            "failed": f"failed after {self.attempts} attempt(s): {self.last_error or ''}",
            "skipped": f"will not run: {(counts or {}).get('dead', 0)} dead task(s) and "
                       "onDead: fail",
            "cancelled": "never runs: the batch was cancelled",
        }[phase]
        return f"{what} ({spec.describe()}, onDead {spec.on_dead})"

    def as_json(self, counts: Mapping[str, int] | None = None) -> dict[str, Any] | None:
        if self.spec is None:
            return None
        return {"step": self.spec.as_json(), "state": self.phase(counts),
                "attempts": self.attempts, "error": self.last_error if
                self.task_status == "dead" else None, "result_bytes": self.result_bytes}


def state(conn: psycopg.Connection, batch_id: str) -> ReduceState | None:
    """The batch's reduce step and its task, lock-free (None: no such batch)."""
    with conn.transaction():
        row = reduce_store.state(conn, batch_id)
    if row is None:
        return None
    raw = row["reduce"]
    return ReduceState(
        spec=ReduceSpec.from_json(raw) if raw else None, cancelled=row["cancelled"],
        enqueued=row["reduce_enqueued_at"] is not None, task_status=row["task_status"],
        attempts=row["attempts"], max_attempts=row["max_attempts"],
        last_error=row["last_error"], reduced=row["reduced_at"] is not None,
        result_bytes=row["result_bytes"], due=bool(row["due"]), tenant_id=row["tenant_id"])


def trigger(conn: psycopg.Connection, batch_id: str) -> ReduceState | None:
    """Enqueue the batch's reduce task if it is due; return the reduce's state after.
    Safe to call from anywhere, any number of times, concurrently: see the module's
    guarantees. Costs one lock-free statement while the batch is not settled."""
    st = state(conn, batch_id)
    if st is None or not st.due:
        return st
    # (a PRODUCER span as every enqueue's, which the reduce's attempts link to)
    with tracing.enqueue_span(batch_id, st.tenant_id, task_key=REDUCE_KEY) as span, \
            conn.transaction():
        row = reduce_store.enqueue(conn, batch_id, tracing.carrier())
        if row is not None:
            worker_waits.wake(conn, 1, batch_id=batch_id)
        if span is not None:
            span.set_attribute("jobrunner.reduce.enqueued", row is not None)
    if row is not None:
        log.info("batch %s: every task is terminal; reduce task %s enqueued", batch_id,
                 row["id"])
    return state(conn, batch_id)


def drain_open(q: Queue, batch_id: str) -> bool:
    """A worker's drain check: True while the batch has tasks pending or leased, or a
    reduce still to run (enqueued here if it is due). Pending and leased are read first:
    once they are none, every task is terminal for good (short of an operator's requeue),
    so a reduce that is due then is enqueued by this call or was by a concurrent one, and
    the read after it sees it."""
    if q.batch_open(batch_id):
        return True
    st = trigger(q.conn, batch_id)
    return st is not None and st.running


def check_batch(conn: psycopg.Connection, batch_id: str) -> None:
    """At a worker's start: a reduce step of the batch that still has to run must load
    here (BadInput otherwise), as the batch's handler must: a clear error at once, not
    after every task ran."""
    st = state(conn, batch_id)
    if st is not None and st.spec is not None and not st.reduced and not st.cancelled:
        load(st.spec)


def attach(conn: psycopg.Connection, batch_id: str, spec: ReduceSpec | None) -> None:
    """Give a batch its reduce step (the operator, for a batch enqueued elsewhere)."""
    if spec is None:
        return
    with conn.transaction():
        reduce_store.set_spec(conn, batch_id, json.dumps(spec.as_json()))


# -- the batch's result ---------------------------------------------------------------
@dataclass(frozen=True)
class BatchResult:
    stored: bool
    size: int | None  # bytes of its JSON text
    text: str | None  # its JSON text (None when not stored, or larger than asked for)

    def value(self) -> Any:
        return None if self.text is None else json.loads(self.text)


def batch_result(conn: psycopg.Connection, batch_id: str,
                 max_bytes: int | None = None) -> BatchResult | None:
    """The batch's result (None: no such batch); only when at most max_bytes if given."""
    with conn.transaction():
        row = reduce_store.result(conn, batch_id, max_bytes)
    if row is None:
        return None
    return BatchResult(stored=row["reduced_at"] is not None, size=row["result_bytes"],
                       text=row["result"])


def status_result(conn: psycopg.Connection, batch_id: str) -> tuple[bool, Any]:
    """The result as a BatchRun status carries it: (True, value) when it is at most
    STATUS_RESULT_BYTES, else (True, a pointer saying where it is); (False, None) when
    there is none yet."""
    found = batch_result(conn, batch_id, STATUS_RESULT_BYTES)
    if found is None or not found.stored:
        return False, None
    if found.text is not None:
        return True, found.value()
    return True, (f"{found.size:,} bytes: too large for the status; in the database, "
                  f"`jobrunner status --batch {batch_id}` (the whole result: "
                  f"`jobrunner results --batch {batch_id} --reduce`)")


def preview(value: Any, lines: int = 8, width: int = 160) -> list[str]:
    """The first lines of a result, for a terminal: text as it is, anything else as
    indented JSON; long lines cut."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2,
                                                           ensure_ascii=False)
    out = text.splitlines()[:lines]
    return [line if len(line) <= width else line[:width - 1] + "…" for line in out]
