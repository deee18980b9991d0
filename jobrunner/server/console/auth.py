"""Who is looking: the API key a request presents (`Authorization: Bearer`, or the
cookie the login form sets), its tenant and its console role; and the CSRF check every
action passes.

- Read-only by default: a key's role is 'read' unless made 'admin'
  (`jobrunner api-key create --role admin`). A key sees its own tenant's batches; a key
  of tenant '*' sees every tenant's.
- The cookie holds the key itself (HttpOnly, Secure, SameSite=Strict, path /console):
  every request looks the key up again, as the Batch API does, so a revoked key stops at
  once on every replica, and no session state lives in a replica.
- A trusted proxy (ProxyAuth, off by default) may say who the user is in headers, as
  oauth2-proxy does; its users see every tenant, and are admins in the admin group.
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
    # A trusted proxy's user has no key: its token is an HMAC of its name under the
    # server's console secret instead.
    secret: bytes | None = None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def scope(self) -> str | None:
        """The tenant whose batches this viewer sees; None: every tenant."""
        return None if self.tenant_id == keys.ALL_TENANTS else self.tenant_id

    @property
    def csrf(self) -> str:
        if self.secret is not None:
            return hmac.new(self.secret, _CSRF_LABEL + b"\0" + self.key.encode(),
                            hashlib.sha256).hexdigest()
        return hmac.new(self.key.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ProxyAuth:
    """Trusted proxy headers (oauth2-proxy's X-Forwarded-User and X-Forwarded-Groups).
    Off by default; when off the headers are ignored, whoever sends them. Turn it on only
    when every request reaches the server through the proxy, which sets (and overwrites)
    the headers: anyone who can reach the server directly could send them."""

    enabled: bool = False
    user_header: str = "X-Forwarded-User"
    groups_header: str = "X-Forwarded-Groups"
    admin_group: str = "jobrunner-admins"
    secret: bytes = b""  # the CSRF tokens' key for proxy users (shared by the replicas)

    def viewer(self, request: Request) -> Viewer | None:
        if not self.enabled:
            return None
        user = request.headers.get(self.user_header, "").strip()
        if not user:
            return None
        groups = {g.strip() for g in request.headers.get(self.groups_header, "").split(",")}
        role = "admin" if self.admin_group and self.admin_group in groups else "read"
        # A proxy's user is an operator: it sees every tenant, as a key of tenant '*'.
        return Viewer(f"proxy:{user}"[:200], keys.ALL_TENANTS, role, user, self.secret)


def presented_key(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or None


def viewer(request: Request, conn: Any, proxy: ProxyAuth | None = None) -> Viewer | None:
    """The request's key's viewer; without a key, the trusted proxy's user (if that is
    turned on)."""
    key = presented_key(request)
    if not key:
        return proxy.viewer(request) if proxy is not None else None
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
