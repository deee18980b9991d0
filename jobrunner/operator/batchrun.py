"""kopf handlers for BatchRun. Small functions; the state lives in the resource's status.

create/resume/update and a periodic timer all converge the run with `reconcile`, which
is idempotent: enqueue is keyed on (batch, task key), the Job name is derived from the
BatchRun's name and uid, status is patched only where it changed.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import kopf

from jobrunner.features import generators
from jobrunner.features import reduce as reduce_step
from jobrunner.features.manifest import BatchRunSpec, parse_batchrun
from jobrunner.features.results import top_errors_status
from jobrunner.model.errors import BadInput, UnknownBatch
from jobrunner.model.redact import redact_text
from jobrunner.operator import batchrun_pools as pool_runs
from jobrunner.operator import flowcontrol, kube, metrics, pods
from jobrunner.operator.config import CONFIG, GROUP, PLURAL, VERSION
from jobrunner.operator.database import DatabaseProblem, queue_for, read_dsn
from jobrunner.operator.jobs import api_error_detail, build_job, default_batch_id, job_name
from jobrunner.operator.kube import ApiError, plain
from jobrunner.operator.sources import SourceUnavailable, config_map_source
from jobrunner.operator.status import (
    TERMINAL,
    get_condition,
    now_iso,
    run_conditions,
    set_condition,
)

log = logging.getLogger("jobrunner.controller")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress and the diff base go to annotations of our own prefix; status
    # holds only what the CRD declares (kopf would otherwise write status.kopf).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="jobrunner.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="jobrunner.dev", key="last-handled-configuration")
    settings.persistence.finalizer = "jobrunner.dev/cancel-pending-tasks"
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
    return parse_batchrun(plain(obj), source=f"BatchRun {body.metadata.namespace}/"
                          f"{body.metadata.name}")


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
    batch_id = (status or {}).get("batchId")
    if not batch_id:
        return
    try:
        run = _parse(body)
        secret, key = _db_secret(run)
        with queue_for(read_dsn(ns, secret, key)) as queue:
            cancelled = queue.cancel(batch_id)
    except UnknownBatch:
        return
    except (DatabaseProblem, BadInput) as exc:
        if retry >= CONFIG.delete_retries:
            _event(body, "Warning", "CancelFailed", message=_safe(
                f"gave up cancelling the pending tasks of batch {batch_id} after {retry + 1} "
                f"attempts ({exc}); cancel them with `jobrunner cancel --batch {batch_id}`"))
            return
        raise kopf.TemporaryError(_safe(str(exc)), delay=3) from None
    _event(body, "Normal", "Cancelled",
              message=f"BatchRun deleted: {cancelled} pending task(s) of batch {batch_id} "
                      "cancelled")


def _event(body: kopf.Body, type_: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event (explicit: kopf.info/warn would obey the log posting level)."""
    kopf.event(body, type=type_, reason=reason, message=_safe(message)[:1024])


def _safe(text: str) -> str:
    return redact_text(text)


