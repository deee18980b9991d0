"""BatchRuns under Kueue (docs/kueue.md): the real Kueue (built from its Go module by
tests/e2e/harness/build.py) admitting the runs' Jobs on the real cluster, with its
webhooks; the queue on a real PostgreSQL, which is the witness of what ran and how often.

Kueue is started for this file's tests only (a module fixture) and manages only the
namespaces they label (tests/e2e/harness/kueue.py), so it runs beside the other tests
of a shared cluster without touching them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from .operator_support import Controller, apply, apply_crds, batchrun, create_db_secret, get

FAST = {"visibilityTimeoutSeconds": 20, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}
# Each worker asks for this much CPU: the ClusterQueues below hold one or two of them.
WORKER_CPU = "100m"
LOW, HIGH = "jobrunner-e2e-low", "jobrunner-e2e-high"


@pytest.fixture(scope="module")
def kueue(k8s, tmp_path_factory):
    from .harness.kueue import Kueue

    kq = Kueue(k8s, tmp_path_factory.mktemp("kueue")).start()
    print(f"Kueue ready in {kq.started_in:.1f}s")
    classes = [{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                "metadata": {"name": name}, "value": value,
                "description": "jobrunner e2e"} for name, value in ((LOW, 10), (HIGH, 1000))]
    k8s.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(c) for c in classes))
    yield kq
    kq.stop()


class Queues:
    """A ResourceFlavor, a ClusterQueue of `cpu` and a LocalQueue `q` for one test."""

    def __init__(self, k8s, namespace: str) -> None:
        self.k8s, self.namespace = k8s, namespace
        self.cluster_queue = f"cq-{namespace}"

    def make(self, cpu: str, preempt: bool = False) -> str:
        flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                  "metadata": {"name": f"f-{self.namespace}"}}
        cq: dict[str, Any] = {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
            "metadata": {"name": self.cluster_queue},
            "spec": {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": self.namespace}},
                "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [{
                    "name": f"f-{self.namespace}",
                    "resources": [{"name": "cpu", "nominalQuota": cpu}]}]}]}}
        if preempt:
            cq["spec"]["preemption"] = {"withinClusterQueue": "LowerPriority"}
        lq = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
              "metadata": {"name": "q", "namespace": self.namespace},
              "spec": {"clusterQueue": self.cluster_queue}}
        self.k8s.kubectl("apply", "-f", "-",
                         input="\n---\n".join(json.dumps(d) for d in (flavor, cq, lq)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # (a LocalQueue is usable once it is Active)
            lq_now = get(self.k8s, "localqueue", "q", self.namespace) or {}
            if any(c["type"] == "Active" and c["status"] == "True"
                   for c in (lq_now.get("status") or {}).get("conditions") or []):
                return "q"
            time.sleep(0.5)
        raise AssertionError(f"LocalQueue q never became Active: {lq_now}")

    def delete(self) -> None:
        for kind, name in (("clusterqueue", self.cluster_queue),
                           ("resourceflavor", f"f-{self.namespace}")):
            self.k8s.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found",
                             check=False)


@pytest.fixture
def queues(k8s, kueue, namespace):
    kueue.manage(namespace)
    q = Queues(k8s, namespace)
    yield q
    q.delete()


@pytest.fixture
def controller(k8s, namespace, dsn, tmp_path, queues):
    """The controller as the chart runs it with kueue.enabled (its Workload RBAC)."""
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    c = Controller(k8s, namespace, tmp_path / "controller.log",
                   values=("kueue.enabled=true",)).start()
    yield c
    c.stop()


def spec(queue: str, tasks: int, sleep: float, **more: Any) -> dict[str, Any]:
    template = more.pop("template", {})
    return {"tenant": "t", "handler": "tests.support.handlers:record", "queueName": queue,
            "shards": [{"key": f"k{i}", "payload": {"sleep": sleep}} for i in range(tasks)],
            "template": {"resources": {"requests": {"cpu": WORKER_CPU}}, **template},
            **FAST, **more}


def status(k8s, name: str, namespace: str) -> dict[str, Any]:
    return (get(k8s, "batchrun", name, namespace) or {}).get("status") or {}


def wait_for(what: str, cond, timeout: float = 180, controller: Controller | None = None,
             show=None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(0.5)
    tail = controller.output()[-3000:] if controller else ""
    raise AssertionError(f"timed out waiting for {what}: {show() if show else last}\n{tail}")


def job_of(k8s, namespace: str, run: str) -> dict[str, Any] | None:
    name = status(k8s, run, namespace).get("jobName")
    return get(k8s, "job", name, namespace) if name else None


def pods_of_job(k8s, namespace: str, job: str) -> list[dict[str, Any]]:
    out = k8s.kubectl("get", "pods", "-n", namespace, "-l", f"job-name={job}", "-o",
                      "json").stdout
    return json.loads(out)["items"]


def reasons(k8s, namespace: str, run: str) -> list[str]:
    items = json.loads(k8s.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    return [e["reason"] for e in sorted(items["items"], key=lambda e: e["metadata"]
                                        ["creationTimestamp"])
            if e["involvedObject"]["kind"] == "BatchRun" and e["involvedObject"]["name"] == run]


def tasks(dsn: str, batch_id: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT task_key, status, attempts FROM agent_work_queue "
                            "WHERE batch_id = %s", (batch_id,)).fetchall()
    return {key: (st, attempts) for key, st, attempts in rows}


def executions(dsn: str, batch_id: str, keys: set[str]) -> list[tuple[str, int, str, bool]]:
    """(task key, attempt, worker, finished) of every execution the handler logged."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT e.task_key, e.attempt, e.worker, e.ended_at IS NOT NULL FROM exec_log e "
            "JOIN agent_work_queue q ON q.id = e.task_id "
            "WHERE q.batch_id = %s AND e.task_key = ANY(%s) ORDER BY e.started_at",
            (batch_id, sorted(keys))).fetchall()
    return [tuple(r) for r in rows]


