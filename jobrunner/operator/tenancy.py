"""Tenants bound to namespaces: which tenants a namespace's BatchRuns may name.

The chart's ValidatingAdmissionPolicy refuses a foreign tenant at apply time; this is the
same rule in the controller, for clusters where the policy is not installed (older than
Kubernetes 1.30, or the policy left out of the chart): such a run fails before anything
is enqueued. Both read the same inputs: the namespace's own name, its annotation
`jobrunner.dev/tenants` ("a,b", or "*" for any; only those who may edit namespaces can
set it) and the chart value tenancy.allowedTenants ({namespace: [tenant, ...]}).
"""

from __future__ import annotations

from urllib.parse import quote

from jobrunner.operator import kube

ANNOTATION = "jobrunner.dev/tenants"


def allowed_tenants(namespace: str, annotations: dict[str, str],
                    extra: dict[str, list[str]]) -> set[str]:
    """The tenants `namespace` may name ("*" in the set: any)."""
    listed = annotations.get(ANNOTATION, "")
    return ({namespace} | {t.strip() for t in listed.split(",") if t.strip()}
            | set(extra.get(namespace, ())))


def refusal(namespace: str, tenant: str, annotations: dict[str, str],
            extra: dict[str, list[str]]) -> str | None:
    """Why `tenant` may not be named in `namespace`, or None if it may."""
    allowed = allowed_tenants(namespace, annotations, extra)
    if tenant in allowed or "*" in allowed:
        return None
    return (f"tenant {tenant!r} is not allowed in namespace {namespace!r} (allowed: "
            f"{', '.join(sorted(allowed))}); a cluster admin allows more with the namespace "
            f"annotation {ANNOTATION} or the chart value tenancy.allowedTenants")


def check(namespace: str, tenant: str, extra: dict[str, list[str]]) -> str | None:
    """`refusal` with the namespace's annotations read from the API server. A Role in the
    namespace may grant `get` on that one Namespace object (the API server files a request
    for namespace X under namespace X), so namespaced RBAC suffices."""
    if tenant == namespace or "*" in extra.get(namespace, ()) or tenant in extra.get(
            namespace, ()):
        return None
    ns = kube.request("GET", f"/api/v1/namespaces/{quote(namespace, safe='')}")
    annotations = (ns.get("metadata") or {}).get("annotations") or {}
    return refusal(namespace, tenant, annotations, extra)
