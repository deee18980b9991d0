"""The OpenAI Batch file format, in and out, and a handler that runs its requests.

- In: `jobrunner enqueue --format openai-batch FILE` reads the Batch API's input lines
  (`{"custom_id", "method": "POST", "url", "body"}`) into tasks: key = custom_id,
  payload = `{"method", "url", "body"}`.
- Run: `jobrunner worker --handler jobrunner.openai_batch:handle` sends each body to
  any OpenAI-compatible endpoint (OpenAI, vLLM, llama.cpp, a gateway) and stores the
  response body as the task's result.
- Out: `jobrunner results --format openai` writes the Batch API's output file, and with
  `--errors` its error file (jobrunner/features/results.py calls output_line and error_line).

Configuration (environment of the worker): OPENAI_BASE_URL (default
https://api.openai.com/v1), OPENAI_API_KEY (optional: local servers often need none),
JOBRUNNER_OPENAI_MODEL (replaces every body's "model"), JOBRUNNER_OPENAI_TIMEOUT
(seconds a request may take, default 600) and JOBRUNNER_OPENAI_LIMIT (the name of the
flow-control limit an HTTP 429 blocks, when flow control is installed). The key is
sent in the Authorization header only: it is never logged and never part of an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import httpx

from jobrunner.features import model_routes
from jobrunner.features.model_routes import Route
from jobrunner.model.errors import BadInput, PermanentError, RateLimited
from jobrunner.model.validation import (
    MAX_KEY_CHARS,
    TaskSpec,
    check_identifier,
    json_type,
    parse_jsonl,
)
from jobrunner.observability import tracing
from jobrunner.runtime.task import Task

# The endpoints the Batch API accepts in an input file's "url".
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/moderations")
DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_TIMEOUT = 600.0
# When a 429 names no Retry-After: wait this long before the next try.
DEFAULT_RETRY_AFTER = 1.0
# Errors worth another try, as the OpenAI SDKs see them: request timeout, conflict
# (a lock held by another request), rate limited, and every server-side error.
RETRYABLE_STATUS = frozenset({408, 409, 429})
_MAX_MESSAGE = 2000

_FIELDS = ("custom_id", "method", "url", "body")


# -- in ---------------------------------------------------------------------------------
def task_from_request(obj: Any, where: str) -> TaskSpec:
    """One input line of an OpenAI batch file as a task; errors name the line."""
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: a request must be a JSON object, got {json_type(obj)}")
    unknown = set(obj) - set(_FIELDS)
    if unknown:
        raise BadInput(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; an OpenAI "
                       f"batch line has {', '.join(_FIELDS)}")
    missing = [name for name in _FIELDS if name not in obj]
    if missing:
        raise BadInput(f"{where}: missing required field(s) {', '.join(missing)}")
    key = check_identifier(obj["custom_id"], f"{where}: custom_id", max_chars=MAX_KEY_CHARS)
    if obj["method"] != "POST":
        raise BadInput(f"{where}: method must be 'POST' (the only one the Batch API "
                       f"accepts), got {obj['method']!r}")
    if obj["url"] not in ENDPOINTS:
        raise BadInput(f"{where}: url {obj['url']!r} is not a Batch API endpoint "
                       f"(one of {', '.join(ENDPOINTS)})")
    if not isinstance(obj["body"], dict):
        raise BadInput(f"{where}: body must be a JSON object, got {json_type(obj['body'])}")
    return TaskSpec(key=key, payload={"method": "POST", "url": obj["url"], "body": obj["body"]})


def parse_input(lines: Iterable[str], source: str = "input") -> list[TaskSpec]:
    """Parse an OpenAI batch input file; any bad line rejects the whole file."""
    return parse_jsonl(lines, source, to_task=task_from_request, key_name="custom_id")


# -- run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    rate_limit: str | None = None

    @classmethod
    def from_env(cls) -> Endpoint:
        timeout = os.environ.get("JOBRUNNER_OPENAI_TIMEOUT")
        return cls(base_url=(os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip("/"),
                   api_key=os.environ.get("OPENAI_API_KEY") or None,
                   model=os.environ.get("JOBRUNNER_OPENAI_MODEL") or None,
                   timeout=float(timeout) if timeout else DEFAULT_TIMEOUT,
                   rate_limit=os.environ.get("JOBRUNNER_OPENAI_LIMIT") or None)

    def url(self, path: str) -> str:
        # Base URLs carry the version by convention (OPENAI_BASE_URL=http://host:8000/v1);
        # the batch file's urls carry it too (/v1/chat/completions): say it once.
        if self.base_url.endswith("/v1") and path.startswith("/v1/"):
            path = path[len("/v1"):]
        return self.base_url + path


class OpenAIRequestError(PermanentError):
    """The endpoint refused the request itself (4xx): sending it again cannot help."""


class OpenAIServerError(Exception):
    """The endpoint failed or was busy (5xx, 408, 409, 429 without flow control): retry.
    `retry_after` is the wait the endpoint asked for, in seconds, if it said one."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


_local = threading.local()


