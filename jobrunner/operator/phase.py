"""A BatchRun's phase: Running, Reducing, Suspended, Succeeded, Failed or Cancelled, with
the reason and message status and Events show, from how its workers ended and the
queue's counts. Pure functions: both kinds of run (own Job, WorkerPool) use them."""

from __future__ import annotations

from typing import Any

from jobrunner.features import generators
from jobrunner.features import reduce as reduce_step
from jobrunner.features.manifest import BatchRunSpec
from jobrunner.features.status import counts_summary
from jobrunner.operator.status import safe


def job_finished(job: dict[str, Any]) -> tuple[str, str, str] | None:
    """(Complete or Failed, reason, message) once the Job ended, else None."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return cond["type"], cond.get("reason") or cond["type"], cond.get("message") or ""
    return None


def job_run_phase(run: BatchRunSpec, job: Any, counts: dict[str, int], batch_id: str,
                  reduce: reduce_step.ReduceState | None = None,
                  gen: generators.GeneratorState | None = None) -> tuple[str, str, str]:
    """The phase of a run on its own Job: from the Job's conditions and the counts."""
    return run_phase(run, job_finished(job), counts, batch_id, reduce, gen)


def run_phase(run: BatchRunSpec, finished: tuple[str, str, str] | None,
              counts: dict[str, int], batch_id: str,
              reduce: reduce_step.ReduceState | None = None,
              gen: generators.GeneratorState | None = None) -> tuple[str, str, str]:
    """(phase, reason, message) from how the workers ended (a Job's condition, or for a
    run in a pool the queue having nothing left for it) and the queue's counts (with
    their total)."""
    summary = counts_summary(counts)
    unfinished = counts["pending"] + counts["leased"]
    reducing = reduce is not None and reduce.configured
    if finished and finished[0] == "Failed":
        return "Failed", finished[1], (f"Job failed ({finished[1]}: {finished[2]}); {summary}. "
                                       "Unfinished tasks stay in the queue: retry with a new "
                                       "BatchRun with source: {external: {}} and batchId "
                                       f"{batch_id}")
    if finished:
        if gen is not None and gen.failed:
            return "Failed", "GeneratorFailed", (f"{gen.describe()}; the {counts['total']} "
                                                 f"task(s) it enqueued were kept: {summary}")
        if unfinished or (reducing and reduce.running) or (gen is not None and gen.running):
            what = ("work" if unfinished else "its generator"
                    if gen is not None and gen.running else "its reduce")
            return "Failed", "WorkersExitedEarly", (f"the Job completed with {what} left: "
                                                    f"{summary}")
        if reducing and reduce.phase(counts) == "failed":
            return "Failed", "ReduceFailed", (f"reduce {reduce.describe(counts)}; see "
                                              f"`jobrunner status --batch {batch_id}`; {summary}")
        if counts["dead"] and not (reducing and reduce.reduced):
            skipped = "; the reduce did not run (onDead: fail)" if reducing else ""
            return "Failed", "DeadTasks", (f"{counts['dead']} task(s) dead: see `jobrunner dead "
                                           f"list --batch {batch_id}`; {summary}{skipped}")
        if counts["cancelled"]:
            return "Cancelled", "Cancelled", f"the batch was cancelled; {summary}"
        if reducing:
            if not reduce.reduced:
                return "Failed", "ReduceNotRun", f"reduce {reduce.describe(counts)}; {summary}"
            how = "included" if reduce.spec and reduce.spec.on_dead == "include" else "skipped"
            dead = f"; {counts['dead']} dead task(s) {how}" if counts["dead"] else ""
            return "Succeeded", "Reduced", (f"{summary}{dead}; reduced: the result is in "
                                            f"status.result")
        return "Succeeded", "AllTasksDone", summary
    if run.suspend:
        return "Suspended", "Suspended", f"suspended: no new claims; {summary}"
    if reducing and not unfinished and (reduce.enqueued or reduce.reduced):
        # From the reduce's enqueue until the Job completes (its pods exit once it is
        # done), so the phase never goes back to Running in between.
        after = "" if reduce.running else "; waiting for the workers to exit"
        return "Reducing", "Reducing", (f"every task is terminal; reduce "
                                        f"{reduce.describe(counts)}{after}")
    if gen is not None and gen.running:
        return "Running", "Running", safe(f"{summary}; {gen.describe()}")
    return "Running", "Running", summary


def pool_run_phase(run: BatchRunSpec, counts: dict[str, int], batch_id: str,
                   reduce: reduce_step.ReduceState | None, deadline_hit: bool,
                   pool: str) -> tuple[str, str, str]:
    """The phase of a run in a WorkerPool: from the queue alone (and its deadline)."""
    summary = counts_summary(counts)
    if deadline_hit:
        return "Failed", "DeadlineExceeded", (
            f"activeDeadlineSeconds ({run.effective_deadline()}) passed: pending tasks "
            f"cancelled; {summary}. Unfinished tasks stay in the queue: retry with a new "
            f"BatchRun with source: {{external: {{}}}} and batchId {batch_id}")
    unfinished = counts["pending"] + counts["leased"]
    reducing = reduce is not None and reduce.configured and reduce.running
    # The pool's workers never "finish": the run has, once the queue holds nothing more
    # for it (its reduce included).
    finished = None if unfinished or reducing else ("Complete", "Complete", "")
    result = run_phase(run, finished, counts, batch_id, reduce, None)
    if result[0] == "Running":
        return "Running", "Running", f"{result[2]}; in pool {pool}"
    return result
