"""What only a real node can prove: the worker image in real containers under a real
kubelet — logs and exec through the API server, OOM kills, the read-only root filesystem,
runAsNonRoot, images that are not there, probes."""

from __future__ import annotations

import json
import signal
import time
from datetime import UTC, datetime

import psycopg
import pytest

from tests.support import figures

from .operator_support import (
    apply,
    batchrun,
    create_db_secret,
    events_of,
    get,
    jobs_of,
    pods_of,
    wait_phase,
)

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}


def show(capsys, text: str) -> None:
    """A proof line past pytest's capture, so that it shows in the CI log."""
    figures.show(capsys, "[node] " + text.strip())


def wait_for(what: str, predicate, timeout: float = 90, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def running_worker(k8s, namespace: str) -> dict | None:
    for pod in pods_of(k8s, namespace):
        for cs in pod["status"].get("containerStatuses") or []:
            if cs["name"] == "worker" and "running" in cs.get("state", {}):
                return pod
    return None


def worker_statuses(k8s, namespace: str) -> list[dict]:
    return [cs for pod in pods_of(k8s, namespace)
            for cs in pod["status"].get("containerStatuses") or [] if cs["name"] == "worker"]


def worker_diagnosis(k8s, namespace: str, pod: str, dsn: str) -> str:
    """What a failed wait on a worker needs to be understood: its container's states, its
    log and the queue's rows."""
    statuses = [(cs["name"], cs.get("restartCount"), cs.get("state"), cs.get("lastState"))
                for p in pods_of(k8s, namespace)
                for cs in p["status"].get("containerStatuses") or []]
    log = k8s.kubectl("logs", pod, "-n", namespace, "-c", "worker", "--tail", "40",
                      check=False)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT status, count(*), min(run_after) - now(), max(attempts) "
            "FROM agent_work_queue GROUP BY status").fetchall()
        sessions = conn.execute(
            "SELECT application_name, state, wait_event_type, wait_event, "
            "left(query, 80) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()").fetchall()
    return (f"container statuses: {statuses}\nqueue: {rows}\nsessions: {sessions}\n"
            f"worker log (tail):\n{log.stdout}{log.stderr}")


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def start_timeline(k8s, namespace: str, pod: str, applied: datetime, dsn: str,
                   first_log: dict) -> str:
    """Where a worker's start went, in seconds after `kubectl apply` (the API's times have
    one-second resolution): enqueued, Job, pod, scheduled, container started, the worker's
    first log line, its first task started (exec_log)."""
    p = json.loads(k8s.kubectl("get", "pod", pod, "-n", namespace, "-o", "json").stdout)
    job = jobs_of(k8s, namespace)[0]
    scheduled = condition(p["status"], "PodScheduled")
    worker = next(cs for cs in p["status"]["containerStatuses"] if cs["name"] == "worker")
    state = worker["state"].get("running") or worker["state"].get("terminated") or {}
    with psycopg.connect(dsn) as conn:
        enqueued, claimed = conn.execute(
            "SELECT (SELECT min(created_at) FROM agent_work_queue),"
            " (SELECT min(started_at) FROM exec_log)").fetchone()
    marks = [("enqueued", enqueued), ("Job", _ts(job["metadata"]["creationTimestamp"])),
             ("pod", _ts(p["metadata"]["creationTimestamp"])),
             ("scheduled", scheduled and _ts(scheduled["lastTransitionTime"])),
             ("container started", state.get("startedAt") and _ts(state["startedAt"])),
             ("first log line", _ts(first_log["ts"])), ("first task started", claimed)]
    return ", ".join(f"{name} +{(at - applied).total_seconds():.1f}s"
                     for name, at in marks if at is not None)