def _client(endpoint: Endpoint) -> httpx.Client:
    # One client per handler thread (and per configuration): its connections are kept
    # alive from task to task, and no client is shared between threads.
    clients: dict[Endpoint, httpx.Client] = _local.__dict__.setdefault("clients", {})
    client = clients.get(endpoint)
    if client is None:
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        client = httpx.Client(headers=headers,
                              timeout=httpx.Timeout(endpoint.timeout, connect=10.0))
        clients[endpoint] = client
    return client


def _routed(body: dict[str, Any]) -> tuple[Endpoint, Route | None]:
    """The endpoint for the body's model from the routing table (JOBRUNNER_MODEL_ROUTES,
    jobrunner/features/model_routes.py) if one is configured, else from the environment."""
    routes = model_routes.load()
    if routes is None:
        return Endpoint.from_env(), None
    route = routes.get(body.get("model"))  # type: ignore[arg-type]
    if route is None:
        raise PermanentError(f"model {body.get('model')!r} is not in the routing table")
    default = Endpoint.from_env()
    return Endpoint(base_url=route.base_url,
                    api_key=os.environ.get(route.api_key_env) if route.api_key_env else None,
                    model=route.upstream_model, timeout=route.timeout or default.timeout,
                    rate_limit=route.limit), route


def handle(task: Task) -> Any:
    """Send the task's request; return the response body (the task's result)."""
    endpoint, route, body = _request(task)
    url = endpoint.url(task.payload["url"])
    with tracing.model_call_span(_operation(task.payload["url"]), body.get("model"),
                                 server=httpx.URL(url).host) as span:
        # Timeouts and connection errors propagate as they are: retried with backoff.
        response = _client(endpoint).post(url, json=body, headers=tracing.headers())
        _traced(span, response)
        result = _answer(endpoint, response)
        tracing.model_call_usage(span, result)
    _report_usage(task, result, route)
    return result


def _traced(span: Any, response: httpx.Response) -> None:
    if span is not None:
        span.set_attribute("http.response.status_code", response.status_code)


async def handle_async(task: Task) -> Any:
    """handle's async form: what the worker runs on its event loop, hundreds of calls in
    flight in one process (docs/scaling.md). Same request, same answers, same errors.
    aiohttp, not httpx's async client: httpx's connection pool costs O(connections) per
    request (measured: 20 ms of CPU per call at 200 in flight, aiohttp 0.4 ms)."""
    endpoint, route, body = _request(task)
    url = endpoint.url(task.payload["url"])
    with tracing.model_call_span(_operation(task.payload["url"]), body.get("model"),
                                 server=httpx.URL(url).host) as span:
        # Timeouts and connection errors propagate as they are: retried with backoff.
        try:
            async with _session(endpoint).post(url, json=body,
                                               headers=tracing.headers()) as got:
                response = httpx.Response(got.status, headers=list(got.headers.items()),
                                          content=await got.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc) from exc
        _traced(span, response)
        result = _answer(endpoint, response)
        tracing.model_call_usage(span, result)
    if isinstance(result, dict) and isinstance(result.get("usage"), dict):
        # (report_usage writes in its own transaction: not on the event loop)
        await asyncio.to_thread(_report_usage, task, result, route)
    return result


handle.asynchronous = handle_async  # type: ignore[attr-defined]  (see PythonHandler)


def _request(task: Task) -> tuple[Endpoint, Route | None, dict[str, Any]]:
    body = dict(task.payload["body"])
    endpoint, route = _routed(body)
    if endpoint.model:
        body["model"] = endpoint.model
    task.check_lease()
    return endpoint, route, body


def _answer(endpoint: Endpoint, response: httpx.Response) -> Any:
    """The response body of a successful call; the error a failed one means."""
    if response.is_success:
        try:
            return response.json()
        except ValueError:
            raise OpenAIServerError(f"HTTP {response.status_code}: the response body is "
                                    "not JSON") from None
    status = response.status_code
    code, message = _api_error(response)
    text = error_text(status, code, message)
    if status == 429:
        retry_after = _retry_after(response)
        # No attempt used; the limit (by default every limit the task names) waits.
        raise RateLimited(retry_after=retry_after or DEFAULT_RETRY_AFTER,
                          limit=endpoint.rate_limit, message=text)
    if status >= 500 or status in RETRYABLE_STATUS:
        raise OpenAIServerError(text, _retry_after(response))
    raise OpenAIRequestError(text)


def _operation(path: str) -> str:
    """The gen_ai.operation.name of a request's endpoint."""
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/embeddings"):
        return "embeddings"
    if path.endswith("/completions"):
        return "text_completion"
    return path.rsplit("/", 1)[-1] or "request"


