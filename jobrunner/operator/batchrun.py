"""kopf handlers for BatchRun. Small functions; the state lives in the resource's status.

create/resume/update and a periodic timer all converge the run with `reconcile`, which
is idempotent: enqueue is keyed on (batch, task key), the Job name is derived from the
BatchRun's name and uid, status is patched only where it changed.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, NoReturn

import kopf

from jobrunner.features import generators
from jobrunner.features import reduce as reduce_step
from jobrunner.features import status as batch_status
from jobrunner.features.manifest import BatchRunSpec, parse_batchrun
from jobrunner.model.errors import BadInput, UnknownBatch
from jobrunner.operator import batchrun_pools as pool_runs
from jobrunner.operator import flowcontrol, kube, kueue, metrics, pods, rbacguard, tenancy
from jobrunner.operator.config import (
    CONFIG,
    FINALIZER,
    GROUP,
    PLURAL,
    VERSION,
    worker_secret,
)
from jobrunner.operator.database import DatabaseProblem, queue_for, read_dsn
from jobrunner.operator.jobs import api_error_detail, build_job, default_batch_id, job_name
from jobrunner.operator.kube import ApiError, plain
from jobrunner.operator.phase import job_finished, job_run_phase, pool_run_phase
from jobrunner.operator.sources import SourceUnavailable, config_map_source
from jobrunner.operator.status import TERMINAL, Reconcile, event, now_iso, run_conditions, safe

log = logging.getLogger("jobrunner.controller")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress and the diff base go to annotations of our own prefix; status
    # holds only what the CRD declares (kopf would otherwise write status.kopf).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="jobrunner.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="jobrunner.dev", key="last-handled-configuration")
    settings.persistence.finalizer = FINALIZER
    # Only warnings become Events by themselves; milestones are posted explicitly.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "jobrunner-controller"
    # Watches must notice a restarted or silent API server within a minute.
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 75
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    # No cluster-wide CRD/namespace scanning: it would need RBAC the controller otherwise
    # does not use. The CRDs must exist when the controller starts (the chart installs them).
    settings.scanning.disabled = True
    settings.execution.max_workers = 20


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account (at $KUBERNETES_SERVICE_HOST), else the kubeconfig. kopf
    calls this again after a 401 (a rotated token): kube.py then uses the new login too."""
    info = kube.login(**kwargs)
    kube.remember_login(info)
    return info


def _db_secret(run: BatchRunSpec) -> tuple[str, str]:
    return (run.database.get("secretName") or CONFIG.default_secret_name,
            run.database.get("key") or CONFIG.default_secret_key)


def _parse(body: kopf.Body) -> BatchRunSpec:
    obj = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
           "metadata": dict(body.metadata), "spec": dict(body.spec)}
    run = parse_batchrun(plain(obj), source=f"BatchRun {body.metadata.namespace}/"
                         f"{body.metadata.name}")
    return kueue.with_default_queue(run, body.metadata.namespace, CONFIG.kueue_default_queues)


def _status(status: kopf.Status) -> dict[str, Any]:
    return plain(dict(status))


@kopf.on.create(GROUP, VERSION, PLURAL, timeout=600, backoff=5)
@kopf.on.resume(GROUP, VERSION, PLURAL, timeout=600, backoff=5)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", timeout=600, backoff=5)
def start_or_update(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, retry: int,
                    **_: Any) -> None:
    reconcile(body, _status(status), patch, retry)


@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.refresh_seconds, initial_delay=2,
            backoff=CONFIG.refresh_seconds)
def refresh(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, retry: int,
            **_: Any) -> None:
    current = _status(status)
    if not (current.get("milestones") or {}).get("enqueued"):
        return  # the create handler owns the first enqueue (and its retries)
    reconcile(body, current, patch, retry)


@kopf.on.delete(GROUP, VERSION, PLURAL, retries=CONFIG.delete_retries + 1, backoff=3,
                timeout=120)