def test_kubectl_logs_and_exec_into_a_worker(k8s, namespace, dsn, operator, capsys):
    applied = datetime.now(UTC)
    apply(k8s, namespace, batchrun("observed", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 6, "payload": {"sleep": 4}}, **FAST}))
    pod = wait_for("a running worker", lambda: running_worker(k8s, namespace))["metadata"]["name"]
    batch = get(k8s, "batchrun", "observed", namespace)["status"]["batchId"]
    # The worker's first claim, seen in the database (the container runs before it: alone
    # 1 s before, under the whole suite's load up to a minute and more, the figure line
    # shows where it goes). Not polled with `kubectl exec`: each exec starts a Python
    # process in the container, CPU the worker's own start then waits for.
    def claimed() -> bool:
        with psycopg.connect(dsn) as conn:
            return conn.execute("SELECT count(*) FROM agent_work_queue WHERE status IN "
                                "('leased', 'done')").fetchone()[0] > 0

    try:
        wait_for("the worker's first claim", claimed, timeout=150, interval=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{worker_diagnosis(k8s, namespace, pod, dsn)}") from None
    # `kubectl exec` through the API server and the kubelet into the container: the CLI in
    # the image, the DSN from the pod's environment (the Secret), no flags needed for it.
    out = k8s.kubectl("exec", pod, "-n", namespace, "-c", "worker", "--",
                      "jobrunner", "status", "--batch", batch, "--json").stdout
    counts = json.loads(out)
    assert counts["leased"] + counts["done"] >= 1, counts
    assert counts["total"] == 6, counts
    whoami = k8s.kubectl("exec", pod, "-n", namespace, "--", "id", "-u").stdout.strip()
    assert whoami == "10001"
    wait_phase(k8s, "observed", namespace, ("Succeeded",), controller=operator)
    lines = [line for line in k8s.pod_log(namespace, pod).splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON
    assert any("batch" in r.get("message", r.get("msg", "")) for r in records), records[:3]
    assert all("level" in r or "levelname" in r for r in records), records[:3]
    show(capsys, "worker start: " + start_timeline(k8s, namespace, pod, applied, dsn, records[0]))
    show(capsys, f"$ kubectl exec {pod} -- jobrunner status --batch {batch} --json\n{out}"
          f"$ kubectl logs {pod} | head -2\n" + "\n".join(lines[:2]))


def test_oom_killed_worker_task_runs_again_and_the_run_succeeds(k8s, namespace, dsn,
                                                                  operator, capsys):
    apply(k8s, namespace, batchrun("hungry", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:hog_memory_first",
        "shardRange": {"count": 1, "payload": {"mb": 400}}, **FAST,
        "template": {"resources": {"requests": {"memory": "160Mi"},
                                   "limits": {"memory": "160Mi"}}}}))
    br = wait_phase(k8s, "hungry", namespace, ("Succeeded", "Failed"), timeout=240,
                    controller=operator)
    assert br["status"]["phase"] == "Succeeded", br["status"]
    killed = [cs["state"]["terminated"] for cs in worker_statuses(k8s, namespace)
              if "terminated" in cs.get("state", {})
              and cs["state"]["terminated"].get("reason") == "OOMKilled"]
    assert killed and killed[0]["exitCode"] == 137, worker_statuses(k8s, namespace)
    with psycopg.connect(dsn) as conn:
        status, attempts = conn.execute(
            "SELECT status, attempts FROM agent_work_queue").fetchone()
        runs = conn.execute("SELECT attempt FROM exec_log ORDER BY attempt").fetchall()
    # the first attempt died with its container (no exec_log row: it never finished its
    # allocation); the lease expired and the replacement pod ran attempt 2
    assert (status, attempts) == ("done", 2) and runs == [(2,)], (status, attempts, runs)
    show(capsys, f"memory limit 160Mi: worker OOMKilled (exit {killed[0]['exitCode']}), its "
                 "task ran again after the lease expired (attempt 2, done), run Succeeded")


def test_writing_outside_tmp_fails_with_a_clear_error(k8s, namespace, dsn, operator, capsys):
    apply(k8s, namespace, batchrun("readonly", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:write_file",
        "maxAttempts": 1, **FAST,
        "shards": [{"key": "outside", "payload": {"path": "/app/out.json"}},
                   {"key": "inside", "payload": {"path": "/tmp/out.json"}}]}))
    br = wait_phase(k8s, "readonly", namespace, ("Succeeded", "Failed"), controller=operator)
    assert br["status"]["phase"] == "Failed" and br["status"]["counts"]["dead"] == 1
    with psycopg.connect(dsn) as conn:
        rows = dict(conn.execute("SELECT task_key, coalesce(last_error, status) "
                                 "FROM agent_work_queue").fetchall())
    assert rows["inside"] == "done"
    assert "Read-only file system" in rows["outside"] and "/app/out.json" in rows["outside"]
    show(capsys, f"read-only root filesystem: last_error {rows['outside'][:160]!r}")


@pytest.fixture
def quick_operator(k8s, namespace, dsn, tmp_path):
    """The controller with an 8 s pod-start timeout instead of 30 s: the tests of pods
    that can never start need not wait the default out (the timeout is the same code)."""
    from .operator_support import Controller, apply_crds, create_db_secret

    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    controller = Controller(k8s, namespace, tmp_path / "controller.log",
                            JOBRUNNER_POD_START_TIMEOUT_SECONDS="8").start()
    yield controller
    controller.stop()