def transcript(k8s, namespace: str, title: str) -> str:
    out = k8s.kubectl("get", "workloads,br,jobs,pods", "-n", namespace, "-o", "wide").stdout
    text = f"$ kubectl get workloads,br,jobs,pods -o wide   # {title}\n{out}\n"
    path = os.environ.get("JOBRUNNER_KUEUE_TRANSCRIPT")
    if path:
        with open(path, "a") as f:
            f.write(text)
    return text


# ------------------------------------------------------------------------------ the tests
def test_a_run_waits_for_quota_with_no_pod_then_runs(k8s, namespace, dsn, queues, controller):
    """Two runs in one queue of quota for one worker: the second stays Pending (Kueue's
    reason in its Admitted condition), its Job suspended and without a pod for as long as
    the first holds the quota, then runs to the end once the first finished."""
    q = queues.make(cpu=WORKER_CPU)
    # (18 s of work: long enough to still be running after the second run's Kueue status
    # is read, which took up to 5 s in a loaded CI run; 6 s of work once left 1 s)
    apply(k8s, namespace, batchrun("first", spec(q, tasks=6, sleep=3.0)))
    wait_for("first admitted", lambda: status(k8s, "first", namespace).get("phase")
             == "Running", controller=controller)
    apply(k8s, namespace, batchrun("second", spec(q, tasks=3, sleep=0)))
    # (Pending comes first as "waiting for quota", from a Workload Kueue has not tried yet;
    # its own reason follows once it has)
    st = wait_for("second pending for quota", lambda: (
        s if (a := (s := status(k8s, "second", namespace)).get("admission", {})).get("state")
        == "Pending" and "insufficient unused quota" in a.get("message", "") else None),
        controller=controller,
        show=lambda: status(k8s, "second", namespace))
    assert st["phase"] == "Pending" and st["admission"]["reason"] == "Pending", st
    assert st["admission"]["askedWorkers"] == 1 and st["admission"]["admittedWorkers"] == 0
    assert "insufficient unused quota for cpu" in st["admission"]["message"], st
    admitted = {c["type"]: c for c in st["conditions"]}["Admitted"]
    assert admitted["status"] == "False" and admitted["message"].startswith("Pending: "), admitted
    first_batch = status(k8s, "first", namespace)["batchId"]
    # While the first run's Job holds the quota (its tasks unfinished), the second's Job
    # stays suspended and has no pod at all.
    samples = 0
    while True:
        unfinished = [k for k, (s, _) in tasks(dsn, first_batch).items() if s != "done"]
        job = job_of(k8s, namespace, "second")
        if not unfinished:
            break
        assert job["spec"]["suspend"] is True, job["spec"]
        assert pods_of_job(k8s, namespace, job["metadata"]["name"]) == []
        samples += 1
        time.sleep(0.5)
    assert samples >= 3, "the first run finished before the second was sampled"
    st = wait_for("second succeeded", lambda: (
        s if (s := status(k8s, "second", namespace)).get("phase") == "Succeeded" else None),
        controller=controller, show=lambda: status(k8s, "second", namespace))
    assert st["counts"]["done"] == 3
    assert st["admission"]["clusterQueue"] == queues.cluster_queue
    assert {"QueuedByKueue", "Admitted"} <= set(reasons(k8s, namespace, "second"))
    assert reasons(k8s, namespace, "second").index("QueuedByKueue") < reasons(
        k8s, namespace, "second").index("Admitted")