def cancel_pending(body: kopf.Body, status: kopf.Status, retry: int, **_: Any) -> None:
    """The finalizer: cancel what is still pending; the Job goes by garbage collection.

    Bounded: if the database stays unreachable, give up after a few tries with an Event
    rather than keep the resource (and maybe its namespace) from being deleted forever.
    """
    ns, name = body.metadata.namespace, body.metadata.name
    metrics.forget(ns, name)
    rbacguard.nudge(ns)  # its namespace's RoleBinding may be waiting for this run to go
    batch_id = (status or {}).get("batchId")
    if not batch_id:
        return
    try:
        run = _parse(body)
        secret, key = _db_secret(run)
        with queue_for(read_dsn(ns, secret, key, last_known=True)) as queue:
            cancelled = queue.cancel(batch_id)
    except UnknownBatch:
        return
    except (DatabaseProblem, BadInput) as exc:
        if retry >= CONFIG.delete_retries:
            event(body, "Warning", "CancelFailed", message=(
                f"gave up cancelling the pending tasks of batch {batch_id} after {retry + 1} "
                f"attempts ({exc}); cancel them with `jobrunner cancel --batch {batch_id}`"))
            return
        raise kopf.TemporaryError(safe(str(exc)), delay=3) from None
    event(body, "Normal", "Cancelled",
          message=f"BatchRun deleted: {cancelled} pending task(s) of batch {batch_id} "
                  "cancelled")


def reconcile(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch, retry: int) -> None:
    rc = Reconcile.of(body, st, patch)
    if st.get("phase") in TERMINAL:
        if st.get("observedGeneration") != rc.generation:
            patch.status["observedGeneration"] = rc.generation
        if (st.get("counts") or {}).get("leased"):
            _settle_leases(rc)
        return
    run = _parse_or_fail(rc)
    if CONFIG.bind_tenants and not rc.milestones.get("enqueued"):
        _check_tenant(rc, run)
    batch_id = st.get("batchId") or run.batch_id or default_batch_id(
        rc.namespace, rc.name, body.metadata.uid)
    rc.new["batchId"] = batch_id
    secret, key = _db_secret(run)
    tasks = run.tasks
    if run.config_map is not None and not rc.milestones.get("enqueued"):
        tasks = _read_config_map(rc, run)
    pool_name = None
    if run.pool is not None:
        rc.new["pool"] = pool_runs.queue_pool(rc.namespace, run.pool)
        pool_name = pool_runs.admit(rc, run, (secret, key))
    deadline_hit = False
    try:
        with queue_for(read_dsn(rc.namespace, secret, key)) as queue:
            if not rc.milestones.get("enqueued"):
                _first_enqueue(rc, queue, run, batch_id, tasks, pool_name)
            queue.expire()  # rescue leases of dead pods even if no worker is left alive
            if pool_name is not None:
                deadline_hit = pool_runs.enforce_deadline(queue, run, st, batch_id)
            # The reduce is triggered here too, if the batch settled and no worker enqueued
            # it yet (the trigger is idempotent: any number of callers enqueue it once).
            batch = batch_status.read(queue, batch_id, trigger_reduce=True,
                                      generator=run.generator is not None)
            metrics.record_batch(batch_status.gauges(batch, run.tenant,
                                                     float(run.effective_deadline())))
            rc.new.update(_outcome_status(queue, st, batch))
            rc.new["budget"] = flowcontrol.apply_budget(queue, run, st, batch_id)
            flow = flowcontrol.observe(queue, run, st, batch_id)
            rc.new.update(flow.status)
    except DatabaseProblem as problem:
        _database_problem(rc, problem)
        raise kopf.TemporaryError(safe(str(problem)),
                                  delay=min(60, 5 * 2 ** min(retry, 4))) from None
    except UnknownBatch:
        _wait_for_tasks(rc, batch_id)

    counts = batch.status_counts()
    if pool_name is not None:
        # No Job: the pool's Deployment runs the workers; the phase comes from the queue.
        rc.new["activeDeadlineSeconds"] = run.effective_deadline()
        rc.new["activeDeadlineSource"] = _deadline_source(run)
        rc.new["startTime"] = st.get("startTime") or now_iso()
        phase, reason, message = pool_run_phase(run, counts, batch_id, batch.reduce,
                                                deadline_hit, pool_name)
        _finish(rc, phase, reason, message, counts, flow)
        return
    job = _ensure_job(rc, run, batch_id, *worker_secret(run.database, secret, key))
    rc.new["jobName"] = job["metadata"]["name"]
    rc.new["activeDeadlineSeconds"] = job["spec"].get("activeDeadlineSeconds")
    rc.new["activeDeadlineSource"] = _deadline_source(run)
    rc.new["startTime"] = st.get("startTime") or now_iso()
    gen = batch.generator
    if gen is not None and gen.configured:
        rc.new["generator"] = _generator_status(gen, counts)
        _generator_condition(rc, gen, counts)
    phase, reason, message = job_run_phase(run, job, counts, batch_id, batch.reduce, gen)
    workload = None
    if kueue.managed(job):
        admission, workload = _kueue_admission(rc, run, job)
        if phase == "Running" and job["spec"].get("suspend"):
            phase, reason, message = _waiting_for_kueue(admission, message)
    if phase == "Running":
        stuck = _worker_health(rc, job)
        if stuck is not None:
            phase, reason = "Failed", stuck.reason
            message = (f"{safe(stuck.describe())}; no worker started in "
                       f"{pods.START_TIMEOUT:g}s. {message}. Unfinished tasks stay in the queue: "
                       "retry with a new BatchRun with source: {external: {}} and batchId "
                       f"{batch_id}")
            _stop_job(job, workload)
    _finish(rc, phase, reason, message, counts, flow)