def _assert_refused(k8s, namespace, name, operator, reason: str, words: str,
                    started: float, capsys) -> dict:
    cond = wait_for(f"WorkersHealthy={reason}", lambda: condition(
        (get(k8s, "batchrun", name, namespace) or {}).get("status") or {}, "WorkersHealthy"),
        timeout=60)
    assert cond["status"] == "False" and cond["reason"] == reason, cond
    assert words in cond["message"], cond
    noticed = time.monotonic() - started
    br = wait_phase(k8s, name, namespace, ("Failed",), timeout=90, controller=operator)
    failed_after = time.monotonic() - started
    failed = condition(br["status"], "Failed")
    assert failed["status"] == "True" and failed["reason"] == reason, failed
    events = [e for e in events_of(k8s, namespace) if e["reason"] == reason
              and e["involvedObject"]["kind"] == "BatchRun"]
    assert events and events[0]["type"] == "Warning" and words in events[0]["message"]
    assert operator.alive(), "the controller crashed"
    (job,) = jobs_of(k8s, namespace)
    assert job["spec"]["suspend"] is True  # its pods go away; the tasks stay queued
    wait_for("the worker pods gone", lambda: not pods_of(k8s, namespace), timeout=60)
    show(capsys, f"{name}: {reason} noticed after {noticed:.0f}s, run Failed after "
          f"{failed_after:.0f}s: {cond['message']}")
    return br


def test_a_root_uid_is_refused_by_the_kubelet_and_the_run_says_why(k8s, namespace, dsn,
                                                                    quick_operator, capsys):
    operator = quick_operator
    started = time.monotonic()
    apply(k8s, namespace, batchrun("as-root", {
        "tenant": "t", "workers": 1, "handler": "tests.support.handlers:noop",
        "shardRange": {"count": 2}, **FAST,
        "template": {"containerSecurityContext": {"runAsUser": 0}}}))
    br = _assert_refused(k8s, namespace, "as-root", operator, "CreateContainerConfigError",
                         "non-root", started, capsys)
    assert br["status"]["counts"]["pending"] == 2


def test_a_missing_image_is_reported_within_a_minute(k8s, namespace, dsn, quick_operator,
                                                     capsys):
    operator = quick_operator
    started = time.monotonic()
    apply(k8s, namespace, batchrun("no-image", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:noop",
        "shardRange": {"count": 2}, **FAST,
        "template": {"image": "jobrunner:no-such-tag", "imagePullPolicy": "Never"}}))
    _assert_refused(k8s, namespace, "no-image", operator, "ErrImageNeverPull",
                    "jobrunner:no-such-tag", started, capsys)
    assert time.monotonic() - started < 90