def test_preemption_releases_the_tasks_and_the_run_completes_after_readmission(
        k8s, namespace, dsn, queues, controller):
    """A higher-priority run preempts a running one: Kueue suspends the lower run's Job,
    the run shows Suspended (SuspendedByKueue), its workers release their tasks on
    SIGTERM without using an attempt; it completes once Kueue admits it again. The
    database is the witness: every task done on its first attempt, and the execution cut
    by the preemption ran again under that same attempt."""
    q = queues.make(cpu=WORKER_CPU, preempt=True)
    # k0's first execution holds its worker (10 minutes) until the preemption stops it;
    # the pod grace of 3 s gives the worker 2 s, then it must release k0.
    shards = [{"key": "k0", "payload": {"sleep": 600}},
              *({"key": f"k{i}", "payload": {"sleep": 0.2}} for i in range(1, 5))]
    apply(k8s, namespace, batchrun("low", {
        **spec(q, tasks=0, sleep=0, priorityClassName=LOW,
               template={"terminationGracePeriodSeconds": 3}),
        "shards": shards, "handler": "tests.support.handlers:hold_first_execution"}))
    low_batch = wait_for("low running", lambda: (
        s["batchId"] if (s := status(k8s, "low", namespace)).get("phase") == "Running"
        and s.get("batchId") else None), controller=controller)
    wait_for("k0 of low in flight", lambda: any(
        k == "k0" for k, _, _, _ in executions(dsn, low_batch, {"k0"})), timeout=120,
        show=lambda: tasks(dsn, low_batch))
    assert tasks(dsn, low_batch)["k0"] == ("leased", 1)
    apply(k8s, namespace, batchrun("high", spec(q, tasks=2, sleep=0.5,
                                                priorityClassName=HIGH)))
    st = wait_for("low suspended by Kueue", lambda: (
        s if (s := status(k8s, "low", namespace)).get("phase") == "Suspended" else None),
        controller=controller, show=lambda: status(k8s, "low", namespace))
    assert st["admission"]["state"] == "Evicted" and st["admission"]["reason"] == "Preempted", st
    assert st["message"].startswith("Suspended by Kueue: Preempted"), st["message"]
    low_job = job_of(k8s, namespace, "low")
    assert low_job["spec"]["suspend"] is True
    wait_for("low's pods gone", lambda: not pods_of_job(k8s, namespace,
                                                        low_job["metadata"]["name"]))
    # Released, not failed nor left to expire: pending again, its attempt given back.
    assert tasks(dsn, low_batch)["k0"] == ("pending", 0), tasks(dsn, low_batch)
    transcript(k8s, namespace, "low preempted by high")
    high = wait_for("high succeeded", lambda: (
        s if (s := status(k8s, "high", namespace)).get("phase") == "Succeeded" else None),
        controller=controller, show=lambda: status(k8s, "high", namespace))
    assert high["counts"]["done"] == 2
    st = wait_for("low succeeded after re-admission", lambda: (
        s if (s := status(k8s, "low", namespace)).get("phase") == "Succeeded" else None),
        timeout=240, controller=controller, show=lambda: status(k8s, "low", namespace))
    assert st["counts"]["done"] == 5 and st["counts"]["dead"] == 0
    assert tasks(dsn, low_batch) == {f"k{i}": ("done", 1) for i in range(5)}
    runs = [(a, finished) for _, a, _, finished in executions(dsn, low_batch, {"k0"})]
    assert runs == [(1, False), (1, True)], runs  # cut once, then run again: attempt 1
    events = reasons(k8s, namespace, "low")
    assert "SuspendedByKueue" in events
    assert events.index("SuspendedByKueue") < len(events) - 1 - events[::-1].index("Admitted")
    transcript(k8s, namespace, "both runs done")