def _kueue_admission(rc: Reconcile, run: BatchRunSpec, job: dict[str, Any]
                     ) -> tuple[kueue.Admission | None, dict[str, Any] | None]:
    """The Workload Kueue made for the run's Job, read into status.admission and the
    Admitted condition, with an Event on each change; spec.suspend becomes the Workload's
    spec.active (Kueue then suspends the Job: the controller never does). None when the
    Workload cannot be read this time (no verdict)."""
    asked = run.workers
    try:
        workload = kueue.read_workload(rc.namespace, job["metadata"]["uid"])
    except kueue.KueueAbsent as exc:
        message = safe(f"{exc} The Job stays suspended until Kueue admits it.")
        previous = rc.previous("Admitted")
        rc.condition("Admitted", False, "KueueNotInstalled", message)
        rc.new["admission"] = {"queueName": run.queue_name, "state": "Pending",
                               "reason": "KueueNotInstalled", "message": message,
                               "askedWorkers": asked, "admittedWorkers": 0}
        if not previous or previous.get("reason") != "KueueNotInstalled":
            rc.event("Warning", "KueueNotInstalled", message)
        return kueue.Admission("Pending", "KueueNotInstalled", message, asked_workers=asked), None
    except ApiError as exc:
        log.warning("reading the Workload of Job %s: HTTP %s", job["metadata"]["name"],
                    exc.status)
        return None, None
    if workload is not None:
        active = (workload.get("spec") or {}).get("active", True) is not False
        if active == run.suspend and not job_finished(job):
            try:
                kueue.set_active(rc.namespace, workload["metadata"]["name"], not run.suspend)
                rc.event("Normal", "WorkloadDeactivated" if run.suspend else "WorkloadActivated",
                         f"Workload {workload['metadata']['name']}: spec.active "
                         f"{str(not run.suspend).lower()} (spec.suspend "
                         f"{str(run.suspend).lower()})")
            except ApiError as exc:
                log.warning("could not set Workload %s active: HTTP %s",
                            workload["metadata"]["name"], exc.status)
    admission = kueue.admission(workload, asked)
    rc.new["admission"] = admission.as_status(run.queue_name or "")
    previous = rc.previous("Admitted")
    rc.condition("Admitted", admission.condition_status(), admission.reason,
                 safe(admission.message))
    # (an Event per change of state, not per new wording of Kueue's pending message)
    changed = not previous or previous.get("reason") != admission.reason
    if changed and admission.state != "NoWorkload":
        reason = {"Admitted": "Admitted", "Evicted": "SuspendedByKueue",
                  "Finished": "WorkloadFinished"}.get(admission.state, "QueuedByKueue")
        rc.event("Normal", reason, admission.message)
    return admission, workload