def reconcile(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch, retry: int) -> None:
    meta = body.metadata
    ns, name, uid = meta.namespace, meta.name, meta.uid
    generation = meta.get("generation")
    conditions: list[dict[str, Any]] = list(st.get("conditions") or [])
    milestones: dict[str, Any] = dict(st.get("milestones") or {})
    new: dict[str, Any] = {}

    if st.get("phase") in TERMINAL:
        if st.get("observedGeneration") != generation:
            patch.status["observedGeneration"] = generation
        if (st.get("counts") or {}).get("leased"):
            _settle_leases(body, st, patch)
        return

    try:
        run = _parse(body)
    except BadInput as exc:
        conditions = set_condition(conditions, "Failed", True, "InvalidSpec", str(exc), generation)
        _apply(patch, st, {"phase": "Failed", "message": str(exc), "conditions": conditions,
                           "observedGeneration": generation})
        _event(body, "Warning", "InvalidSpec", message=str(exc))
        raise kopf.PermanentError(str(exc)) from None

    batch_id = st.get("batchId") or run.batch_id or default_batch_id(ns, name, uid)
    new["batchId"] = batch_id
    secret, key = _db_secret(run)
    tasks = run.tasks
    if run.config_map is not None and not milestones.get("enqueued"):
        tasks = _read_config_map(body, st, patch, run, conditions, milestones, new, generation)

    pool_name = None
    if run.pool is not None:
        new["pool"] = pool_runs.queue_pool(ns, run.pool)
        pool_name = pool_runs.admit(body, st, patch, run, conditions, milestones, new,
                                    generation, (secret, key))
    deadline_hit = False
    try:
        dsn = read_dsn(ns, secret, key)
        with queue_for(dsn) as queue:
            if not milestones.get("enqueued"):
                try:
                    flowcontrol.check_limits(queue, run)
                    message = _enqueue(queue, run, batch_id, tasks, pool_name)
                except BadInput as exc:
                    _refuse(body, st, patch, conditions, new, exc, generation)
                milestones["enqueued"] = True
                conditions = set_condition(conditions, "Enqueued", True, "Enqueued", message,
                                           generation)
                _event(body, "Normal", "Enqueued", message=message)
            queue.expire()  # rescue leases of dead pods even if no worker is left alive
            if pool_name is not None:
                deadline_hit = pool_runs.enforce_deadline(queue, run, st, batch_id)
            # The reduce, if the batch settled and no worker enqueued it yet (the trigger
            # is idempotent: any number of callers enqueue it once).
            reduce = reduce_step.trigger(queue.conn, batch_id)
            counts = queue.counts(batch_id)
            counts["stuck"] = queue.health(batch_id)["stuck"]
            gen = (generators.state(queue.conn, batch_id) if run.generator is not None
                   else None)
            new.update(_outcome_status(queue, st, batch_id, counts, reduce))
            new["budget"] = flowcontrol.apply_budget(queue, run, st, batch_id)
            flow = flowcontrol.observe(queue, run, st, batch_id)
            new.update(flow.status)
    except DatabaseProblem as problem:
        _database_problem(body, st, patch, conditions, milestones, new, problem, generation)
        raise kopf.TemporaryError(_safe(str(problem)),
                                  delay=min(60, 5 * 2 ** min(retry, 4))) from None
    except UnknownBatch:
        message = (f"waiting for tasks: enqueue them under batch {batch_id} "
                   f"(jobrunner enqueue --batch {batch_id} …)")
        conditions = set_condition(conditions, "Enqueued", False, "WaitingForTasks", message,
                                   generation)
        conditions = set_condition(conditions, "Reconciling", True, "WaitingForTasks", message,
                                   generation)
        _apply(patch, st, {**new, "phase": "Pending", "conditions": conditions,
                           "observedGeneration": generation, "milestones": milestones})
        raise kopf.TemporaryError(message, delay=10) from None

    counts["total"] = sum(counts[s] for s in ("pending", "leased", "done", "dead", "cancelled"))
    if pool_name is not None:
        # No Job: the pool's Deployment runs the workers; the phase comes from the queue.
        new["activeDeadlineSeconds"] = run.effective_deadline()
        new["activeDeadlineSource"] = ("spec" if run.active_deadline is not None
                                       else "default: max(1 day, 3 x visibilityTimeoutSeconds"
                                            " + 60)")
        new["startTime"] = st.get("startTime") or now_iso()
        phase, reason, message = pool_runs.phase(run, counts, batch_id, reduce, deadline_hit,
                                                 pool_name, _phase_of)
        _finish(body, st, patch, new, conditions, milestones, phase, reason, message, counts,
                generation, flow)
        return
    job = _ensure_job(body, run, st, batch_id, secret, key)
    new["jobName"] = job["metadata"]["name"]
    new["activeDeadlineSeconds"] = job["spec"].get("activeDeadlineSeconds")
    new["activeDeadlineSource"] = ("spec" if run.active_deadline is not None
                                   else "default: max(1 day, 3 x visibilityTimeoutSeconds + 60)")
    new["startTime"] = st.get("startTime") or now_iso()
    if gen is not None and gen.configured:
        new["generator"] = _generator_status(gen, counts)
        conditions = _generator_condition(body, conditions, milestones, gen, counts, generation)
    phase, reason, message = _phase(run, job, counts, batch_id, reduce, gen)
    if phase == "Running":
        conditions, stuck = _worker_health(body, job, conditions, generation)
        if stuck is not None:
            phase, reason = "Failed", stuck.reason
            message = (f"{_safe(stuck.describe())}; no worker started in "
                       f"{pods.START_TIMEOUT:g}s. {message}. Unfinished tasks stay in the queue: "
                       "retry with a new BatchRun with source: {external: {}} and batchId "
                       f"{batch_id}")
            _stop_job(job)
    _finish(body, st, patch, new, conditions, milestones, phase, reason, message, counts,
            generation, flow)


