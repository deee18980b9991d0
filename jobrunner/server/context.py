"""What every request of a replica shares: its settings, its database connections, and
the tenant of the key a request presents."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from psycopg_pool import ConnectionPool
from starlette.requests import Request

from jobrunner.features import model_routes
from jobrunner.server.counts import LiveCounts
from jobrunner.server.errors import APIError
from jobrunner.store import batch_api as store

HANDLER = "jobrunner.openai_batch:handle"
_DURATION = re.compile(r"^([1-9][0-9]{0,6})(s|m|h|d)$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Settings:
    dsn: str
    pool: str = "batch-api"                  # the worker pool that runs API batches
    max_file_bytes: int = 200 * 1024 * 1024  # OpenAI's limits for a batch input file
    max_file_lines: int = 50_000
    min_window_seconds: int = 60             # completion_window: 24h as OpenAI, or any
    max_window_seconds: int = 7 * 86400      # duration between these
    output_retention_seconds: float = 30 * 86400  # output and error files, as OpenAI
    input_retention_seconds: float | None = None  # uploaded files: kept until deleted
    max_attempts: int = 5                    # attempts of each request
    routes_file: str | None = None           # the model routing table (None: any model)
    sweep_seconds: float = 0.5               # how often a replica advances open batches
    db_pool_size: int = 10
    console: bool = True                     # the web console under /console (docs/console.md)
    console_min_gap: float = 1.0             # its live updates: one refresh per topic at most
    console_poll: float = 2.0                # this often, and this often while nothing notifies
    # Trusted proxy headers for the console (oauth2-proxy; docs/console.md): off by default.
    console_proxy_auth: bool = False
    console_proxy_user_header: str = "X-Forwarded-User"
    console_proxy_groups_header: str = "X-Forwarded-Groups"
    console_proxy_admin_group: str = "jobrunner-admins"
    console_secret: str | None = None        # CSRF key of proxy users (None: per process)

    def window_seconds(self, window: Any) -> int:
        match = _DURATION.match(window) if isinstance(window, str) else None
        seconds = int(match[1]) * _UNIT[match[2]] if match else 0
        if not self.min_window_seconds <= seconds <= self.max_window_seconds:
            raise APIError(400, f"Invalid completion_window {window!r}: use a duration such as "
                           f"'24h' between {self.min_window_seconds}s and "
                           f"{self.max_window_seconds}s", param="completion_window",
                           code="invalid_value")
        return seconds

    def routes(self) -> dict[str, model_routes.Route] | None:
        return model_routes.load(self.routes_file) if self.routes_file else model_routes.load()


@dataclass
class Context:
    settings: Settings
    db: ConnectionPool
    counts: LiveCounts = field(default_factory=LiveCounts)
    extra: dict[str, Any] = field(default_factory=dict)


def context(request: Request) -> Context:
    return request.app.state.context


def tenant(request: Request, conn: Any) -> str:
    """The tenant of the request's key; 401 in OpenAI's words without a live key."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, "You didn't provide an API key. You need to provide your API key "
                       "in an Authorization header using Bearer auth (i.e. Authorization: "
                       "Bearer YOUR_KEY).")
    found = store.tenant_of_key(conn, key)
    if found is None:
        # (the key itself is not repeated back: it may be a real secret sent by mistake)
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    if found == store.ALL_TENANTS:
        # An operator's console key: a batch made with it would belong to a tenant "*".
        raise APIError(401, "This key is a console operator key (tenant '*'); the Batch "
                       "API needs a key of one tenant.", code="invalid_api_key")
    return found