def test_partial_admission_finishes_with_fewer_workers(k8s, namespace, dsn, queues,
                                                        controller):
    """Quota for two workers, a run asking for four with minWorkers 2: Kueue admits it
    with two, status says 2 of 4, and those two drain the whole batch."""
    q = queues.make(cpu="200m")
    apply(k8s, namespace, batchrun("partial", spec(q, tasks=8, sleep=1.0, workers=4,
                                                   minWorkers=2)))
    st = wait_for("partially admitted", lambda: (
        s if (s := status(k8s, "partial", namespace)).get("admission", {}).get("state")
        == "Admitted" else None), controller=controller,
        show=lambda: status(k8s, "partial", namespace))
    assert st["admission"]["admittedWorkers"] == 2 and st["admission"]["askedWorkers"] == 4
    admitted = {c["type"]: c for c in st["conditions"]}["Admitted"]
    assert admitted["message"] == (f"Admitted by ClusterQueue {queues.cluster_queue}: 2 of 4 "
                                   "worker(s) (partial admission)"), admitted
    job = job_of(k8s, namespace, "partial")
    assert job["spec"]["parallelism"] == 2  # Kueue's, and the controller left it so
    st = wait_for("partial succeeded", lambda: (
        s if (s := status(k8s, "partial", namespace)).get("phase") == "Succeeded" else None),
        controller=controller, show=lambda: status(k8s, "partial", namespace))
    assert st["counts"]["done"] == 8
    workers = {w for _, _, w, _ in executions(dsn, st["batchId"], {f"k{i}" for i in range(8)})}
    assert 1 <= len(workers) <= 2, workers
    assert job_of(k8s, namespace, "partial")["spec"]["parallelism"] == 2


def test_pods_that_cannot_start_deactivate_the_workload_and_free_the_quota(
        k8s, namespace, dsn, tmp_path, queues):
    """A run in a queue whose worker image is missing fails after the pod-start timeout as
    without Kueue, but the controller stops its workers by deactivating the Job's Workload
    (Kueue suspends the Job and frees the quota), not by suspending the Job itself, which
    Kueue would take back. The quota is then free for the next run."""
    q = queues.make(cpu=WORKER_CPU)
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    c = Controller(k8s, namespace, tmp_path / "controller.log",
                   values=("kueue.enabled=true",),
                   JOBRUNNER_POD_START_TIMEOUT_SECONDS="8").start()
    try:
        apply(k8s, namespace, batchrun("no-image", spec(
            q, tasks=2, sleep=0,
            template={"image": "jobrunner:no-such-tag", "imagePullPolicy": "Never"})))
        st = wait_for("no-image failed", lambda: (
            s if (s := status(k8s, "no-image", namespace)).get("phase") == "Failed"
            else None), controller=c, show=lambda: status(k8s, "no-image", namespace))
        assert {x["type"]: x for x in st["conditions"]}["Failed"]["reason"] == \
            "ErrImageNeverPull"
        workload = st["admission"]["workload"]
        wait_for("the Workload deactivated and evicted", lambda: (
            (w := get(k8s, "workload", workload, namespace) or {})["spec"].get("active")
            is False and any(x["type"] == "Evicted" and x["status"] == "True"
                             and x["reason"] == "Deactivated"
                             for x in (w.get("status") or {}).get("conditions") or [])),
            show=lambda: get(k8s, "workload", workload, namespace))
        job = job_of(k8s, namespace, "no-image")
        wait_for("its pods gone", lambda: not pods_of_job(k8s, namespace,
                                                          job["metadata"]["name"]))
        assert job_of(k8s, namespace, "no-image")["spec"]["suspend"] is True
        # (the controller's JobUpdated Events would show a suspend it wrote)
        assert "JobUpdated" not in reasons(k8s, namespace, "no-image")
        assert tasks(dsn, st["batchId"]) == {"k0": ("pending", 0), "k1": ("pending", 0)}
        apply(k8s, namespace, batchrun("next", spec(q, tasks=1, sleep=0)))
        wait_for("the next run admitted and done", lambda: status(
            k8s, "next", namespace).get("phase") == "Succeeded", controller=c,
            show=lambda: status(k8s, "next", namespace))
    finally:
        c.stop()


