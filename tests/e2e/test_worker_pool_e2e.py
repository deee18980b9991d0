"""Worker pools on the real cluster (issue 18): a WorkerPool (minReplicas 0, maxReplicas 3)
with two handlers serves three BatchRuns of two tenants; all succeed (each run's tasks
with its handler); its Deployment scales up with the work and back to zero after the
stabilization window; `kubectl rollout restart` in the middle
loses nothing (every task's effect exactly once, no task on two workers at once); a run
whose handler the pool does not serve fails with HandlerNotServed and enqueues nothing.

WORKER_POOL_TRANSCRIPT=path writes the `kubectl get workerpool,br,deploy` samples taken
during the run to that file (docs/transcripts/worker-pools.md was made so)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psycopg
import yaml

from tests.support.figures import show

from .operator_support import (
    Controller,
    apply,
    apply_crds,
    batchrun,
    create_db_secret,
    events_of,
    get,
    wait_phase,
    with_test_handlers,
)

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}
HANDLER = "tests.support.handlers:with_effect"
OTHER = "tests.support.handlers:record"  # the pool's second handler: grade-b1's
TASKS, SLEEP = 16, 1.5
RUNS = {"grade-a1": "tenant-a", "grade-a2": "tenant-a", "grade-b1": "tenant-b"}
HANDLER_OF = {"grade-a1": HANDLER, "grade-a2": HANDLER, "grade-b1": OTHER}
WINDOW = 8


def workerpool(name: str, spec: dict) -> str:
    return yaml.safe_dump({"apiVersion": "jobrunner.dev/v1alpha1", "kind": "WorkerPool",
                           "metadata": {"name": name}, "spec": with_test_handlers(spec)})


class Sampler(threading.Thread):
    """The Deployment's replicas every 0.3 s, and `kubectl get workerpool,br,deploy`
    every 3 s (the transcript)."""

    def __init__(self, k8s, namespace: str, deploy: str) -> None:
        super().__init__(daemon=True)
        self.k8s, self.ns, self.deploy = k8s, namespace, deploy
        self.samples: list[tuple[float, int, int]] = []  # (t, spec.replicas, ready)
        self.transcript: list[str] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        last_text = 0.0
        while not self.stop.is_set():
            d = get(self.k8s, "deployment", self.deploy, self.ns)
            if d:
                self.samples.append((time.monotonic() - self.t0, d["spec"].get("replicas", 0),
                                     d.get("status", {}).get("readyReplicas", 0)))
            if time.monotonic() - last_text >= 3:
                last_text = time.monotonic()
                out = self.k8s.kubectl("get", "workerpool,br,deploy", "-n", self.ns,
                                       check=False).stdout
                self.transcript.append(f"$ kubectl get workerpool,br,deploy   "
                                       f"# t={last_text - self.t0:.0f}s\n{out}")
            self.stop.wait(0.3)


def test_pool_serves_three_runs_scales_with_the_work_and_survives_a_rollout(
        k8s, namespace, dsn, tmp_path, capsys):
    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    controller = Controller(k8s, namespace, tmp_path / "controller.log",
                            JOBRUNNER_POOL_SCALE_SECONDS="1").start()
    try:
        _run(k8s, namespace, dsn, controller, capsys)
    finally:
        controller.stop()


def _run(k8s, ns: str, dsn: str, controller: Controller, capsys) -> None:
    # A run that names the pool before it exists waits (GitOps applies in any order).
    shards = {name: [{"key": f"{name}-{i}", "payload": {"sleep": SLEEP}} for i in range(TASKS)]
              for name in RUNS}
    first = next(iter(RUNS))
    apply(k8s, ns, batchrun(first, {"tenant": RUNS[first], "handler": HANDLER_OF[first],
                                    "pool": "graders",
                                    "shards": shards[first], "maxAttempts": 3},
                                    test_handlers=False))
    br = wait_phase(k8s, first, ns, ("Pending",), timeout=60, controller=controller)
    enqueued = next(c for c in br["status"]["conditions"] if c["type"] == "Enqueued")
    assert enqueued["reason"] == "WaitingForPool", enqueued

    deploy_name = "graders-workers"
    sampler = Sampler(k8s, ns, deploy_name)
    sampler.start()
    apply(k8s, ns, workerpool("graders", {
        "handlers": [HANDLER, OTHER], "minReplicas": 0, "maxReplicas": 3, "concurrency": 2,
        "targetTasksPerReplica": 4, "scaleDownStabilizationWindowSeconds": WINDOW, **FAST}))
    # the handler it does not serve: refused, nothing enqueued
    apply(k8s, ns, batchrun("wrong-handler", {
        "tenant": "tenant-b", "handler": "tests.support.handlers:noop", "pool": "graders",
        "shards": [{"key": "w-0"}]}, test_handlers=False))
    for name in list(RUNS)[1:]:
        apply(k8s, ns, batchrun(name, {"tenant": RUNS[name], "handler": HANDLER_OF[name],
                                       "pool": "graders", "shards": shards[name],
                                       "priority": 0, "maxAttempts": 3},
                                       test_handlers=False))

    wrong = wait_phase(k8s, "wrong-handler", ns, ("Failed",), timeout=60, controller=controller)
    failed = next(c for c in wrong["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "HandlerNotServed", failed
    assert ("does not serve handler tests.support.handlers:noop (it serves "
            f"{HANDLER}, {OTHER})") in failed["message"], failed
    assert not (wrong["status"].get("counts") or {}).get("total")
    assert any(e["reason"] == "HandlerNotServed" and e["type"] == "Warning"
               for e in events_of(k8s, ns))

    # mid-run: roll the Deployment once a sixth of the tasks are done
    total = TASKS * len(RUNS)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with psycopg.connect(dsn) as conn:
            done = conn.execute("SELECT count(*) FROM agent_work_queue WHERE status = 'done'"
                                ).fetchone()[0]
        if done >= total // 6:
            break
        time.sleep(0.3)
    assert done >= total // 6, f"only {done} task(s) done in 120 s\n{controller.output()[-3000:]}"
    k8s.kubectl("rollout", "restart", f"deployment/{deploy_name}", "-n", ns)
    restarted_at = time.monotonic() - sampler.t0

    for name in RUNS:
        st = wait_phase(k8s, name, ns, ("Succeeded", "Failed"), timeout=180,
                        controller=controller)["status"]
        assert st["phase"] == "Succeeded", st
        assert st["counts"]["done"] == TASKS and st["pool"] == f"{ns}/graders"
        assert "jobName" not in st
    succeeded_at = time.monotonic() - sampler.t0
    assert not json.loads(k8s.kubectl("get", "jobs", "-n", ns, "-o", "json").stdout)["items"]

    # back to zero after the window
    deadline = time.monotonic() + WINDOW + 60
    while time.monotonic() < deadline:
        d = get(k8s, "deployment", deploy_name, ns)
        if d["spec"].get("replicas") == 0 and not d["status"].get("replicas"):
            break
        time.sleep(0.3)
    zero_at = time.monotonic() - sampler.t0
    time.sleep(3.5)  # one more transcript sample at zero
    sampler.stop.set()
    sampler.join()
    d = get(k8s, "deployment", deploy_name, ns)
    assert d["spec"]["replicas"] == 0 and not d["status"].get("replicas"), d["status"]
    pool = get(k8s, "workerpool", "graders", ns)
    pst = pool["status"]
    assert pst["desiredReplicas"] == 0 and pst["pool"] == f"{ns}/graders"
    assert pst["pending"] == 0 and pst["running"] == 0 and pst.get("lastScaleTime")
    sized = next(c for c in pst["conditions"] if c["type"] == "Sized")
    assert sized["reason"] == "NoWork", sized
    assert d["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]

    peak = max(r for _, r, _ in sampler.samples)
    assert peak == 3, sampler.samples
    assert all(r <= 3 for _, r, _ in sampler.samples)
    scale_down = zero_at - succeeded_at
    # down only after a whole window without work (at most two: a window that began with
    # one task left ends at one replica, the next at zero), with a 1 s timer
    assert WINDOW - 2 <= scale_down <= 2 * WINDOW + 10, scale_down

    with psycopg.connect(dsn) as conn:
        effects = dict(conn.execute(
            "SELECT task_key, count(*) FROM effect_out GROUP BY task_key").fetchall())
        overlaps = conn.execute(
            "SELECT count(*) FROM exec_log a JOIN exec_log b ON a.task_id = b.task_id"
            " AND a.ctid < b.ctid AND a.started_at < coalesce(b.ended_at, 'infinity')"
            " AND b.started_at < coalesce(a.ended_at, 'infinity')").fetchone()[0]
        workers = {w for (w,) in conn.execute("SELECT DISTINCT worker FROM exec_log")}
        ran_keys = {k for (k,) in conn.execute("SELECT DISTINCT task_key FROM exec_log")}
        reruns = conn.execute("SELECT count(*) - count(DISTINCT task_id) FROM exec_log"
                              ).fetchone()[0]
        wrong_rows = conn.execute("SELECT count(*) FROM agent_work_queue WHERE task_key = 'w-0'"
                                  ).fetchone()[0]
    # each run's tasks ran with its own handler (only with_effect writes effects), its
    # effect exactly once; every task ran (exec_log), none on two workers at once
    expected = {s["key"] for name, rs in shards.items() for s in rs
                if HANDLER_OF[name] == HANDLER}
    assert set(effects) == expected and set(effects.values()) == {1}, effects
    assert ran_keys == {s["key"] for rs in shards.values() for s in rs}
    assert overlaps == 0
    assert wrong_rows == 0
    # worker ids are <pod>-<6 hex>, pods <deployment>-<ReplicaSet hash>-<suffix>: the
    # ReplicaSets before and after the restart both ran tasks
    replica_sets = {w.rsplit("-", 3)[-3] for w in workers}
    assert len(replica_sets) >= 2, workers

    timeline = " ".join(f"{t:.0f}s:{r}" for i, (t, r, _) in enumerate(sampler.samples)
                        if i == 0 or sampler.samples[i - 1][1] != r)
    show(capsys, f"worker pool: {total} tasks of 3 runs (2 tenants, 2 handlers), replicas "
                 f"over time {timeline}; rollout restart at {restarted_at:.0f}s, "
                 f"{len(workers)} worker pods of {len(replica_sets)} ReplicaSets, "
                 f"{reruns} re-run(s) after release, "
                 f"0 duplicate effects, 0 overlaps; all Succeeded at {succeeded_at:.0f}s, "
                 f"zero replicas {scale_down:.1f}s later (window {WINDOW}s)")
    out = os.environ.get("WORKER_POOL_TRANSCRIPT")
    if out:
        Path(out).write_text("\n".join(sampler.transcript))