def _waiting_for_kueue(admission: kueue.Admission | None, summary: str
                       ) -> tuple[str, str, str]:
    """The phase of a run whose Job Kueue keeps suspended: Pending until its first
    admission, Suspended (SuspendedByKueue) after an eviction, until admitted again."""
    if admission is None:
        return "Pending", "WaitingForAdmission", f"waiting for Kueue to admit the Job; {summary}"
    if admission.state == "Evicted":
        return "Suspended", "SuspendedByKueue", (
            f"Suspended by Kueue: {admission.message}; the workers released their tasks; "
            f"the run resumes when Kueue admits it again; {summary}")
    return "Pending", "WaitingForAdmission", f"{admission.message}; {summary}"


def _deadline_source(run: BatchRunSpec) -> str:
    return ("spec" if run.active_deadline is not None
            else "default: max(1 day, 3 x visibilityTimeoutSeconds + 60)")


def _parse_or_fail(rc: Reconcile) -> BatchRunSpec:
    """The run's spec; an invalid one fails the run for good (a spec change retries)."""
    try:
        return _parse(rc.body)
    except BadInput as exc:
        rc.condition("Failed", True, "InvalidSpec", str(exc))
        rc.apply({"phase": "Failed", "message": str(exc), "conditions": rc.conditions,
                  "observedGeneration": rc.generation})
        rc.event("Warning", "InvalidSpec", str(exc))
        raise kopf.PermanentError(str(exc)) from None


def _check_tenant(rc: Reconcile, run: BatchRunSpec) -> None:
    """The defence behind the admission policy: a run naming a tenant its namespace is not
    allowed fails before its batch, Job or pool admission exists."""
    try:
        why = tenancy.check(rc.namespace, run.tenant, CONFIG.allowed_tenants)
    except ApiError as exc:
        # Unknown is not allowed: retry rather than enqueue for a tenant we could not check.
        raise kopf.TemporaryError(f"cannot read namespace {rc.namespace} to check the "
                                  f"tenant: {exc}", delay=10) from None
    if why is not None:
        rc.refuse("TenantNotAllowed", why)


def _first_enqueue(rc: Reconcile, queue: Any, run: BatchRunSpec, batch_id: str, tasks: Any,
                   pool_name: str | None) -> None:
    try:
        flowcontrol.check_limits(queue, run)
        message = _enqueue(queue, run, batch_id, tasks, pool_name)
    except BadInput as exc:
        # The queue refused the run's tasks (an unknown limit, a cancelled batch, ...):
        # nothing was written; the run fails with the reason, for good.
        rc.refuse("UnknownLimit" if isinstance(exc, flowcontrol.UnknownLimit)
                  else "EnqueueRefused", str(exc))
    rc.milestones["enqueued"] = True
    rc.condition("Enqueued", True, "Enqueued", message)
    rc.event("Normal", "Enqueued", message)


