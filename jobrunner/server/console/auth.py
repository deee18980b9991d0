"""Who is looking: the API key a request presents (`Authorization: Bearer`, or the
cookie the login form sets), its tenant and its console role; and the CSRF check every
action passes.

- Read-only by default: a key's role is 'read' unless made 'admin'
  (`jobrunner api-key create --role admin`). A key sees its own tenant's batches; a key
  of tenant '*' sees every tenant's.
- The cookie holds the key itself (HttpOnly, Secure, SameSite=Strict, path /console):
  every request looks the key up again, as the Batch API does, so a revoked key stops at
  once on every replica, and no session state lives in a replica.
- CSRF: every form carries a token derived from the key (an HMAC of a fixed label under
  the key), which a page of another site cannot know; it is checked in constant time,
  and a request whose Origin is another site is refused before that. SameSite=Strict
  already keeps the cookie off cross-site requests: these are two more locks, not the
  only one.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from jobrunner.store import batch_api as keys

COOKIE = "jobrunner_console"
_CSRF_LABEL = b"jobrunner console csrf v1"


class ConsoleError(Exception):
    """An error page of the console (HTML, not the Batch API's JSON errors)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Viewer:
    key_id: str
    tenant_id: str
    role: str
    key: str  # the presented key: only to derive the CSRF token, never rendered

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def scope(self) -> str | None:
        """The tenant whose batches this viewer sees; None: every tenant."""
        return None if self.tenant_id == keys.ALL_TENANTS else self.tenant_id

    @property
    def csrf(self) -> str:
        return hmac.new(self.key.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def presented_key(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or None


def viewer(request: Request, conn: Any) -> Viewer | None:
    key = presented_key(request)
    if not key:
        return None
    row = keys.find_key(conn, key)
    if row is None:
        return None
    return Viewer(row["key_id"], row["tenant_id"], row["role"], key)


def check_csrf(request: Request, who: Viewer, token: Any) -> None:
    """Refuse (403) an action without this viewer's token, or sent from another site."""
    origin = request.headers.get("origin")
    if origin:  # ("null", a sandboxed frame's, is another site too)
        expected = f"{request.url.scheme}://{request.headers.get('host', '')}"
        if origin != expected:
            raise ConsoleError(403, "Refused: this action was sent from another site.")
    if not isinstance(token, str) or not hmac.compare_digest(token, who.csrf):
        raise ConsoleError(403, "Refused: the form's CSRF token is missing or wrong. "
                           "Reload the page and try again.")


def require_admin(who: Viewer) -> None:
    if not who.admin:
        raise ConsoleError(403, "Refused: this key's console role is read; actions need "
                           "an admin key (jobrunner api-key create --role admin).")