def test_kueue_values_render_the_workload_rbac_and_default_queues(k8s):
    chart = Path(__file__).resolve().parents[2] / "charts" / "jobrunner"
    import yaml

    docs = [d for d in yaml.safe_load_all(k8s.helm(
        "template", "jr", str(chart), "--set", "watch.namespaces={a}",
        "--set", "kueue.enabled=true", "--set", "kueue.defaultQueueNames.a=team-a").stdout) if d]
    # a's rules: a ClusterRole its RoleBinding binds (a is not the release namespace)
    (role,) = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"],
            "verbs": ["get", "list", "watch", "patch"]} in role["rules"]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in
           deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["JOBRUNNER_KUEUE_DEFAULT_QUEUES"]) == {"a": "team-a"}
    docs = [d for d in yaml.safe_load_all(k8s.helm(
        "template", "jr", str(chart), "--set", "watch.namespaces={a}").stdout) if d]
    (role,) = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert not any("kueue.x-k8s.io" in r["apiGroups"] for r in role["rules"])
    r = k8s.helm("template", "jr", str(chart), "--set", "kueue.defaultQueueNames.a=Bad_Q",
                 check=False)
    assert r.returncode != 0 and "/kueue/defaultQueueNames/a" in r.stderr, r.stderr


def test_worker_pool_scaled_out_beyond_quota_waits_for_admission(
        k8s, namespace, dsn, tmp_path, queues):
    """A WorkerPool in a queue of quota for one worker: a scale-out to three leaves two
    pods gated by Kueue (status.queuedReplicas 2), the admitted one drains the pool's run
    anyway, and scaling in to zero frees the quota (another run's Job is admitted)."""
    from .test_worker_pool_e2e import workerpool

    q = queues.make(cpu=WORKER_CPU)
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    c = Controller(k8s, namespace, tmp_path / "controller.log",
                   values=("kueue.enabled=true",), JOBRUNNER_POOL_SCALE_SECONDS="1").start()
    try:
        apply(k8s, namespace, workerpool("pool", {
            "handlers": ["tests.support.handlers:record"], "minReplicas": 0,
            "maxReplicas": 3, "targetTasksPerReplica": 1,
            "scaleDownStabilizationWindowSeconds": 2, "queueName": q,
            "template": {"resources": {"requests": {"cpu": WORKER_CPU}}}, **FAST}))
        apply(k8s, namespace, batchrun("in-pool", {
            "tenant": "t", "pool": "pool", "handler": "tests.support.handlers:record",
            "shards": [{"key": f"k{i}", "payload": {"sleep": 1.0}} for i in range(6)]},
            test_handlers=False))  # (the pool's pods have them)
        pool = wait_for("two workers queued", lambda: (
            p if ((p := get(k8s, "workerpool", "pool", namespace) or {}).get("status") or {})
            .get("queuedReplicas") == 2 else None), controller=c,
            show=lambda: (get(k8s, "workerpool", "pool", namespace) or {}).get("status"))
        assert pool["status"]["desiredReplicas"] == 3
        admitted = {x["type"]: x for x in pool["status"]["conditions"]}["Admitted"]
        assert admitted["status"] == "False" and admitted["reason"] == "WaitingForAdmission"
        pods = json.loads(k8s.kubectl("get", "pods", "-n", namespace, "-l",
                                      "jobrunner.dev/workerpool=pool", "-o", "json").stdout)
        gated = [p for p in pods["items"] if p["spec"].get("schedulingGates")]
        assert len(gated) == 2 and all(p["status"].get("phase") == "Pending" for p in gated)
        assert all(p["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") == q
                   for p in pods["items"])
        wait_for("the pool's run succeeded", lambda: status(k8s, "in-pool", namespace)
                 .get("phase") == "Succeeded", controller=c,
                 show=lambda: status(k8s, "in-pool", namespace))
        with psycopg.connect(dsn) as conn:
            workers = {w for (w,) in conn.execute("SELECT DISTINCT worker FROM exec_log")}
        assert len(workers) == 1, workers  # only the admitted pod ever ran
        # Scaled in to zero: the quota is free again, a run's Job is admitted.
        wait_for("the pool scaled to zero", lambda: (
            (get(k8s, "workerpool", "pool", namespace) or {}).get("status") or {}
        ).get("replicas") == 0, controller=c)
        apply(k8s, namespace, batchrun("after", spec(q, tasks=1, sleep=0)))
        wait_for("a run admitted after the scale-in", lambda: status(
            k8s, "after", namespace).get("phase") == "Succeeded", controller=c,
            show=lambda: status(k8s, "after", namespace))
    finally:
        c.stop()