def _finish(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch, new: dict[str, Any],
            conditions: list[dict[str, Any]], milestones: dict[str, Any], phase: str,
            reason: str, message: str, counts: dict[str, int], generation: int,
            flow: Any) -> None:
    """The phase's conditions, Events, status and metrics: the same for a run on its own
    Job and a run in a WorkerPool."""
    ns, name = body.metadata.namespace, body.metadata.name
    phase, reason, message = flowcontrol.budget_phase(phase, reason, message, flow, counts,
                                                      name)
    conditions, budget_event = flowcontrol.budget_condition(conditions, phase, message, flow,
                                                            generation)
    if budget_event:
        _event(body, *budget_event)
    new.update(phase=phase, counts=counts, message=message, observedGeneration=generation)
    if phase in TERMINAL:
        new["completionTime"] = st.get("completionTime") or now_iso()
    conditions = run_conditions(conditions, phase, reason, message, counts, generation)
    _milestone_events(body, milestones, counts, phase, message)
    new["milestones"] = milestones
    new["conditions"] = conditions
    _apply(patch, st, new)
    metrics.record(ns, name, phase, counts)
    flowcontrol.record_metrics(ns, name, flow)


def _settle_leases(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch) -> None:
    """A run that ended with tasks still leased (pods killed by the deadline): keep
    rescuing and counting until their leases expired, so status shows where they went."""
    try:
        run = _parse(body)
        secret, key = _db_secret(run)
        with queue_for(read_dsn(body.metadata.namespace, secret, key)) as queue:
            queue.expire()
            counts = queue.counts(st["batchId"])
            counts["stuck"] = queue.health(st["batchId"])["stuck"]
    except (DatabaseProblem, BadInput):
        return
    counts["total"] = sum(counts[s] for s in ("pending", "leased", "done", "dead", "cancelled"))
    _apply(patch, st, {"counts": counts})


def _read_config_map(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch,
                     run: BatchRunSpec, conditions: list[dict[str, Any]],
                     milestones: dict[str, Any], new: dict[str, Any], generation: int) -> Any:
    """The tasks of source.configMap. A bad line fails the run (nothing is enqueued: every
    line is checked first); a ConfigMap that cannot be read yet keeps it Pending."""
    ns, name = body.metadata.namespace, body.metadata.name
    try:
        return config_map_source(ns, run, f"BatchRun {ns}/{name}")
    except BadInput as exc:
        message = _safe(f"{exc}; nothing was enqueued")
        conditions = set_condition(conditions, "Enqueued", False, "InvalidSource", message,
                                   generation)
        conditions = set_condition(conditions, "Failed", True, "InvalidSource", message,
                                   generation)
        conditions = set_condition(conditions, "Stalled", True, "InvalidSource", message,
                                   generation)
        conditions = set_condition(conditions, "Reconciling", False, "InvalidSource", message,
                                   generation)
        _apply(patch, st, {**new, "phase": "Failed", "message": message,
                           "conditions": conditions, "observedGeneration": generation,
                           "completionTime": now_iso()})
        _event(body, "Warning", "InvalidSource", message=message)
        raise kopf.PermanentError(message) from None
    except SourceUnavailable as exc:
        message = _safe(str(exc))
        previous = get_condition(conditions, "Enqueued")
        conditions = set_condition(conditions, "Enqueued", False, exc.reason, message, generation)
        conditions = set_condition(conditions, "Reconciling", True, exc.reason, message,
                                   generation)
        _apply(patch, st, {**new, "phase": "Pending", "message": message,
                           "conditions": conditions, "observedGeneration": generation,
                           "milestones": milestones})
        if not previous or previous.get("reason") != exc.reason:
            _event(body, "Warning", exc.reason, message=message)
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
    options = ({"pool": pool, "priority": run.priority, "handler": run.handler} if pool
               else flowcontrol.enqueue_options(run))
    result = queue.enqueue(batch_id, run.tenant, tasks, max_attempts=run.max_attempts,
                           reduce=run.reduce.as_json() if run.reduce else None, **options)
    return (f"batch {batch_id}: {result.new} task(s) enqueued{into}"
            + (f", {result.existing} already there" if result.existing else "") + reduce
            + limits)


