"""The controller's Kubernetes API client: a thin synchronous layer over httpx.

Why not the `kubernetes` package: it is 22 MB of the image (its generated models and
their dependencies) for about a dozen calls, and kopf already logs in and talks to the
API without it. Bodies and results here are the API's own JSON (plain dicts, camelCase).

One `httpx.Client` for the whole process: a new client per call would mean a new
connection pool and a TLS handshake each time (with 100 BatchRuns refreshed every few
seconds that handshake was most of the controller's CPU, bench, controller stage).
httpx's pool is thread-safe, so kopf's handler threads share it.

Credentials come from kopf's login (`remember_login`, called by the `@kopf.on.login`
handler in handlers.py), so kopf's watches and these calls use the same identity. A
process that never ran kopf's login (a test, a script) logs in the same way on first use.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any
from urllib.parse import quote

import httpx
import kopf

POOL_SIZE = 32
CONNECT_RETRIES = 3
# Every call is bounded: a hung API server must not hold a kopf handler thread forever.
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Projected service account tokens rotate (about hourly); client-go re-reads the file
# every minute, and so does this client. A 401 re-reads it at once (kopf re-logs in then).
TOKEN_REREAD_SECONDS = 60.0

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    """An API request the server refused: HTTP `status`, its `reason` phrase and the
    API's own Status `message` (which field it objected to), if it sent one."""

    def __init__(self, status: int, reason: str, message: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if message
                         else f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message

    @classmethod
    def from_body(cls, status: int, reason: str, body: str | bytes | None) -> ApiError:
        """The error of a response: the message of the Status object in its body, if any."""
        try:
            message = json.loads(body or "").get("message")
        except (TypeError, ValueError, AttributeError):
            message = None
        return cls(status, reason, str(message) if message else "")


def in_cluster_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account, at the address the kubelet puts in the pod's env (as
    client-go's InClusterConfig does). kopf's own `login_with_service_account` assumes
    https://kubernetes.default.svc, which a pod on the host network may not resolve."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
        "KUBERNETES_SERVICE_PORT")
    token_path = os.path.join(SA_DIR, "token")
    if not host or not port or not os.path.exists(token_path):
        return kopf.login_with_service_account(**kwargs)
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    ca_path = os.path.join(SA_DIR, "ca.crt")
    namespace = None
    if os.path.exists(os.path.join(SA_DIR, "namespace")):
        with open(os.path.join(SA_DIR, "namespace"), encoding="utf-8") as f:
            namespace = f.read().strip() or None
    return kopf.ConnectionInfo(
        server=f"https://{host}:{port}",
        ca_path=ca_path if os.path.exists(ca_path) else None,
        token=_read_token(token_path),
        default_namespace=namespace,
        priority=30,  # above kopf's service account (10) and kubeconfig (20) logins
    )


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod its service account, else the kubeconfig ($KUBECONFIG, ~/.kube/config)."""
    kwargs.setdefault("settings", kopf.OperatorSettings())
    return in_cluster_login(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _read_token(path: str) -> str | None:
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def _sa_token_path(token: str | None) -> str | None:
    """The service account's token file if `token` was read from it."""
    path = os.path.join(SA_DIR, "token")
    try:
        return path if token and _read_token(path) == token else None
    except OSError:
        return None


class _Connection:
    """The httpx client of one ConnectionInfo, and its (re-read) bearer token."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.info = info
        # The token of the pod's service account: its file is re-read as it rotates.
        self.token_path = _sa_token_path(info.token)
        self.token = info.token
        self.token_read = time.monotonic()
        self._token_lock = threading.Lock()
        auth = (httpx.BasicAuth(info.username, info.password)
                if info.username and info.password else None)
        # kopf's own SSL context: the CA (path or data), the client certificate and key
        # (data go to 0600 temporary files only while the context loads them), insecure.
        # Failed connects are retried (a restarting API server), as urllib3 did for the
        # kubernetes client; a request that was sent is never repeated here.
        transport = httpx.HTTPTransport(
            verify=info.as_ssl_context(), proxy=info.proxy_url, trust_env=info.trust_env,
            retries=CONNECT_RETRIES,
            limits=httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE))
        self.client = httpx.Client(base_url=info.server.rstrip("/"), transport=transport,
                                   auth=auth, timeout=TIMEOUT, trust_env=info.trust_env)

    def headers(self, *, reread: bool = False) -> dict[str, str]:
        if self.token_path and (reread or time.monotonic() - self.token_read
                                > TOKEN_REREAD_SECONDS):
            with self._token_lock:
                try:
                    self.token = _read_token(self.token_path) or self.token
                except OSError:
                    pass  # keep the last token: the file is swapped atomically by a symlink
                self.token_read = time.monotonic()
        if self.info.username and self.info.password:
            return {}
        if self.token:
            return {"Authorization": f"{self.info.scheme or 'Bearer'} {self.token}"}
        return {"Authorization": self.info.scheme} if self.info.scheme else {}


_lock = threading.Lock()
_info: kopf.ConnectionInfo | None = None
_conn: _Connection | None = None


def remember_login(info: kopf.ConnectionInfo | None) -> None:
    """The credentials kopf logged in with: the next call uses them (a re-login after a
    401 replaces the client)."""
    global _info
    with _lock:
        _info = info


def _connection() -> _Connection:
    global _conn, _info
    with _lock:
        if _info is None:
            _info = login()
            if _info is None:
                raise kopf.LoginError("no Kubernetes credentials: neither a service account "
                                      "nor a kubeconfig")
        # A re-login that changed nothing keeps the pool; a changed one replaces it (the
        # old client is left to the garbage collector: other threads may still use it).
        if _conn is None or _conn.info != _info:
            _conn = _Connection(_info)
        return _conn


def request(method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
            content_type: str = JSON) -> dict[str, Any]:
    """One API call; the response's JSON, or ApiError."""
    conn = _connection()
    headers = {"Accept": JSON}
    content = None
    if body is not None:
        headers["Content-Type"] = content_type
        content = json.dumps(body).encode()
    query = {k: v for k, v in (params or {}).items() if v is not None}
    for attempt in (0, 1):
        response = conn.client.request(method, path, content=content, params=query,
                                       headers={**headers, **conn.headers(reread=attempt > 0)})
        # A rotated token: re-read once and retry (the request was refused, not applied).
        if response.status_code != 401 or not conn.token_path or attempt:
            break
    if response.status_code >= 400:
        raise ApiError.from_body(response.status_code, response.reason_phrase, response.text)
    return response.json()


