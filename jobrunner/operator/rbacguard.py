"""The controller's access to a watched namespace outlives what it must finalize there.

With namespaced RBAC (chart value watch.namespaces) the controller's permissions in a
watched namespace other than its own come from a RoleBinding in that namespace (bound to
a ClusterRole: the namespace cannot take a cluster-scoped role with it). Deleting the
namespace deletes that binding with everything else, in an order the namespace
controller picks; a binding gone before the BatchRuns' finalizers ran leaves the
controller locked out, the finalizers never removed and the namespace Terminating for
good (issue 29; docs/operator.md, "Deleting a watched namespace").

So the chart puts the finalizer `jobrunner.dev/controller-access` on that binding: the
namespace controller cannot delete it, only mark it, and the binding keeps granting
while it is marked. This module drops that finalizer once the binding is being deleted
and no BatchRun, WorkerPool or BatchRunSchedule of the namespace still carries the
controller's own finalizer (not merely: none is being deleted; every one carries it from
its first handling, so a binding marked before them is kept until they are marked too,
finalized and gone). The binding goes last, the namespace right after it.

A controller that is down when the namespace is deleted finishes the job when it is
back: the binding still grants. `helm uninstall` drops the finalizer in a pre-delete hook
(`jobrunner-controller --release-rbac-guard`, `release_all`), since the controller is
deleted before its bindings.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx

from jobrunner.operator import kube
from jobrunner.operator.config import (
    FINALIZER,
    GROUP,
    PLURAL,
    POOL_PLURAL,
    SCHEDULE_PLURAL,
    VERSION,
)
from jobrunner.operator.kube import ApiError

log = logging.getLogger("jobrunner.controller")

GUARD_FINALIZER = "jobrunner.dev/controller-access"
HOLDER_PLURALS = (PLURAL, POOL_PLURAL, SCHEDULE_PLURAL)
# A binding nobody deletes is looked at this often (one GET per namespace); one being
# deleted every BUSY_SECONDS, so its namespace goes soon after its last BatchRun.
IDLE_SECONDS = 15.0
BUSY_SECONDS = 1.0
ERROR_SECONDS = 5.0

ABSENT, KEPT, WAITING, RELEASED, ERROR = "absent", "kept", "waiting", "released", "error"


def holders(namespace: str) -> list[str]:
    """The objects of `namespace` that still carry the controller's finalizer."""
    found = []
    for plural in HOLDER_PLURALS:
        for item in kube.list_custom(GROUP, VERSION, namespace, plural).get("items") or []:
            meta = item.get("metadata") or {}
            if FINALIZER in (meta.get("finalizers") or []):
                found.append(f"{plural}/{meta.get('name')}")
    return found


def _drop_finalizer(namespace: str, name: str, binding: dict[str, Any]) -> None:
    meta = binding.get("metadata") or {}
    rest = [f for f in meta.get("finalizers") or [] if f != GUARD_FINALIZER]
    # resourceVersion makes the patch conditional: someone else's finalizer added
    # meanwhile is not dropped with ours (409, and the next look retries).
    kube.patch_role_binding(namespace, name, {"metadata": {
        "resourceVersion": meta.get("resourceVersion"), "finalizers": rest or None}})


def check(namespace: str, name: str) -> tuple[str, list[str]]:
    """One look at the binding `name` in `namespace`; releases it if its time has come.
    Returns the state and, while WAITING, the objects it waits for."""
    try:
        binding = kube.read_role_binding(namespace, name)
    except ApiError as exc:
        if exc.status in (403, 404):  # gone (or never guarded): nothing to hold
            return ABSENT, []
        raise
    meta = binding.get("metadata") or {}
    if GUARD_FINALIZER not in (meta.get("finalizers") or []):
        return ABSENT, []
    if not meta.get("deletionTimestamp"):
        return KEPT, []
    waiting = holders(namespace)
    if waiting:
        return WAITING, waiting
    _drop_finalizer(namespace, name, binding)
    return RELEASED, []


def release_all(namespaces: tuple[str, ...] | list[str], name: str) -> list[str]:
    """Drop the finalizer of every guarded binding, whatever is left in its namespace (the
    uninstall's pre-delete hook: no controller will be left to finalize anything). The
    namespaces whose binding it released."""
    released = []
    for namespace in namespaces:
        for _ in range(5):
            try:
                binding = kube.read_role_binding(namespace, name)
            except ApiError as exc:
                if exc.status in (403, 404):
                    break
                raise
            if GUARD_FINALIZER not in ((binding.get("metadata") or {}).get("finalizers")
                                       or []):
                break
            try:
                _drop_finalizer(namespace, name, binding)
            except ApiError as exc:
                if exc.status == 409:
                    continue  # changed meanwhile: read it again
                raise
            released.append(namespace)
            break
    return released


class Guard:
    """A thread that looks at the guarded binding of each namespace: every IDLE_SECONDS,
    every BUSY_SECONDS while it is being deleted, at once after `nudge`."""

    def __init__(self, namespaces: tuple[str, ...] | list[str], name: str) -> None:
        self.name = name
        self.namespaces = list(namespaces)
        self._due = {ns: 0.0 for ns in self.namespaces}
        self._state: dict[str, str] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rbac-guard", daemon=True)

    def start(self) -> Guard:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def nudge(self, namespace: str) -> None:
        """Something in `namespace` is being deleted: look soon."""
        if namespace in self._due:
            self._due[namespace] = min(self._due[namespace],
                                       time.monotonic() + BUSY_SECONDS)
            self._wake.set()

    def look(self, namespace: str) -> str:
        try:
            state, waiting = check(namespace, self.name)
        except (ApiError, httpx.HTTPError, ValueError) as exc:
            state, waiting = ERROR, []
            if self._state.get(namespace) != state:
                log.warning("RoleBinding %s/%s: cannot check it (%s); retrying", namespace,
                            self.name, exc)
        if state != self._state.get(namespace):
            if state == WAITING:
                log.info("RoleBinding %s/%s is being deleted; kept until %d object(s) there "
                         "are finalized: %s", namespace, self.name, len(waiting),
                         ", ".join(waiting[:10]))
            elif state == RELEASED:
                log.info("RoleBinding %s/%s released: nothing left to finalize there",
                         namespace, self.name)
        self._state[namespace] = state
        return state

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for namespace in self.namespaces:
                if self._due[namespace] <= now and not self._stop.is_set():
                    state = self.look(namespace)
                    self._due[namespace] = time.monotonic() + (
                        BUSY_SECONDS if state == WAITING
                        else ERROR_SECONDS if state == ERROR else IDLE_SECONDS)
            self._wake.clear()
            delay = max(0.05, min(self._due.values(), default=now + IDLE_SECONDS)
                        - time.monotonic())
            self._wake.wait(delay)


_guard: Guard | None = None


def start(namespaces: tuple[str, ...] | list[str], name: str) -> Guard:
    global _guard
    _guard = Guard(namespaces, name).start()
    return _guard


def nudge(namespace: str) -> None:
    if _guard is not None:
        _guard.nudge(namespace)


def stop() -> None:
    """Stop the thread, then one last look at each namespace: a controller stopped while
    its binding is being deleted (an upgrade that drops the namespace from
    watch.namespaces) releases it now if nothing there is left to finalize."""
    global _guard
    guard, _guard = _guard, None
    if guard is None:
        return
    guard.stop()
    for namespace in guard.namespaces:
        guard.look(namespace)
