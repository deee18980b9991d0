"""How many workers a WorkerPool wants: a pure decision from its queue depth.

Rules (docs/pools.md, "On Kubernetes"):
- want = clamp(ceil(work / targetTasksPerReplica), minReplicas, maxReplicas), where work is
  the pool's claimable tasks (pending and due) plus its tasks in flight (leased): a
  running task keeps its worker wanted, so a pool never shrinks under its own work.
- Up at once: more work gets workers on the next tick.
- Down only once the work has wanted fewer replicas than the Deployment has for the whole
  stabilization window, and then to the largest want seen in that window (as the HPA's
  scaleDown stabilization does), so a short lull between batches does not kill warm
  workers that the next batch would need again.
- To zero when minReplicas is 0 and nothing is pending or leased for the window.
The state that must survive a controller restart (since when the work wanted fewer
replicas, and the most it wanted since) lives in the WorkerPool's status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleDown:
    """A scale-down waiting out its window: since when (seconds, a wall clock) and the
    most replicas the work wanted since then."""

    since: float
    most: int


@dataclass(frozen=True)
class Decision:
    desired: int
    want: int  # what the work alone asks for now (clamped to min..max)
    pending_down: ScaleDown | None
    reason: str  # CamelCase, for the WorkerPool's Sized condition
    message: str


def want_for(work: int, per_replica: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, math.ceil(max(work, 0) / per_replica)))


def decide(*, current: int, work: int, per_replica: int, min_replicas: int,
           max_replicas: int, window: float, pending_down: ScaleDown | None,
           now: float) -> Decision:
    want = want_for(work, per_replica, min_replicas, max_replicas)
    basis = (f"{work} task(s) pending or running, {per_replica} per replica: want {want} "
             f"(min {min_replicas}, max {max_replicas})")
    if want >= current or current > max_replicas:
        # Scale up (or hold) at once; above max (max lowered): down to it at once.
        desired = want if want >= current else max_replicas
        raw = math.ceil(max(work, 0) / per_replica)
        reason = ("NoWork" if desired == 0 else "AtMaxReplicas" if raw > max_replicas
                  else "AtMinReplicas" if raw < min_replicas else "WorkQueued")
        return Decision(desired, want, None, reason, basis)
    since = pending_down.since if pending_down else now
    most = max(want, pending_down.most if pending_down else want)
    waited = now - since
    if waited >= window:
        desired = most
        reason = "NoWork" if desired == 0 else "ScaledDown"
        return Decision(desired, want, None, reason,
                        f"{basis}; fewer replicas wanted for {waited:.0f}s (window {window:g}s)")
    return Decision(current, want, ScaleDown(since, most), "StabilizationWindow",
                    f"{basis}; keeping {current} until fewer have been wanted for the whole "
                    f"{window:g}s window ({window - waited:.0f}s left)")