def _ns(namespace: str, plural: str, name: str | None = None, *, group: str = "",
        version: str = "v1", sub: str | None = None) -> str:
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    path = f"{base}/namespaces/{quote(namespace, safe='')}/{plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    return f"{path}/{sub}" if sub else path


# ------------------------------------------------------------------ core/v1
def list_pods(namespace: str, label_selector: str) -> list[dict[str, Any]]:
    found = request("GET", _ns(namespace, "pods"), params={"labelSelector": label_selector})
    return found.get("items") or []


def read_secret(namespace: str, name: str) -> dict[str, Any]:
    return request("GET", _ns(namespace, "secrets", name))


def read_config_map(namespace: str, name: str) -> dict[str, Any]:
    return request("GET", _ns(namespace, "configmaps", name))


# ------------------------------------------------------------------ batch/v1 Job
def read_job(namespace: str, name: str) -> dict[str, Any]:
    return request("GET", _ns(namespace, "jobs", name, group="batch"))


def create_job(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    return request("POST", _ns(namespace, "jobs", group="batch"), body=body)


def patch_job(namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge patch (what the kubernetes client sent for a dict body)."""
    return request("PATCH", _ns(namespace, "jobs", name, group="batch"), body=patch,
                   content_type=STRATEGIC_MERGE_PATCH)


# ------------------------------------------------------------------ apps/v1 Deployment
def read_deployment(namespace: str, name: str) -> dict[str, Any]:
    return request("GET", _ns(namespace, "deployments", name, group="apps"))


def create_deployment(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    return request("POST", _ns(namespace, "deployments", group="apps"), body=body)


def json_patch_deployment(namespace: str, name: str, ops: list[dict[str, Any]]
                          ) -> dict[str, Any]:
    """A JSON patch (RFC 6902): lists are replaced, not merged."""
    return request("PATCH", _ns(namespace, "deployments", name, group="apps"), body=ops,
                   content_type=JSON_PATCH)


# ------------------------------------------------------------------ rbac.authorization.k8s.io
def read_role_binding(namespace: str, name: str) -> dict[str, Any]:
    return request("GET", _ns(namespace, "rolebindings", name,
                              group="rbac.authorization.k8s.io"))


def patch_role_binding(namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (its metadata: the controller only ever changes finalizers)."""
    return request("PATCH", _ns(namespace, "rolebindings", name,
                                group="rbac.authorization.k8s.io"),
                   body=patch, content_type=MERGE_PATCH)


# ------------------------------------------------------------------ custom objects
def get_custom(group: str, version: str, namespace: str, plural: str, name: str
               ) -> dict[str, Any]:
    return request("GET", _ns(namespace, plural, name, group=group, version=version))


def list_custom(group: str, version: str, namespace: str, plural: str, *,
                label_selector: str | None = None) -> dict[str, Any]:
    return request("GET", _ns(namespace, plural, group=group, version=version),
                   params={"labelSelector": label_selector})


def create_custom(group: str, version: str, namespace: str, plural: str, body: dict[str, Any],
                  *, dry_run: bool = False) -> dict[str, Any]:
    return request("POST", _ns(namespace, plural, group=group, version=version), body=body,
                   params={"dryRun": "All" if dry_run else None})


def delete_custom(group: str, version: str, namespace: str, plural: str, name: str, *,
                  propagation_policy: str, uid: str | None = None) -> dict[str, Any]:
    """Delete with a propagation policy; with `uid`, only that incarnation (409 if the
    name now belongs to another object)."""
    options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions",
                               "propagationPolicy": propagation_policy}
    if uid:
        options["preconditions"] = {"uid": uid}
    return request("DELETE", _ns(namespace, plural, name, group=group, version=version),
                   body=options)


def patch_custom(group: str, version: str, namespace: str, plural: str, name: str,
                 patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of a custom object (its spec or metadata)."""
    return request("PATCH", _ns(namespace, plural, name, group=group, version=version),
                   body=patch, content_type=MERGE_PATCH)


def patch_custom_status(group: str, version: str, namespace: str, plural: str, name: str,
                        patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of the status subresource (custom resources have no strategic
    merge)."""
    return request("PATCH", _ns(namespace, plural, name, group=group, version=version,
                                sub="status"), body=patch, content_type=MERGE_PATCH)


def plain(value: Any) -> Any:
    """kopf's body, spec and status views (and the lists in them) as plain dicts and lists,
    for the parsers and for status patches."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
