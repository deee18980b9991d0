"""The OpenAI Batch API on the real node: `helm install` with `api.enabled`, the real
`openai` SDK against the api Service's pod (host network: the node has no pod network),
the batch executed by the pods of the chart's WorkerPool.

The upstream the workers call is our own OpenAI-compatible test server
(tests/support/openai_server.py) in this process, on 127.0.0.1: the pods share the
host's network. Its key comes from a Secret the routing table names, as a user's would.
"""

from __future__ import annotations

import json
import time

import openai
import psycopg
import yaml

from jobrunner.operator.workerpool import POOL_LABEL
from tests.support.figures import show
from tests.support.openai_server import OpenAITestServer, expected_body

from .harness.procs import free_port
from .operator_support import create_db_secret
from .test_helm import FULLNAME, RELEASE, helm_install, new_namespace

MODEL = "e2e-model"
ENDPOINT = "/v1/chat/completions"
UPSTREAM_KEY = "sk-e2e-upstream"
API = f"{FULLNAME}-api"


def _values(upstream: OpenAITestServer, port: int) -> dict:
    return {"api": {
        "enabled": True,
        # one replica: two on the host network would want the same port
        "replicas": 1, "hostNetwork": True, "host": "127.0.0.1", "port": port,
        "models": {MODEL: {"baseUrl": upstream.base_url,
                           "apiKeySecret": {"name": "upstream", "key": "api-key"},
                           "inputCostPerToken": "0.001", "outputCostPerToken": "0.002"}},
        "workerPool": {"minReplicas": 0, "maxReplicas": 2, "concurrency": 4},
    }}


def _pool_pods(k8s, namespace: str) -> set[str]:
    out = k8s.kubectl("get", "pods", "-n", namespace, "-o", "name", "-l",
                      f"{POOL_LABEL}={API}", check=False).stdout
    return {line.removeprefix("pod/") for line in out.split()}


def test_helm_install_with_the_api_runs_an_sdk_batch_on_the_worker_pool(
        k8s, dsn, tmp_path, capsys) -> None:
    namespace = new_namespace(k8s)
    create_db_secret(k8s, namespace, dsn)
    k8s.kubectl("create", "secret", "generic", "upstream", "-n", namespace,
                f"--from-literal=api-key={UPSTREAM_KEY}")
    port = free_port()
    with OpenAITestServer(api_key=UPSTREAM_KEY) as upstream:
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(_values(upstream, port)))
        try:
            t0 = time.monotonic()
            helm_install(k8s, namespace, "-f", str(values))
            installed = time.monotonic() - t0
            # A key is made where the server runs, as an operator would: shown once.
            key = k8s.kubectl("exec", "-n", namespace, f"deploy/{API}", "--",
                              "jobrunner", "api-key", "create", "--tenant", "acme",
                              "--name", "e2e").stdout.strip()
            assert key and key not in k8s.kubectl("logs", "-n", namespace,
                                                  f"deploy/{API}").stdout
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)

            upstream.fail("[refused]", 400, times=None)
            reqs = [{"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT,
                     "body": {"model": MODEL,
                              "messages": [{"role": "user", "content": f"hello {i}"}]}}
                    for i in range(30)]
            reqs.append({"custom_id": "bad", "method": "POST", "url": ENDPOINT,
                         "body": {"model": MODEL, "messages": [
                             {"role": "user", "content": "[refused] upstream"}]}})
            data = "".join(json.dumps(r) + "\n" for r in reqs).encode()
            uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
            t1 = time.monotonic()
            batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                                          completion_window="24h")
            assert batch.status == "in_progress" and batch.request_counts.total == 31

            # The pool's pods, seen while the batch runs: it scales to zero afterwards.
            pod_names: set[str] = set()
            deadline = time.monotonic() + 180
            while (done := client.batches.retrieve(batch.id)).status not in (
                    "completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, f"batch still {done.status}: {done}"
                pod_names |= _pool_pods(k8s, namespace)
                time.sleep(0.5)
            took = time.monotonic() - t1
            assert done.status == "completed", done
            assert (done.request_counts.completed, done.request_counts.failed) == (30, 1)

            out = {(o := json.loads(line))["custom_id"]: o
                   for line in client.files.content(done.output_file_id).text.splitlines()}
            assert set(out) == {f"r{i}" for i in range(30)}
            for r in reqs[:30]:
                line = out[r["custom_id"]]
                assert line["response"]["status_code"] == 200
                assert line["response"]["body"] == expected_body(ENDPOINT, r["body"])
            errors = [json.loads(line) for line in
                      client.files.content(done.error_file_id).text.splitlines()]
            assert [e["custom_id"] for e in errors] == ["bad"]
            assert "[refused]" in errors[0]["error"]["message"]
            usage = [expected_body(ENDPOINT, r["body"])["usage"] for r in reqs[:30]]
            assert done.usage.total_tokens == sum(u["total_tokens"] for u in usage)
            # The upstream saw the key from the Secret (the workers' env), and each
            # request once: 30 answered plus the refused one's attempts.
            assert upstream.requests and all(r.authorized for r in upstream.requests)
            assert upstream.count("hello", 200) == 30

            # Who ran them: the WorkerPool's pods, by the lease owner each done task
            # keeps (a worker's id starts with its pod's name).
            pod_names |= _pool_pods(k8s, namespace)
            with psycopg.connect(dsn) as conn:
                owners = [o for (o,) in conn.execute(
                    "SELECT lease_owner FROM agent_work_queue WHERE pool = %s"
                    " AND status = 'done'", (f"{namespace}/{API}",))]
            assert len(owners) == 30, owners
            ran_on = {next((p for p in pod_names if o.startswith(p + "-")), o) for o in owners}
            assert ran_on <= pod_names, (ran_on, pod_names)
            show(capsys, f"batch api on the node: helm install --wait {installed:.0f}s; 31 lines "
                 f"created -> completed in {took:.1f}s on worker pod(s) "
                 f"{sorted(ran_on)}; usage {done.usage.total_tokens} tokens")
        finally:
            k8s.helm("uninstall", RELEASE, "-n", namespace, check=False)
            k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