def _refuse(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch,
            conditions: list[dict[str, Any]], new: dict[str, Any], exc: BadInput,
            generation: int) -> None:
    """The queue refused the run's tasks (an unknown limit, a cancelled batch, ...):
    nothing was written; the run fails with the reason, for good."""
    message = _safe(str(exc))
    reason = "UnknownLimit" if isinstance(exc, flowcontrol.UnknownLimit) else "EnqueueRefused"
    conditions = set_condition(conditions, "Enqueued", False, reason, message, generation)
    conditions = run_conditions(conditions, "Failed", reason, message, {}, generation)
    _apply(patch, st, {**new, "phase": "Failed", "message": message, "conditions": conditions,
                       "observedGeneration": generation,
                       "completionTime": st.get("completionTime") or now_iso()})
    _event(body, "Warning", reason, message=message)
    metrics.record(body.metadata.namespace, body.metadata.name, "Failed", {})
    raise kopf.PermanentError(message)


def _outcome_status(queue: Any, st: dict[str, Any], batch_id: str, counts: dict[str, int],
                    reduce: reduce_step.ReduceState | None) -> dict[str, Any]:
    """What the run produced, for `kubectl describe`: the reduce's state, the batch's result
    (at most 4 KiB; else where it is) and the most frequent errors of dead tasks (a dead
    reduce task among them). Each read only when it can have changed."""
    new: dict[str, Any] = {}
    if reduce is not None and reduce.configured:
        new["reduce"] = {k: v for k, v in {
            "state": reduce.phase(counts), "step": reduce.spec.describe() if reduce.spec else None,
            "onDead": reduce.spec.on_dead if reduce.spec else None,
            "attempts": reduce.attempts,
            "error": (reduce.last_error or "")[:1000] if reduce.task_status == "dead" else None,
            "resultBytes": reduce.result_bytes}.items() if v is not None}
        if reduce.reduced and "result" not in st:
            found, value = reduce_step.status_result(queue.conn, batch_id)
            if found:
                new["result"] = value
    failed_reduce = reduce is not None and reduce.task_status == "dead"
    # (read again only when the dead tasks or the reduce's state changed)
    changed = ((st.get("counts") or {}).get("dead") != counts["dead"]
               or (st.get("reduce") or {}).get("state") != (new.get("reduce") or {}).get("state"))
    if (counts["dead"] or failed_reduce) and (changed or not st.get("topErrors")):
        new["topErrors"] = top_errors_status(queue.conn, batch_id)
    return new


def _generator_status(gen: generators.GeneratorState, counts: dict[str, int]) -> dict[str, Any]:
    """status.generator: its state, the tasks enqueued so far (the batch's tasks: all of
    them come from it), attempts, and the last error when it failed."""
    return {k: v for k, v in {
        "state": gen.phase(), "step": gen.spec.describe() if gen.spec else None,
        "enqueued": sum(counts[s] for s in ("pending", "leased", "done", "dead", "cancelled")),
        "attempts": gen.attempts,
        "error": _safe((gen.last_error or "")[:1000]) if gen.last_error else None,
    }.items() if v is not None}


