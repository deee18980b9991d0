"""Handlers: a Python callable (`module:function`, sync or async) or a shell command.

Contract for Python handlers: receive a Task, return a JSON-serialisable result (stored
on the task), raise to retry with backoff, raise PermanentError to go to dead at once.

Contract for command handlers: the payload arrives as JSON on stdin, the task fields
in JOBRUNNER_TASK_* environment variables; stdout (JSON if it parses, else text) is the
result. Exit 0 = done, exit 75 (EX_TEMPFAIL) = retry with backoff, exit 76 = rate limited
(like raising RateLimited), any other exit code = permanent failure (dead), killed by a
signal = retry (a crash, e.g. out of memory). Usage and rate-limit details go as JSON
lines to the file named by $JOBRUNNER_USAGE_FILE (see jobrunner/store/flowcontrol.py,
read_usage_file): {"input_tokens": 812, "output_tokens": 95, "cost": 0.0012} per call
(like task.report_usage), {"retry_after": 20, "limit": "openai"} before exit 76.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import IO, Any

from jobrunner.model.errors import BadInput, LeaseLost, PermanentError, RateLimited
from jobrunner.model.usage import EXIT_RATE_LIMITED, USAGE_FILE_ENV, read_usage_file
from jobrunner.observability import tracing
from jobrunner.runtime.task import Task

EXIT_RETRY = 75
_POLL = 0.05


class RetryableError(Exception):
    pass


@contextlib.contextmanager
def importable(paths: Sequence[str]) -> Iterator[None]:
    """`paths` on sys.path for the block (those not there already), then taken off: a
    step is loaded once, as a worker would, to refuse a bad one before anything is
    written."""
    added = [p for p in paths if p and p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)


def load_callable(spec: str) -> Callable[[Task], Any]:
    """Import `package.module:function`; errors say exactly what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(f"handler {spec!r} must look like 'package.module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise BadInput(f"handler {spec!r}: cannot import module {module_name!r}: "
                       f"{type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise BadInput(f"handler {spec!r}: module {module_name!r} has no attribute "
                           f"{attr!r}") from None
    if not callable(target):
        raise BadInput(f"handler {spec!r} is not callable")
    return target


def async_form(handler: Any, task: Task) -> Callable[[Task], Awaitable[Any]] | None:
    """The coroutine function that runs `task` on the worker's event loop, or None: the
    task runs on a handler thread (sync handlers, commands, a batch's reduce and
    generator tasks). Wrappers (WithReduce, WithGenerator, PoolHandlers) answer for the
    task by the same method."""
    form = getattr(handler, "async_form", None)
    return form(task) if form is not None else None


def has_async(handler: Any) -> bool:
    """Whether any task may run on the event loop (the worker then refills free slots
    with one claim instead of chaining a claim per handler thread)."""
    return bool(getattr(handler, "has_async", False))


class PythonHandler:
    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = load_callable(spec)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        # A sync handler may carry its own async form (`fn.asynchronous`, e.g. the
        # OpenAI-compatible handler): the worker runs that one on its event loop.
        native = getattr(self.fn, "asynchronous", None)
        self.async_fn: Callable[[Task], Awaitable[Any]] | None = (
            self.fn if self.is_async
            else native if inspect.iscoroutinefunction(native) else None)
        self.has_async = self.async_fn is not None

    def async_form(self, task: Task) -> Callable[[Task], Awaitable[Any]] | None:
        return self.async_fn

    def __call__(self, task: Task, *args: Any) -> Any:
        # (args: what a reduce step gets after the task, its results; see reduce.py)
        if not self.is_async:
            return self.fn(task, *args)
        return asyncio.run(self._run_async(task, *args))

    async def _run_async(self, task: Task, *args: Any) -> Any:
        # An async handler can really be stopped: cancel it when the lease is lost.
        job = asyncio.ensure_future(self.fn(task, *args))
        while not job.done():
            if task.lease_lost.is_set():
                job.cancel()
                try:
                    await job
                except asyncio.CancelledError:
                    pass
                raise LeaseLost(f"task {task.key!r}: lease lost, handler cancelled")
            await asyncio.wait({job}, timeout=_POLL)
        return job.result()