def _wait_for_tasks(rc: Reconcile, batch_id: str) -> NoReturn:
    """source: external and the batch does not exist yet: Pending until it does."""
    message = (f"waiting for tasks: enqueue them under batch {batch_id} "
               f"(jobrunner enqueue --batch {batch_id} …)")
    rc.condition("Enqueued", False, "WaitingForTasks", message)
    rc.condition("Reconciling", True, "WaitingForTasks", message)
    rc.apply({**rc.new, "phase": "Pending", "conditions": rc.conditions,
              "observedGeneration": rc.generation, "milestones": rc.milestones})
    raise kopf.TemporaryError(message, delay=10) from None


def _finish(rc: Reconcile, phase: str, reason: str, message: str, counts: dict[str, int],
            flow: Any) -> None:
    """The phase's conditions, Events, status and metrics: the same for a run on its own
    Job and a run in a WorkerPool."""
    phase, reason, message = flowcontrol.budget_phase(phase, reason, message, flow, counts,
                                                      rc.name)
    rc.conditions, budget_event = flowcontrol.budget_condition(rc.conditions, phase, message,
                                                               flow, rc.generation)
    if budget_event:
        rc.event(*budget_event)
    rc.new.update(phase=phase, counts=counts, message=message,
                  observedGeneration=rc.generation)
    if phase in TERMINAL:
        rc.new["completionTime"] = rc.current.get("completionTime") or now_iso()
    rc.conditions = run_conditions(rc.conditions, phase, reason, message, counts,
                                   rc.generation)
    _milestone_events(rc, counts, phase, message)
    rc.new["milestones"] = rc.milestones
    rc.new["conditions"] = rc.conditions
    rc.apply(rc.new)
    metrics.record(rc.namespace, rc.name, phase, counts)
    flowcontrol.record_metrics(rc.namespace, rc.name, flow)


def _settle_leases(rc: Reconcile) -> None:
    """A run that ended with tasks still leased (pods killed by the deadline): keep
    rescuing and counting until their leases expired, so status shows where they went."""
    try:
        run = _parse(rc.body)
        secret, key = _db_secret(run)
        with queue_for(read_dsn(rc.namespace, secret, key)) as queue:
            queue.expire()
            batch = batch_status.read(queue, rc.current["batchId"], reduce=False,
                                      generator=False)
    except (DatabaseProblem, BadInput):
        return
    rc.apply({"counts": batch.status_counts()})


def _read_config_map(rc: Reconcile, run: BatchRunSpec) -> Any:
    """The tasks of source.configMap. A bad line fails the run (nothing is enqueued: every
    line is checked first); a ConfigMap that cannot be read yet keeps it Pending."""
    ns, name = rc.namespace, rc.name
    try:
        return config_map_source(ns, run, f"BatchRun {ns}/{name}")
    except BadInput as exc:
        message = safe(f"{exc}; nothing was enqueued")
        rc.condition("Enqueued", False, "InvalidSource", message)
        rc.condition("Failed", True, "InvalidSource", message)
        rc.condition("Stalled", True, "InvalidSource", message)
        rc.condition("Reconciling", False, "InvalidSource", message)
        rc.apply({**rc.new, "phase": "Failed", "message": message,
                  "conditions": rc.conditions, "observedGeneration": rc.generation,
                  "completionTime": now_iso()})
        rc.event("Warning", "InvalidSource", message)
        raise kopf.PermanentError(message) from None
    except SourceUnavailable as exc:
        message = safe(str(exc))
        previous = rc.previous("Enqueued")
        rc.condition("Enqueued", False, exc.reason, message)
        rc.condition("Reconciling", True, exc.reason, message)
        rc.apply({**rc.new, "phase": "Pending", "message": message,
                  "conditions": rc.conditions, "observedGeneration": rc.generation,
                  "milestones": rc.milestones})
        if not previous or previous.get("reason") != exc.reason:
            rc.event("Warning", exc.reason, message)
        raise kopf.TemporaryError(message, delay=5) from None