def _as_httpx(exc: BaseException) -> httpx.TransportError:
    """aiohttp's transport errors as the sync form's (httpx's): the same last_error, so the
    error file says the same whichever form ran (e.g. `ReadTimeout: timed out`)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout("timed out")
    if isinstance(exc, TimeoutError):  # (aiohttp's ServerTimeoutError is one too)
        return httpx.ReadTimeout("timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc))
    return httpx.NetworkError(str(exc) or type(exc).__name__)


# One session per event loop and configuration (a session belongs to its loop); no limit
# on its connections: the worker's concurrency is the limit.
_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                     dict[Endpoint, aiohttp.ClientSession]] = \
    weakref.WeakKeyDictionary()


def _session(endpoint: Endpoint) -> aiohttp.ClientSession:
    sessions = _sessions.setdefault(asyncio.get_running_loop(), {})
    session = sessions.get(endpoint)
    if session is None or session.closed:
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=endpoint.timeout, connect=10.0))
        sessions[endpoint] = session
    return session


def _api_error(response: httpx.Response) -> tuple[str | None, str]:
    """The API's error code (or type) and message, from its usual error body
    `{"error": {"message", "type", "param", "code"}}`, else the body's text."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        code = error.get("code") or error.get("type")
        return (str(code) if code else None), str(error["message"])[:_MAX_MESSAGE]
    text = " ".join(response.text.split())[:_MAX_MESSAGE]
    return None, text or response.reason_phrase or "no message"


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from retry-after-ms (OpenAI's) or Retry-After (seconds or an HTTP date)."""
    millis = response.headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    date = response.headers.get("date")
    try:
        now = parsedate_to_datetime(date) if date else None
    except (TypeError, ValueError):
        now = None
    if now is None:
        now = datetime.now(UTC)
    return max(0.0, (when - now).total_seconds())


def _report_usage(task: Task, body: Any, route: Route | None = None) -> None:
    """Tell flow control what the call used, when the task can take it."""
    report = getattr(task, "report_usage", None)
    usage = body.get("usage") if isinstance(body, dict) else None
    if not callable(report) or not isinstance(usage, dict):
        return
    # chat/completions and embeddings say prompt/completion, the Responses API input/output
    counts = {"input_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
              "output_tokens": usage.get("completion_tokens", usage.get("output_tokens")),
              "tokens": usage.get("total_tokens")}
    counts = {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)}
    if "tokens" not in counts and counts:
        counts["tokens"] = sum(counts.values())
    if counts and route is not None:
        counts["cost"] = route.cost(counts.get("input_tokens", 0), counts.get("output_tokens", 0))
    if counts:
        report(**counts)


# -- out --------------------------------------------------------------------------------
def error_text(status: int, code: str | None, message: str) -> str:
    """An HTTP error as a task's error message; error_line reads it back."""
    return f"HTTP {status} {code or f'http_{status}'}: {message}"


# last_error is "<exception type>: <message> (at <file>:<line>)" (jobrunner/worker/executor.py).
_HTTP_ERROR = re.compile(r"^\w+: HTTP \d{3} (?P<code>\S+): (?P<message>.*?)"
                         r"(?: \(at [^()]*:\d+\))?$", re.DOTALL)
_PLAIN_ERROR = re.compile(r"^(?P<code>[A-Za-z_]\w*): (?P<message>.*?)(?: \(at [^()]*:\d+\))?$",
                          re.DOTALL)
_CANCELLED = ("batch_cancelled", "This request was not executed: the batch was cancelled.")


def error_of(status: str, last_error: str | None) -> tuple[str, str]:
    """The (code, message) of a task without a result, as an error file states it: the
    API's own code for a request the endpoint refused; `lease_expired` when the workers
    running it kept dying; else the exception's type (e.g. ReadTimeout) after the last
    attempt; `batch_cancelled` for a task the batch's cancellation stopped."""
    if status == "cancelled":
        return _CANCELLED
    text = last_error or "failed without an error message"
    if text.startswith("lease expired:"):
        return "lease_expired", text
    for pattern in (_HTTP_ERROR, _PLAIN_ERROR):
        match = pattern.match(text)
        if match:
            return match["code"], match["message"]
    return "task_failed", text


def _ids(batch_id: str, key: str) -> tuple[str, str]:
    # The line id and the request id, both derived from (batch, custom_id): the same in
    # every export of the batch. (The endpoint's own request id is not kept: a task's
    # result is the response body.)
    digest = hashlib.blake2b(f"{batch_id}\n{key}".encode(), digest_size=24).hexdigest()
    return f"batch_req_{digest[:24]}", f"req_{digest[24:]}"


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def output_line(batch_id: str, key: str, result_json: str | None) -> str:
    """One line of the output file; `result_json` (the stored body, as JSON text) goes
    through without being decoded."""
    line_id, request_id = _ids(batch_id, key)
    return (f'{{"id":"{line_id}","custom_id":{_dumps(key)},'
            f'"response":{{"status_code":200,"request_id":"{request_id}",'
            f'"body":{result_json or "null"}}},"error":null}}')


def error_line(batch_id: str, key: str, status: str, last_error: str | None) -> str:
    """One line of the error file."""
    code, message = error_of(status, last_error)
    return _dumps({"id": _ids(batch_id, key)[0], "custom_id": key, "response": None,
                   "error": {"code": code, "message": message}})