class CommandHandler:
    def __init__(self, command: str | list[str]) -> None:
        if isinstance(command, str):
            if not command.strip():
                raise BadInput("--handler-cmd must not be empty")
            self.argv = ["/bin/sh", "-c", command]
        else:
            if not command:
                raise BadInput("command must not be empty")
            self.argv = list(command)
        self.spec = " ".join(self.argv)

    def __call__(self, task: Task, feed: Callable[[IO[bytes]], None] | None = None) -> Any:
        """Run the command for one task. `feed` writes its standard input instead of the
        payload (a reduce step streams its results): on a thread of its own, so that a
        command that reads slowly, or not at all, never keeps the lease from being
        watched; a command that exits without reading everything just ends the feed."""
        env = dict(os.environ)
        env.update({
            "JOBRUNNER_TASK_ID": str(task.id),
            "JOBRUNNER_TASK_KEY": task.key,
            "JOBRUNNER_BATCH_ID": task.batch_id,
            "JOBRUNNER_TENANT_ID": task.tenant_id,
            "JOBRUNNER_SHARD_KEY": task.shard_key or "",
            "JOBRUNNER_ATTEMPT": str(task.attempt),
            "JOBRUNNER_WORKER_ID": task.worker_id,
            "JOBRUNNER_IDEMPOTENCY_KEY": task.idempotency_key(),
        })
        env.pop("JOBRUNNER_DATABASE_URL", None)  # the command gets the task, not the queue
        # The attempt's trace context, as OpenTelemetry's environment carrier names it
        # (TRACEPARENT, TRACESTATE, BAGGAGE): a traced command continues the attempt's trace.
        env.update({name.upper(): value for name, value in tracing.headers().items()})
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                _usage_file() as usage_path:
            env[USAGE_FILE_ENV] = usage_path
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    env=env, start_new_session=True)
            assert proc.stdin is not None
            feeder = None
            if feed is None:
                try:
                    proc.stdin.write(json.dumps(task.payload).encode())
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
            else:
                feeder = _Feeder(proc.stdin, feed)
                feeder.start()
            try:
                while proc.poll() is None:
                    if task.lease_lost.is_set():
                        _kill_group(proc)
                        raise LeaseLost(f"task {task.key!r}: lease lost, command killed")
                    time.sleep(_POLL)
            finally:
                if feeder is not None:
                    feeder.finish()
            out.seek(0)
            err.seek(0)
            stdout = out.read(1024 * 1024).decode(errors="replace")
            stderr_tail = err.read()[-2000:].decode(errors="replace").strip()
            reports, throttled = read_usage_file(_read_text(usage_path))
        code = proc.returncode
        for report in reports:  # usage is real whatever the exit code says
            task.report_usage(tokens=report.tokens, input_tokens=report.input_tokens,
                              output_tokens=report.output_tokens, cost=report.cost)
        if code == 0:
            try:
                return json.loads(stdout) if stdout.strip() else None
            except ValueError:
                return {"stdout": stdout}
        detail = f": {stderr_tail}" if stderr_tail else ""
        if code == EXIT_RETRY:
            raise RetryableError(f"command asked for a retry (exit 75){detail}")
        if code == EXIT_RATE_LIMITED:
            exc = throttled or RateLimited()
            raise RateLimited(exc.retry_after, exc.limit,
                              f"command was rate limited (exit 76): {exc}{detail}")
        if code < 0:
            raise RetryableError(f"command killed by signal {-code}{detail}")
        raise PermanentError(f"command failed with exit code {code}{detail}")


class _Feeder(threading.Thread):
    """Writes a command's standard input from `feed`; the pipe's end (the command exited
    or was killed) ends it quietly. An error of the feed itself is raised by finish()."""

    def __init__(self, pipe: IO[bytes], feed: Callable[[IO[bytes]], None]) -> None:
        super().__init__(name="command-stdin", daemon=True)
        self.pipe, self.feed = pipe, feed
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.feed(self.pipe)
        except (BrokenPipeError, ValueError):  # (ValueError: the pipe was closed under it)
            pass
        except BaseException as exc:
            self.error = exc
        finally:
            with contextlib.suppress(OSError, ValueError):
                self.pipe.close()

    def finish(self) -> None:
        # The command is gone, so a write in progress fails with EPIPE and the thread
        # ends; unless a process it left behind still holds its stdin open: then the
        # feed is abandoned (a daemon thread) rather than the task held up.
        self.join(10)
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def _usage_file() -> Iterator[str]:
    """A fresh, empty file for the command's usage lines, removed afterwards (even if the
    command removed or replaced it)."""
    fd, path = tempfile.mkstemp(prefix="jobrunner-usage-", suffix=".jsonl")
    os.close(fd)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_text(path: str, limit: int = 1024 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def make_handler(handler: str | None, handler_cmd: str | list[str] | None) -> Callable[[Task], Any]:
    if handler and handler_cmd:
        raise BadInput("give either a handler (module:function) or a command, not both")
    if handler_cmd:
        return CommandHandler(handler_cmd)
    if handler:
        return PythonHandler(handler)
    raise BadInput("a handler is required: --handler MODULE:FUNC or --handler-cmd CMD")
