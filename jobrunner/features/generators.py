"""Generators: a batch's tasks produced at run time by user code (docs/sources.md).

Guarantees:
- The generator runs as a task of its own (key GENERATE_KEY) claimed by the batch's
  workers, so it has a lease, heartbeat, fencing and retries like any task: a crash
  (kill -9 of its pod, OOM, node loss) lets the lease expire and another worker runs it
  again from the start. It runs at least once, to the end, or ends dead.
- What it yields is enqueued in chunks, each chunk one transaction of the ordinary keyed
  enqueue (idempotent on (batch, task key)), fenced on the generator's lease: a re-run
  adds only the keys that are missing, and a generator that lost its lease enqueues
  nothing more. Workers claim the first chunks while the generator goes on.
- The batch is not complete while the generator is pending or leased: its row is
  pending or leased like any task, so a worker's drain check keeps the workers and the
  reduce waits (jobrunner_batch_settled, sql/schema.sql). A generator that ended dead
  keeps the batch from settling (no reduce over an incomplete batch), and the tasks it
  enqueued stay and run.
- Deterministic keys are the user's part: a re-run that yields other keys for the same
  work (a random id, a timestamp) enqueues that work twice.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import queue as queue_mod
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from jobrunner.model import validation
from jobrunner.model.errors import BadInput, LeaseLost, PermanentError
from jobrunner.model.validation import TaskSpec, task_from_obj
from jobrunner.queue.client import Queue
from jobrunner.runtime.task import Task
from jobrunner.runtime.taskhandlers import (
    EXIT_RETRY,
    PythonHandler,
    RetryableError,
    _kill_group,
    async_form,
    has_async,
    importable,
)
from jobrunner.store import batches, db, effects, worker_waits
from jobrunner.store import generators as generator_store
from jobrunner.store import reduce as reduce_store

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

GENERATE_KEY = validation.GENERATE_KEY
DEFAULT_CHUNK = 1000
MAX_CHUNK = 10_000
# A chunk is also sent when its first task has waited this long, so a slow generator's
# tasks do not wait for a full chunk before workers see them.
FLUSH_SECONDS = 0.5
_END = object()


@dataclass(frozen=True)
class GeneratorSpec:
    """`generator: {handler: MODULE:FUNC | command: [...], args, chunkSize, maxAttempts}`;
    task_max_attempts is the batch's default for the tasks it yields."""

    handler: str | None = None
    command: tuple[str, ...] | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    chunk_size: int = DEFAULT_CHUNK
    max_attempts: int = 8
    task_max_attempts: int = 8
    # the run's flow-control defaults for the tasks it yields (spec.limits, spec.tokens)
    limits: tuple[str, ...] | None = None
    tokens: int | None = None

    def as_json(self) -> dict[str, Any]:
        step: dict[str, Any] = ({"handler": self.handler} if self.handler
                                else {"command": list(self.command or ())})
        flow: dict[str, Any] = {}
        if self.limits:
            flow["limits"] = list(self.limits)
        if self.tokens is not None:
            flow["tokens"] = self.tokens
        return {**step, "args": dict(self.args), "chunkSize": self.chunk_size,
                "maxAttempts": self.max_attempts, "taskMaxAttempts": self.task_max_attempts,
                **flow}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> GeneratorSpec:
        command = raw.get("command")
        return cls(handler=raw.get("handler"), command=tuple(command) if command else None,
                   args=raw.get("args") or {},
                   chunk_size=int(raw.get("chunkSize") or DEFAULT_CHUNK),
                   max_attempts=int(raw.get("maxAttempts") or 8),
                   task_max_attempts=int(raw.get("taskMaxAttempts") or 8),
                   limits=tuple(raw["limits"]) if raw.get("limits") else None,
                   tokens=raw.get("tokens"))

    def describe(self) -> str:
        return self.handler or shlex.join(self.command or ())