def _enqueue(queue: Any, run: BatchRunSpec, batch_id: str, tasks: Any,
             pool: str | None = None) -> str:
    reduce = f"; reduce: {run.reduce.describe()}" if run.reduce else ""
    limits = f"; limits: {', '.join(run.limits)}" if run.limits else ""
    if run.generator is not None:
        new = generators.start(queue.conn, batch_id, run.tenant, run.generator,
                               reduce=run.reduce.as_json() if run.reduce else None)
        return (f"batch {batch_id}: generator {run.generator.describe()} "
                + ("enqueued: its tasks are enqueued as it runs" if new
                   else "was enqueued before") + reduce + limits)
    into = f" into pool {pool} (priority {run.priority})" if pool else ""
    if tasks is None:
        queue.batch(batch_id)  # source: external, the tasks must already be there
        if pool is not None:
            pool_runs.check_external_batch(queue, batch_id, pool, run.handler or "")
        reduce_step.attach(queue.conn, batch_id, run.reduce)
        total = sum(queue.counts(batch_id).values())
        return f"batch {batch_id}: {total} task(s) enqueued externally{into}{reduce}"
    options = flowcontrol.enqueue_options(run)
    if pool is not None:
        options |= {"pool": pool, "priority": run.priority, "handler": run.handler}
    result = queue.enqueue(batch_id, run.tenant, tasks, max_attempts=run.max_attempts,
                           reduce=run.reduce.as_json() if run.reduce else None, **options)
    return (f"batch {batch_id}: {result.new} task(s) enqueued{into}"
            + (f", {result.existing} already there" if result.existing else "") + reduce
            + limits)


def _outcome_status(queue: Any, st: dict[str, Any],
                    batch: batch_status.BatchStatus) -> dict[str, Any]:
    """What the run produced, for `kubectl describe`: the reduce's state, the batch's result
    (at most 4 KiB; else where it is) and the most frequent errors of dead tasks (a dead
    reduce task among them). Each read only when it can have changed."""
    new: dict[str, Any] = {}
    reduce, counts = batch.reduce, batch.counts
    if reduce is not None and reduce.configured:
        new["reduce"] = {k: v for k, v in {
            "state": reduce.phase(counts), "step": reduce.spec.describe() if reduce.spec else None,
            "onDead": reduce.spec.on_dead if reduce.spec else None,
            "attempts": reduce.attempts,
            "error": (reduce.last_error or "")[:1000] if reduce.task_status == "dead" else None,
            "resultBytes": reduce.result_bytes}.items() if v is not None}
        if reduce.reduced and "result" not in st:
            found, value = reduce_step.status_result(queue.conn, batch.batch_id)
            if found:
                new["result"] = value
    # (read again only when the dead tasks or the reduce's state changed)
    changed = ((st.get("counts") or {}).get("dead") != counts["dead"]
               or (st.get("reduce") or {}).get("state") != (new.get("reduce") or {}).get("state"))
    if batch.has_errors and (changed or not st.get("topErrors")):
        new["topErrors"] = [group.as_status()
                            for group in batch_status.top_errors(queue, batch.batch_id)]
    return new


def _generator_status(gen: generators.GeneratorState, counts: dict[str, int]) -> dict[str, Any]:
    """status.generator: its state, the tasks enqueued so far (the batch's tasks: all of
    them come from it), attempts, and the last error when it failed."""
    return {k: v for k, v in {
        "state": gen.phase(), "step": gen.spec.describe() if gen.spec else None,
        "enqueued": sum(counts[s] for s in ("pending", "leased", "done", "dead", "cancelled")),
        "attempts": gen.attempts,
        "error": safe((gen.last_error or "")[:1000]) if gen.last_error else None,
    }.items() if v is not None}