def test_the_deadline_sends_sigterm_then_sigkill_after_the_grace_period(k8s, namespace, dsn,
                                                                        operator, capsys):
    """Two workers hold a lease each when activeDeadlineSeconds kills the Job. One is
    frozen (SIGSTOP from the host, as a wedged process): the kubelet's SIGTERM stays
    pending in it, and only SIGKILL, after terminationGracePeriodSeconds, ends it. The
    other takes SIGTERM, stops and gives its task back before the grace ends."""
    grace = 6
    apply(k8s, namespace, batchrun("deadline", {
        "tenant": "t", "workers": 2, "handler": "tests.support.handlers:record",
        "shardRange": {"count": 2, "payload": {"sleep": 600}},
        "activeDeadlineSeconds": 67, **FAST,
        "template": {"terminationGracePeriodSeconds": grace}}))

    def two_running():
        pods = [p for p in pods_of(k8s, namespace) if k8s.node.pod_pids(
            namespace, p["metadata"]["name"])]
        return pods if len(pods) == 2 else None

    frozen, calm = (p["metadata"]["name"] for p in wait_for("2 running workers", two_running))
    with psycopg.connect(dsn) as conn:
        wait_for("both tasks running", lambda: conn.execute(
            "SELECT count(*) FROM exec_log").fetchone()[0] == 2)
    (pid,) = k8s.node.pod_pids(namespace, frozen).values()
    (calm_pid,) = k8s.node.pod_pids(namespace, calm).values()
    k8s.node.kill_pod(namespace, frozen, signal.SIGSTOP)

    def pending_signals(p: int) -> int:
        with open(f"/proc/{p}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)

    sigterm = 1 << (signal.SIGTERM - 1)
    wait_for("SIGTERM pending in the frozen worker",
             lambda: pending_signals(pid) & sigterm, timeout=120, interval=0.1)
    term_seen = time.monotonic()
    wait_for("the calm worker to exit", lambda: not _alive(calm_pid), timeout=grace + 5,
             interval=0.1)
    calm_exit = time.monotonic() - term_seen
    wait_for("the frozen worker killed", lambda: not _alive(pid), timeout=grace + 15,
             interval=0.1)
    killed_after = time.monotonic() - term_seen
    # A stopped process cannot act on SIGTERM: only SIGKILL ends it, and not before the
    # grace period (the kubelet also waits for its own sync; allow for it).
    assert grace - 1 <= killed_after <= grace + 10, killed_after
    # The calm worker's own exit is proven by its released task below (a SIGKILL before
    # its release would have left the lease to expire); its time after SIGTERM is only
    # reported: under CI load it came to 6.06 s, the kubelet's sync included.
    br = wait_phase(k8s, "deadline", namespace, ("Failed",), timeout=60, controller=operator)
    assert condition(br["status"], "Failed")["reason"] == "DeadlineExceeded"
    with psycopg.connect(dsn) as conn:
        def settled():
            rows = conn.execute("SELECT status, attempts, last_error FROM agent_work_queue"
                                " ORDER BY task_key").fetchall()
            return rows if all(r[0] == "pending" for r in rows) else None
        rows = wait_for("both tasks pending again", settled, timeout=30)
    released = [r for r in rows if r[1] == 0 and r[2] is None]
    expired = [r for r in rows if r[2] and r[2].startswith("lease expired")]
    # the calm worker gave its task back (attempt not used); the frozen one's lease expired
    assert len(released) == 1 and len(expired) == 1, rows
    show(capsys, f"deadline: SIGTERM pending in the frozen worker, SIGKILL {killed_after:.1f}s "
          f"later (grace {grace}s); the other exited {calm_exit:.1f}s after SIGTERM, task "
          "released")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_controllers_probes_are_really_probed(k8s, dsn, capsys):
    """The chart's startup and liveness probes, run by the kubelet: the prober's own
    counters, and a frozen controller restarted by its liveness probe."""
    from .test_helm import controller_pods, helm_install, new_namespace

    ns = new_namespace(k8s)
    try:
        create_db_secret(k8s, ns, dsn)
        helm_install(k8s, ns, "--set", "controller.livenessProbe.periodSeconds=2",
                     "--set", "controller.livenessProbe.failureThreshold=2",
                     "--set", "controller.livenessProbe.timeoutSeconds=1",
                     "--set", "controller.terminationGracePeriodSeconds=2")
        (pod,) = controller_pods(k8s, ns)
        name = pod["metadata"]["name"]
        cs = pod["status"]["containerStatuses"][0]
        assert cs["started"] is True and cs["ready"] is True

        def probes() -> dict[tuple[str, str], float]:
            text = k8s.kubelet_get("/metrics/probes")
            out: dict[tuple[str, str], float] = {}
            for line in text.splitlines():
                if line.startswith("prober_probe_total{") and f'pod="{name}"' in line:
                    labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:
                                                                  line.index("}")].split(","))
                    key = (labels["probe_type"].strip('"'), labels["result"].strip('"'))
                    out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
            return out

        seen = wait_for("successful startup and liveness probes", lambda: (
            p := probes()).get(("Startup", "successful")) and p.get(
            ("Liveness", "successful")) and p, timeout=30)
        # Freeze the controller: its health endpoint stops answering, the liveness probe
        # fails twice, the kubelet kills and restarts the container.
        k8s.node.kill_pod(ns, name, signal.SIGSTOP)

        def restarted():
            p = get(k8s, "pod", name, ns)
            cs = p["status"]["containerStatuses"][0]
            return cs if cs["restartCount"] >= 1 and cs.get("ready") else None

        cs = wait_for("the liveness probe to restart the controller", restarted, timeout=90)
        assert cs["lastState"]["terminated"]["exitCode"] == 137
        unhealthy = [e for e in events_of(k8s, ns) if e["reason"] == "Unhealthy"]
        assert any("Liveness probe failed" in e["message"] for e in unhealthy), unhealthy
        assert probes().get(("Liveness", "failed"), 0) >= 2
        show(capsys, f"probes of {name}: {seen}; frozen -> liveness failed x2 -> restarted "
              f"(exit {cs['lastState']['terminated']['exitCode']})")
    finally:
        k8s.helm("uninstall", "jr", "-n", ns, check=False)
        k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)