def parse_generator(raw: Any, where: str, max_attempts: int = 8) -> GeneratorSpec:
    """spec.source.generator of a manifest (the CRD applies the same rules)."""
    at = f"{where}: spec.source.generator"
    handler, command = validation.parse_step(
        raw, at, ("handler", "command", "args", "chunkSize", "maxAttempts"), "args")
    args = raw.get("args", {})
    if not isinstance(args, Mapping):
        raise BadInput(f"{at}.args must be a mapping (handed to the generator as JSON)")
    validation.encode_payload(dict(args), f"{at}.args")
    chunk = raw.get("chunkSize", DEFAULT_CHUNK)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise BadInput(f"{at}.chunkSize must be an integer from 1 to {MAX_CHUNK}, got {chunk!r}")
    attempts = raw.get("maxAttempts", max_attempts)
    validation.check_max_attempts(attempts, f"{at}.maxAttempts")
    return GeneratorSpec(handler=handler, command=tuple(command) if command else None,
                         args=dict(args), chunk_size=chunk, max_attempts=attempts,
                         task_max_attempts=max_attempts)


# -- the step itself ------------------------------------------------------------------
def load(spec: GeneratorSpec) -> Callable[[Task], Iterator[tuple[str, Any]]]:
    """The step as a callable of the task that yields (where, item); BadInput says what is
    wrong (a module that does not import, a function that does not take (task, args),
    a command that is not there)."""
    if spec.handler:
        python = PythonHandler(spec.handler)
        if python.is_async:
            raise BadInput(f"generator {spec.handler!r} must be a plain function or "
                           "generator function, not async")
        try:
            inspect.signature(python.fn).bind(None, None)
        except TypeError:
            raise BadInput(f"generator {spec.handler!r} must take two arguments: "
                           "(task, args)") from None
        except ValueError:
            pass  # (no signature to inspect: a builtin; let the call tell)

        def run_python(task: Task) -> Iterator[tuple[str, Any]]:
            items = python.fn(task, dict(spec.args))
            if items is None or isinstance(items, str | bytes | Mapping):
                raise PermanentError(f"generator {spec.handler!r} must return or yield an "
                                     f"iterable of tasks, got {type(items).__name__}")
            for n, item in enumerate(items, 1):
                yield f"generator {spec.handler} item {n}", item

        return run_python
    argv = list(spec.command or ())
    program = argv[0] if argv else ""
    if not program or shutil.which(program) is None:
        raise BadInput(f"generator command {spec.describe()!r}: program {program!r} not found")

    def run_command(task: Task) -> Iterator[tuple[str, Any]]:
        return _command_lines(argv, task, spec.args)

    return run_command


def check_loadable(spec: GeneratorSpec, paths: Sequence[str] = ()) -> None:
    """Load the step once, as a worker would (with `paths` importable too), so that a bad
    one is refused before anything is written."""
    with importable(paths):
        load(spec)