def _generator_condition(body: kopf.Body, conditions: list[dict[str, Any]],
                         milestones: dict[str, Any], gen: generators.GeneratorState,
                         counts: dict[str, int], generation: int) -> list[dict[str, Any]]:
    """Condition Generated: Unknown while it waits or runs (reason Pending, Running),
    True once it finished (Finished), False when it failed for good (Failed: its error) or
    was cancelled; an Event when it finishes or fails."""
    phase = gen.phase()
    total = sum(counts[s] for s in ("pending", "leased", "done", "dead", "cancelled"))
    message = _safe(gen.describe())
    if phase == "Failed":
        message = _safe(f"{message}; the {total} task(s) it enqueued are kept and run")
    status = {"Finished": True, "Failed": False, "Cancelled": False}.get(phase)
    conditions = set_condition(conditions, "Generated", status, phase, message[:2000],
                               generation)
    if phase == "Finished" and not milestones.get("generated"):
        milestones["generated"] = True
        _event(body, "Normal", "Generated", message=f"{message}; {total} task(s) enqueued")
    if phase == "Failed" and not milestones.get("generatorFailed"):
        milestones["generatorFailed"] = True
        _event(body, "Warning", "GeneratorFailed", message=message)
    return conditions


def _database_problem(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch,
                      conditions: list[dict[str, Any]], milestones: dict[str, Any],
                      new: dict[str, Any], problem: DatabaseProblem, generation: int) -> None:
    message = _safe(str(problem))
    kind = "Progressing" if milestones.get("enqueued") else "Enqueued"
    previous = get_condition(conditions, kind)
    conditions = set_condition(conditions, kind, False if kind == "Enqueued" else None,
                               problem.reason, message, generation)
    # kstatus: still in progress (not healthy, not failed) while the database is away.
    conditions = set_condition(conditions, "Reconciling", True, problem.reason, message,
                               generation)
    _apply(patch, st, {**new, "phase": st.get("phase") or "Pending", "message": message,
                       "conditions": conditions, "observedGeneration": generation,
                       "milestones": milestones})
    metrics.RECONCILE_ERRORS.labels(problem.reason).inc()
    if not previous or previous.get("reason") != problem.reason:
        _event(body, "Warning", problem.reason, message=message)


def _ensure_job(body: kopf.Body, run: BatchRunSpec, st: dict[str, Any], batch_id: str,
                secret: str, key: str) -> dict[str, Any]:
    """Exactly one Job per BatchRun, ever: a deterministic name, create-or-read."""
    ns, name = body.metadata.namespace, job_name(body.metadata.name, body.metadata.uid)
    try:
        job = kube.read_job(ns, name)
    except ApiError as exc:
        if exc.status != 404:
            raise kopf.TemporaryError(f"reading Job {name}: HTTP {exc.status}", delay=5) from None
        if st.get("jobName"):
            raise kopf.PermanentError(f"Job {name} was deleted while the run was active"
                                      ) from None
        manifest = build_job(run, name=name, namespace=ns, batch_id=batch_id,
                             secret_name=secret, secret_key=key)
        kopf.adopt(manifest, owner=body)
        try:
            job = kube.create_job(ns, manifest)
            _event(body, "Normal", "JobCreated",
                      message=f"Job {name}: {run.workers} worker(s), activeDeadlineSeconds "
                              f"{run.effective_deadline()}")
        except ApiError as create_exc:
            if create_exc.status == 422:
                # The API server refused the pod (spec.template passes volumes, affinity,
                # containers... through unchecked): say what it objected to. Retrying cannot
                # help until the spec changes, and a spec change runs this handler again.
                message = _safe(f"Job {name} rejected: {api_error_detail(create_exc)}")
                _event(body, "Warning", "JobRejected", message=message)
                raise kopf.TemporaryError(message, delay=30) from None
            if create_exc.status != 409:
                raise kopf.TemporaryError(_safe(f"creating Job {name}: HTTP {create_exc.status} "
                                                f"{api_error_detail(create_exc)}"),
                                          delay=5) from None
            job = kube.read_job(ns, name)
        return job
    changes: dict[str, Any] = {}
    if job["spec"].get("parallelism") != run.workers:
        changes["parallelism"] = run.workers
    if bool(job["spec"].get("suspend")) != run.suspend and not _job_finished(job):
        changes["suspend"] = run.suspend
    if changes:
        job = kube.patch_job(ns, name, {"spec": changes})
        _event(body, "Normal", "JobUpdated", message=f"Job {name}: {changes}")
    return job