def _generator_condition(rc: Reconcile, gen: generators.GeneratorState,
                         counts: dict[str, int]) -> None:
    """Condition Generated: Unknown while it waits or runs (reason Pending, Running),
    True once it finished (Finished), False when it failed for good (Failed: its error) or
    was cancelled; an Event when it finishes or fails."""
    phase = gen.phase()
    total = sum(counts[s] for s in ("pending", "leased", "done", "dead", "cancelled"))
    message = safe(gen.describe())
    if phase == "Failed":
        message = safe(f"{message}; the {total} task(s) it enqueued are kept and run")
    status = {"Finished": True, "Failed": False, "Cancelled": False}.get(phase)
    rc.condition("Generated", status, phase, message[:2000])
    if phase == "Finished" and not rc.milestones.get("generated"):
        rc.milestones["generated"] = True
        rc.event("Normal", "Generated", f"{message}; {total} task(s) enqueued")
    if phase == "Failed" and not rc.milestones.get("generatorFailed"):
        rc.milestones["generatorFailed"] = True
        rc.event("Warning", "GeneratorFailed", message)


def _database_problem(rc: Reconcile, problem: DatabaseProblem) -> None:
    message = safe(str(problem))
    kind = "Progressing" if rc.milestones.get("enqueued") else "Enqueued"
    previous = rc.previous(kind)
    rc.condition(kind, False if kind == "Enqueued" else None, problem.reason, message)
    # kstatus: still in progress (not healthy, not failed) while the database is away.
    rc.condition("Reconciling", True, problem.reason, message)
    rc.apply({**rc.new, "phase": rc.current.get("phase") or "Pending", "message": message,
              "conditions": rc.conditions, "observedGeneration": rc.generation,
              "milestones": rc.milestones})
    metrics.RECONCILE_ERRORS.labels(problem.reason).inc()
    if not previous or previous.get("reason") != problem.reason:
        rc.event("Warning", problem.reason, message)


def _ensure_job(rc: Reconcile, run: BatchRunSpec, batch_id: str, secret: str,
                key: str) -> dict[str, Any]:
    """Exactly one Job per BatchRun, ever: a deterministic name, create-or-read."""
    body = rc.body
    ns, name = rc.namespace, job_name(rc.name, body.metadata.uid)
    try:
        job = kube.read_job(ns, name)
    except ApiError as exc:
        if exc.status != 404:
            raise kopf.TemporaryError(f"reading Job {name}: HTTP {exc.status}", delay=5) from None
        if rc.current.get("jobName"):
            raise kopf.PermanentError(f"Job {name} was deleted while the run was active"
                                      ) from None
        manifest = build_job(run, name=name, namespace=ns, batch_id=batch_id,
                             secret_name=secret, secret_key=key)
        kopf.adopt(manifest, owner=body)
        try:
            job = kube.create_job(ns, manifest)
            rc.event("Normal", "JobCreated",
                     f"Job {name}: {run.workers} worker(s), activeDeadlineSeconds "
                     f"{run.effective_deadline()}")
        except ApiError as create_exc:
            if create_exc.status == 422:
                # The API server refused the pod (spec.template passes volumes, affinity,
                # containers... through unchecked): say what it objected to. Retrying cannot
                # help until the spec changes, and a spec change runs this handler again.
                message = safe(f"Job {name} rejected: {api_error_detail(create_exc)}")
                rc.event("Warning", "JobRejected", message)
                raise kopf.TemporaryError(message, delay=30) from None
            if create_exc.status != 409:
                raise kopf.TemporaryError(safe(f"creating Job {name}: HTTP {create_exc.status} "
                                               f"{api_error_detail(create_exc)}"),
                                          delay=5) from None
            job = kube.read_job(ns, name)
        return job
    if kueue.managed(job):
        return _update_kueue_job(rc, run, job)
    changes: dict[str, Any] = {}
    if job["spec"].get("parallelism") != run.workers:
        changes["parallelism"] = run.workers
    if bool(job["spec"].get("suspend")) != run.suspend and not job_finished(job):
        changes["suspend"] = run.suspend
    if changes:
        job = kube.patch_job(ns, name, {"spec": changes})
        rc.event("Normal", "JobUpdated", f"Job {name}: {changes}")
    return job


