"""A small OpenAI-compatible HTTP server on 127.0.0.1 for tests: real HTTP, in a thread.

It answers POST /v1/chat/completions, /v1/completions and /v1/embeddings
deterministically (the same request always gets the same body: `expected_body`), and
fails on demand: requests whose text contains a marker get the statuses planned for it
in turn, e.g. `server.fail("[flaky]", 500)` (one 500, then success),
`server.fail("[bad]", 400, times=None)` (always 400),
`server.fail("[busy]", 429, retry_after=0.2)` (with a Retry-After header),
`server.delay("[slow]", 2.0)` (answers after 2 s, once). Every request is recorded
(`server.requests`), without the Authorization header's value (`authorized` says
whether it matched the key).

    with OpenAITestServer(api_key="sk-test") as server:
        env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "sk-test"}
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CREATED = 1_700_000_000  # a fixed "created" timestamp: bodies are deterministic

_ERRORS = {
    400: ("invalid_request_error", None, "Invalid request: {marker}"),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests."),
    500: ("server_error", None, "The server had an error while processing your request."),
    503: ("server_error", None, "The engine is currently overloaded."),
}


@dataclass
class Recorded:
    path: str
    body: Any
    status: int
    authorized: bool
    headers: dict[str, str] = field(default_factory=dict)
    arrived: float = 0.0  # time.monotonic() when the request was read


@dataclass
class _Plan:
    marker: str
    status: int
    times: int | None  # None: every time
    retry_after: float | None
    delay: float = 0.0


def _text_of(body: Any) -> str:
    """The request's text: its messages, prompt or input, as one string."""
    if not isinstance(body, dict):
        return ""
    parts: list[str] = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(v for v in value if isinstance(v, str))
    return "\n".join(parts)


def _words(text: str) -> int:
    return len(text.split())


def expected_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The successful response to a request: a function of the request alone."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    text = _text_of(body)
    model = body.get("model", "test-model")
    if path.endswith("/embeddings"):
        inputs = body["input"] if isinstance(body.get("input"), list) else [body.get("input")]
        data = [{"object": "embedding", "index": i,
                 "embedding": [b / 255 for b in hashlib.sha256(str(v).encode()).digest()[:8]]}
                for i, v in enumerate(inputs)]
        tokens = sum(_words(str(v)) for v in inputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    answer = f"echo: {text[::-1]}"
    usage = {"prompt_tokens": _words(text), "completion_tokens": _words(answer),
             "total_tokens": _words(text) + _words(answer)}
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        return {"id": f"cmpl-{digest[:24]}", "object": "text_completion", "created": CREATED,
                "model": model, "choices": [{"text": answer, "index": 0, "logprobs": None,
                                             "finish_reason": "stop"}], "usage": usage}
    return {"id": f"chatcmpl-{digest[:24]}", "object": "chat.completion", "created": CREATED,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": usage}


def error_body(status: int, marker: str = "") -> dict[str, Any]:
    kind, code, message = _ERRORS.get(status, ("api_error", None, f"HTTP {status}"))
    return {"error": {"message": message.format(marker=marker), "type": kind, "param": None,
                      "code": code}}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (its timeout) closed the connection: expected, not news.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class OpenAITestServer:
    PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.requests: list[Recorded] = []
        self._plans: list[_Plan] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._thread: threading.Thread | None = None

    # -- set-up ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> OpenAITestServer:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="openai-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join(10)

    def __enter__(self) -> OpenAITestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail(self, marker: str, status: int, *, times: int | None = 1,
             retry_after: float | None = None) -> None:
        """Requests whose text contains `marker` get `status` the next `times` times
        (None: always), with a Retry-After header if given. Plans for one marker queue up
        in the order they were made."""
        with self._lock:
            self._plans.append(_Plan(marker, status, times, retry_after))

    def delay(self, marker: str, seconds: float, *, times: int | None = 1) -> None:
        """Requests whose text contains `marker` are answered (normally) after `seconds`."""
        with self._lock:
            self._plans.append(_Plan(marker, 200, times, None, seconds))

    # -- what it saw -------------------------------------------------------------------
    def count(self, marker: str = "", status: int | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if marker in _text_of(r.body)
                       and (status is None or r.status == status))

    # -- serving -----------------------------------------------------------------------
    def _planned(self, text: str) -> _Plan | None:
        with self._lock:
            for plan in self._plans:
                if plan.marker in text and plan.times != 0:
                    if plan.times is not None:
                        plan.times -= 1
                    return plan
        return None

    def _answer(self, path: str, headers: dict[str, str], raw: bytes
                ) -> tuple[int, dict[str, Any], dict[str, str]]:
        arrived = time.monotonic()
        authorized = (self.api_key is None
                      or headers.get("authorization") == f"Bearer {self.api_key}")
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = None
        status, extra, payload = 200, {}, None
        if path not in self.PATHS:
            status, payload = 404, {"error": {"message": f"Unknown path {path}",
                                              "type": "invalid_request_error", "param": None,
                                              "code": "unknown_url"}}
        elif not authorized:
            status, payload = 401, error_body(401)
        elif not isinstance(body, dict) or "model" not in body:
            status, payload = 400, {"error": {"message": "you must provide a model parameter",
                                              "type": "invalid_request_error",
                                              "param": "model", "code": None}}
        else:
            plan = self._planned(_text_of(body))
            if plan is not None and plan.delay:
                time.sleep(plan.delay)
            if plan is not None and plan.status != 200:
                status, payload = plan.status, error_body(plan.status, plan.marker)
                if plan.retry_after is not None:
                    extra["Retry-After"] = f"{plan.retry_after:g}"
            else:
                payload = expected_body(path, body)
        safe = {k: v for k, v in headers.items() if k != "authorization"}
        with self._lock:
            self.requests.append(Recorded(path, body, status, authorized, safe, arrived))
        return status, payload, extra

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, payload, extra = server._answer(self.path, headers, raw)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-request-id", f"req_{len(server.requests)}")
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test output is about the code under test

        return Handler