def _worker_health(body: kopf.Body, job: dict[str, Any], conditions: list[dict[str, Any]],
                   generation: int) -> tuple[list[dict[str, Any]], pods.PodProblem | None]:
    """WorkersHealthy from the Job's pods; the problem that should fail the run, if any."""
    found = pods.job_pods(body.metadata.namespace, job["metadata"]["name"])
    if found is None:
        return conditions, None
    health = pods.classify(found)
    previous = get_condition(conditions, "WorkersHealthy")
    problem = health.problem
    if problem is None:
        if health.any_started:
            conditions = set_condition(conditions, "WorkersHealthy", True, "WorkersStarted",
                                       "worker containers started", generation)
        return conditions, None
    message = _safe(problem.describe())
    conditions = set_condition(conditions, "WorkersHealthy", False, problem.reason, message,
                               generation)
    if not previous or previous.get("status") != "False" or previous.get("reason") != (
            problem.reason):
        _event(body, "Warning", problem.reason, message=message)
    waited = pods.stuck_for(get_condition(conditions, "WorkersHealthy"),
                            dt.datetime.now(dt.UTC))
    if not health.any_started and waited >= pods.START_TIMEOUT:
        return conditions, problem
    return conditions, None


def _stop_job(job: dict[str, Any]) -> None:
    """Suspend a Job whose pods can never start: its pods go, the run has failed."""
    meta = job["metadata"]
    try:
        kube.patch_job(meta["namespace"], meta["name"], {"spec": {"suspend": True}})
    except ApiError as exc:
        log.warning("could not suspend Job %s: HTTP %s", meta["name"], exc.status)


def _job_finished(job: dict[str, Any]) -> tuple[str, str, str] | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return cond["type"], cond.get("reason") or cond["type"], cond.get("message") or ""
    return None


def _phase(run: BatchRunSpec, job: Any, counts: dict[str, int], batch_id: str,
           reduce: reduce_step.ReduceState | None = None,
           gen: generators.GeneratorState | None = None) -> tuple[str, str, str]:
    return _phase_of(run, _job_finished(job), counts, batch_id, reduce, gen)


def _phase_of(run: BatchRunSpec, finished: tuple[str, str, str] | None,
              counts: dict[str, int], batch_id: str,
              reduce: reduce_step.ReduceState | None = None,
              gen: generators.GeneratorState | None = None) -> tuple[str, str, str]:
    """The phase from how the workers ended (a Job's condition, or for a run in a pool
    the queue having nothing left for it) and the queue's counts."""
    summary = (f"{counts['done']}/{counts['total']} done, {counts['dead']} dead, "
               f"{counts['leased']} running, {counts['pending']} pending")
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
        return "Running", "Running", _safe(f"{summary}; {gen.describe()}")
    return "Running", "Running", summary



def _milestone_events(body: kopf.Body, milestones: dict[str, Any], counts: dict[str, int],
                      phase: str, message: str) -> None:
    if counts["done"] and not milestones.get("firstTaskDone"):
        milestones["firstTaskDone"] = True
        _event(body, "Normal", "FirstTaskDone", message="the first task finished")
    if phase == "Reducing" and not milestones.get("reducing"):
        milestones["reducing"] = True
        _event(body, "Normal", "Reducing", message=message)
    if counts["dead"] > int(milestones.get("deadTasks") or 0):
        _event(body, "Warning", "DeadTasks", message=f"{counts['dead']} task(s) are dead")
        milestones["deadTasks"] = counts["dead"]
    if phase in TERMINAL and not milestones.get("finished"):
        milestones["finished"] = True
        _event(body, "Normal" if phase == "Succeeded" else "Warning", phase, message)


def _apply(patch: kopf.Patch, current: dict[str, Any], new: dict[str, Any]) -> None:
    """Patch only what changed: re-applying a manifest, or a quiet refresh, writes nothing."""
    for field, value in new.items():
        if current.get(field) != value:
            patch.status[field] = value