def _command_lines(argv: list[str], task: Task, args: Mapping[str, Any]
                   ) -> Iterator[tuple[str, Any]]:
    """Run a generator command: args as JSON on stdin, the task's JOBRUNNER_* variables
    in its environment (as a command handler's), one JSON line per task on stdout, read
    as it prints them. Exit 0: finished; 75 or killed by a signal: retry; anything else,
    or a line that is not a task: dead (the same code would fail the same way)."""
    env = dict(os.environ)
    env.update({"JOBRUNNER_TASK_ID": str(task.id), "JOBRUNNER_TASK_KEY": task.key,
                "JOBRUNNER_BATCH_ID": task.batch_id, "JOBRUNNER_TENANT_ID": task.tenant_id,
                "JOBRUNNER_ATTEMPT": str(task.attempt), "JOBRUNNER_WORKER_ID": task.worker_id})
    env.pop("JOBRUNNER_DATABASE_URL", None)  # the command gets its task, not the queue
    where = f"generator command {shlex.join(argv)!r} stdout line"
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, env=env, start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            try:
                proc.stdin.write(json.dumps(dict(args)).encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
            for number, raw in enumerate(proc.stdout, 1):
                line = raw.decode(errors="replace")
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line, parse_constant=_reject_constant)
                except ValueError as exc:
                    raise PermanentError(f"{where} {number}: malformed JSON ({exc})") from None
                yield f"{where} {number}", obj
            proc.wait()
        finally:
            if proc.poll() is None:  # (stopped early: lease lost, bad line, closed)
                _kill_group(proc)
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace").strip()
    code = proc.returncode
    detail = f": {tail}" if tail else ""
    if code == 0:
        return
    if code == EXIT_RETRY:
        raise RetryableError(f"generator command asked for a retry (exit 75){detail}")
    if code < 0:
        raise RetryableError(f"generator command killed by signal {-code}{detail}")
    raise PermanentError(f"generator command failed with exit code {code}{detail}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def to_task(where: str, item: Any) -> TaskSpec:
    """One yielded item as a task: a TaskSpec, or a mapping of the JSON-lines form of
    `jobrunner enqueue` (key, shard_key, payload, max_attempts, limits, tokens)."""
    if isinstance(item, TaskSpec):
        return task_from_obj({k: v for k, v in {
            "key": item.key, "shard_key": item.shard_key, "payload": item.payload,
            "max_attempts": item.max_attempts,
            "limits": list(item.limits) if item.limits is not None else None,
            "tokens": item.tokens}.items() if v is not None}, where)
    task = task_from_obj(item, where)
    if task.key in validation.RESERVED_KEYS:
        raise BadInput(f"{where}: task key {task.key!r} is reserved for "
                       f"{validation.RESERVED_KEYS[task.key]}")
    return task


class _Pump(threading.Thread):
    """Pulls the user's iterator on a thread of its own into a bounded queue, so that the
    generating loop can send a waiting chunk and watch the lease while user code blocks
    (a slow query, a paged API)."""

    def __init__(self, items: Iterator[tuple[str, Any]], size: int) -> None:
        super().__init__(name="generator", daemon=True)
        self.items = items
        self.out: queue_mod.Queue[Any] = queue_mod.Queue(maxsize=max(2, size * 2))
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            for entry in self.items:
                if not self._put(entry):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the generating loop, which raises it
            self._put(exc)
        finally:
            close = getattr(self.items, "close", None)
            if close is not None and self.stop.is_set():
                try:
                    close()
                except Exception:
                    pass

    def _put(self, value: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(value, timeout=0.2)
                return True
            except queue_mod.Full:
                continue
        return False


@dataclass
class Progress:
    yielded: int = 0
    new: int = 0
    existing: int = 0
    chunks: int = 0

    def as_json(self) -> dict[str, int]:
        return {"tasks": self.yielded, "new": self.new, "existing": self.existing,
                "chunks": self.chunks}


def run(task: Task, spec: GeneratorSpec, step: Callable[[Task], Iterator[tuple[str, Any]]],
        send: Callable[[list[TaskSpec]], tuple[int, int]]) -> Progress:
    """Drive one attempt: pull items, validate each (a bad one is permanent: the same code
    yields it again), send chunks of at most chunk_size (or sooner, after FLUSH_SECONDS),
    check the lease all along. `send` enqueues one chunk and returns (new, existing)."""
    progress = Progress()
    chunk: dict[str, TaskSpec] = {}  # (a key yielded twice in a chunk: the first wins,
    # as a key yielded twice in two chunks is enqueued once)
    first_at = 0.0
    pump = _Pump(step(task), spec.chunk_size)
    pump.start()

    def flush() -> None:
        nonlocal chunk
        if not chunk:
            return
        task.check_lease()
        new, existing = send(list(chunk.values()))
        progress.new += new
        progress.existing += existing
        progress.chunks += 1
        chunk = {}

    try:
        while True:
            try:
                entry = pump.out.get(timeout=0.1)
            except queue_mod.Empty:
                task.check_lease()
                if chunk and time.monotonic() - first_at >= FLUSH_SECONDS:
                    flush()
                continue
            if entry is _END:
                break
            if isinstance(entry, BaseException):
                _flush_before_failing(flush, entry)
                raise entry
            where, item = entry
            try:
                spec_ = to_task(where, item)
            except BadInput as exc:
                error = PermanentError(str(exc))
                _flush_before_failing(flush, error)
                raise error from None
            progress.yielded += 1
            if not chunk:
                first_at = time.monotonic()
            chunk.setdefault(spec_.key, spec_)
            if len(chunk) >= spec.chunk_size or time.monotonic() - first_at >= FLUSH_SECONDS:
                flush()
        flush()
    finally:
        pump.stop.set()
    return progress


def _flush_before_failing(flush: Callable[[], None], error: BaseException) -> None:
    """The tasks yielded before an error are enqueued (kept, and a re-run finds them
    there); an error of that last chunk itself must not hide the generator's own."""
    if isinstance(error, LeaseLost):
        return
    try:
        flush()
    except Exception as exc:
        log.warning("generator failed (%s); its last chunk was not enqueued either: %s",
                    error, exc)


class WithGenerator:
    """A worker's handler: the batch's generator task runs the batch's generator (read
    from the batch when it runs); every other task goes to `handler`."""

    def __init__(self, handler: Callable[[Task], Any], dsn: str) -> None:
        self.handler = handler
        self.dsn = dsn
        self._steps: dict[str, Callable[[Task], Iterator[tuple[str, Any]]]] = {}

    def __call__(self, task: Task) -> Any:
        if task.key != GENERATE_KEY:
            return self.handler(task)
        return self.generate(task)

    @property
    def has_async(self) -> bool:
        return has_async(self.handler)

    def async_form(self, task: Task) -> Callable[[Task], Awaitable[Any]] | None:
        # (the generator enqueues on its own connection: a handler thread runs it)
        return None if task.key == GENERATE_KEY else async_form(self.handler, task)

    def _step(self, spec: GeneratorSpec) -> Callable[[Task], Iterator[tuple[str, Any]]]:
        key = json.dumps(spec.as_json(), sort_keys=True)
        if key not in self._steps:
            try:
                self._steps[key] = load(spec)
            except BadInput as exc:
                raise PermanentError(str(exc)) from None
        return self._steps[key]

    def generate(self, task: Task) -> dict[str, Any]:
        with db.connect(self.dsn, autocommit=True,
                        purpose=f"jobrunner-generate {task.worker_id}") as conn:
            st = state(conn, task.batch_id)
            if st is None or st.spec is None:
                raise PermanentError(f"batch {task.batch_id!r} has no generator")
            spec = st.spec
            step = self._step(spec)

            def send(chunk: list[TaskSpec]) -> tuple[int, int]:
                return enqueue_chunk(conn, task, chunk, spec.task_max_attempts,
                                     limits=spec.limits, tokens=spec.tokens)

            log.info("batch %s: generator %s started (attempt %d of %d)", task.batch_id,
                     spec.describe(), task.attempt, task.max_attempts)
            progress = run(task, spec, step, send)
        log.info("batch %s: generator finished: %d task(s) yielded, %d new, %d already there",
                 task.batch_id, progress.yielded, progress.new, progress.existing)
        return progress.as_json()


def enqueue_chunk(conn: psycopg.Connection, task: Task, chunk: Sequence[TaskSpec],
                  max_attempts: int, *, limits: Sequence[str] | None = None,
                  tokens: int | None = None) -> tuple[int, int]:
    """One chunk in one transaction, fenced on the generator's lease (held FOR SHARE until
    commit, so the task cannot be handed to another worker meanwhile)."""

    def attempt() -> tuple[int, int]:
        with conn.transaction():
            if not effects.fence(conn, task.id, task.attempt, task.worker_id):
                raise LeaseLost(f"generator of batch {task.batch_id!r} attempt "
                                f"{task.attempt}: lease lost; its chunk was not enqueued")
            try:
                result = Queue(conn).enqueue(task.batch_id, task.tenant_id, chunk,
                                             max_attempts=max_attempts, limits=limits,
                                             tokens=tokens)
            except BadInput as exc:
                raise PermanentError(f"generator: {exc}") from None
        return result.new, result.existing

    # (not retried here on a connection error: the attempt fails and runs again, adding
    # only what is missing)
    return attempt()


# -- state and the generator's task ---------------------------------------------------
STATES = ("Pending", "Running", "Finished", "Failed", "Cancelled")


@dataclass(frozen=True)
class GeneratorState:
    spec: GeneratorSpec | None
    task_status: str | None
    attempts: int | None
    max_attempts: int | None
    last_error: str | None
    result: Mapping[str, Any] | None

    @property
    def configured(self) -> bool:
        return self.spec is not None

    @property
    def running(self) -> bool:
        return self.task_status in ("pending", "leased")

    @property
    def failed(self) -> bool:
        return self.task_status == "dead"

    @property
    def finished(self) -> bool:
        return self.task_status == "done"

    def phase(self) -> str:
        """Pending (waiting for a worker, or for its retry), Running, Finished, Failed,
        Cancelled."""
        return {"pending": "Pending", "leased": "Running", "done": "Finished",
                "dead": "Failed", "cancelled": "Cancelled"}.get(self.task_status or "",
                                                                 "Pending")

    def describe(self) -> str:
        spec = self.spec
        name = spec.describe() if spec else "?"
        phase = self.phase()
        retry = (f"; attempt {self.attempts} of {self.max_attempts} failed: {self.last_error}"
                 if self.attempts and self.last_error and phase in ("Pending", "Running")
                 else "")
        if phase == "Pending":
            return f"generator {name} waits for a worker{retry}"
        if phase == "Running":
            return f"generator {name} is running (attempt {self.attempts}){retry}"
        if phase == "Finished":
            n = (self.result or {}).get("tasks")
            return f"generator {name} finished" + (f": {n:,} task(s) yielded"
                                                   if isinstance(n, int) else "")
        if phase == "Failed":
            return (f"generator {name} failed after {self.attempts} attempt(s): "
                    f"{self.last_error or ''}")
        return f"generator {name} was cancelled with its batch"


def status_json(st: GeneratorState | None) -> dict[str, Any] | None:
    """`jobrunner status --json`'s generator: None when the batch has none."""
    if st is None or st.spec is None:
        return None
    return {"step": st.spec.describe(), "state": st.phase(), "attempts": st.attempts,
            "error": st.last_error, "result": dict(st.result) if st.result else None}


def state(conn: psycopg.Connection, batch_id: str) -> GeneratorState | None:
    """The batch's generator and its task, lock-free (None: no such batch)."""
    with conn.transaction():
        row = generator_store.state(conn, batch_id)
    if row is None:
        return None
    raw = row["generator"]
    return GeneratorState(spec=GeneratorSpec.from_json(raw) if raw else None,
                          task_status=row["task_status"], attempts=row["attempts"],
                          max_attempts=row["max_attempts"], last_error=row["last_error"],
                          result=row["result"] if isinstance(row["result"], Mapping) else None)


def start(conn: psycopg.Connection, batch_id: str, tenant_id: str, spec: GeneratorSpec,
          reduce: dict[str, Any] | None = None) -> bool:
    """Give a batch its generator and enqueue the generator's task, once: idempotent on
    (batch, task key), so a restarted controller or a second `jobrunner run` of the same
    batch does not run it again. Returns whether the task was new."""
    validation.check_identifier(batch_id, "batch id")
    validation.check_identifier(tenant_id, "tenant id")
    with conn.transaction():
        batch = batches.ensure(conn, batch_id, tenant_id)
        if batch["tenant_id"] != tenant_id:
            raise BadInput(f"batch {batch_id!r} belongs to tenant {batch['tenant_id']!r}, "
                           f"not {tenant_id!r}")
        if batch["cancelled_at"] is not None:
            raise BadInput(f"batch {batch_id!r} was cancelled; run it under a new batch id")
        if batch["pool"] is not None:
            # (its task would need the pool's tag and its chunks the pool: a later step)
            raise BadInput(f"batch {batch_id!r} is in worker pool {batch['pool']!r}: pools do "
                           "not run generators yet (docs/pools.md)")
        if reduce is not None:
            reduce_store.set_spec(conn, batch_id, json.dumps(reduce))
        row = generator_store.enqueue(conn, batch_id, json.dumps(spec.as_json()),
                                      spec.max_attempts)
        if row is not None:
            worker_waits.wake(conn, 1, batch_id=batch_id)
    return row is not None