def _update_kueue_job(rc: Reconcile, run: BatchRunSpec, job: dict[str, Any]) -> dict[str, Any]:
    """A spec change on a Job Kueue admits: never its suspend (Kueue's) nor its pod
    template (Kueue injects node selectors into it). Workers change only while the Job is
    suspended (Kueue sets the parallelism of an admitted one: partial admission); the
    WorkloadPriorityClass label may change at any time (Kueue re-reads it)."""
    meta = job["metadata"]
    patch: dict[str, Any] = {}
    if (job["spec"].get("suspend") and job["spec"].get("parallelism") != run.workers
            and not job_finished(job)):
        patch["spec"] = {"parallelism": run.workers}
    label = (meta.get("labels") or {}).get(kueue.PRIORITY_CLASS_LABEL)
    if label != run.priority_class:
        patch["metadata"] = {"labels": {kueue.PRIORITY_CLASS_LABEL: run.priority_class}}
    if patch:
        job = kube.patch_job(meta["namespace"], meta["name"], patch)
        rc.event("Normal", "JobUpdated", f"Job {meta['name']}: {patch}")
    return job


def _worker_health(rc: Reconcile, job: dict[str, Any]) -> pods.PodProblem | None:
    """WorkersHealthy from the Job's pods; the problem that should fail the run, if any."""
    found = pods.job_pods(rc.namespace, job["metadata"]["name"])
    if found is None:
        return None
    health = pods.classify(found)
    previous = rc.previous("WorkersHealthy")
    problem = health.problem
    if problem is None:
        if health.any_started:
            rc.condition("WorkersHealthy", True, "WorkersStarted", "worker containers started")
        return None
    message = safe(problem.describe())
    rc.condition("WorkersHealthy", False, problem.reason, message)
    if not previous or previous.get("status") != "False" or previous.get("reason") != (
            problem.reason):
        rc.event("Warning", problem.reason, message)
    waited = pods.stuck_for(rc.previous("WorkersHealthy"), dt.datetime.now(dt.UTC))
    if not health.any_started and waited >= pods.START_TIMEOUT:
        return problem
    return None


def _stop_job(job: dict[str, Any], workload: dict[str, Any] | None) -> None:
    """Stop the workers of a Job whose pods can never start: its pods go, the run has
    failed. A Job Kueue admits is not suspended by the controller (Kueue would unsuspend
    it, or count it as stopped by the user): its Workload is deactivated instead, and
    Kueue suspends the Job and frees its quota."""
    meta = job["metadata"]
    try:
        if kueue.managed(job):
            if workload is not None:
                kueue.set_active(meta["namespace"], workload["metadata"]["name"], False)
        else:
            kube.patch_job(meta["namespace"], meta["name"], {"spec": {"suspend": True}})
    except ApiError as exc:
        log.warning("could not stop the workers of Job %s: HTTP %s", meta["name"], exc.status)


def _milestone_events(rc: Reconcile, counts: dict[str, int], phase: str, message: str) -> None:
    milestones = rc.milestones
    if counts["done"] and not milestones.get("firstTaskDone"):
        milestones["firstTaskDone"] = True
        rc.event("Normal", "FirstTaskDone", "the first task finished")
    if phase == "Reducing" and not milestones.get("reducing"):
        milestones["reducing"] = True
        rc.event("Normal", "Reducing", message)
    if counts["dead"] > int(milestones.get("deadTasks") or 0):
        rc.event("Warning", "DeadTasks", f"{counts['dead']} task(s) are dead")
        milestones["deadTasks"] = counts["dead"]
    if phase in TERMINAL and not milestones.get("finished"):
        milestones["finished"] = True
        rc.event("Normal" if phase == "Succeeded" else "Warning", phase, message)
