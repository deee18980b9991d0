"""Write docs/transcripts/flow-control.md: the summarisation example on the e2e cluster
(tests/e2e/harness), its workers calling the local OpenAI-compatible test server
(tests/support/openai_server.py, 127.0.0.1) under a limit, with a few 429 answers.

    flock /tmp/jobrunner-heavy.lock .venv/bin/python hack/flow_control_transcript.py

Starts (and stops) its own PostgreSQL, test server, cluster and controller. The DSN and
the API key never reach the transcript (they travel through Secrets and the environment).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jobrunner.local.embedded import EmbeddedPostgres  # noqa: E402
from tests.e2e.harness import build  # noqa: E402
from tests.e2e.harness.cluster import Cluster  # noqa: E402
from tests.e2e.operator_support import Controller, apply_crds, create_db_secret  # noqa: E402
from tests.support.openai_server import OpenAITestServer  # noqa: E402

OUT = REPO / "docs" / "transcripts" / "flow-control.md"
NS, NAME = "demo", "summarise-stdlib-docs"
API_KEY = "sk-local-test"  # the test server's key: sent from a Secret, never printed
MARKER = "ArgumentParser"  # in 3 chunks of the corpus: the server answers 429 for them


class Transcript:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.t0 = time.monotonic()

    def text(self, text: str) -> None:
        self.parts.append(text.strip() + "\n")

    def block(self, command: str, output: str, note: str = "") -> None:
        stamp = f"# t+{time.monotonic() - self.t0:.0f}s{note}\n"
        self.parts.append(f"```console\n{stamp}$ {command}\n{output.rstrip()}\n```\n")
        print(f"$ {command}\n{output.rstrip()}", flush=True)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="jobrunner-transcript-"))
    pg = EmbeddedPostgres(root / "pg")
    dsn = pg.start()
    server = OpenAITestServer(api_key=API_KEY).start()
    server.fail(MARKER, 429, times=3, retry_after=3)
    cluster = Cluster(build.ensure_cluster())
    controller = None
    out = Transcript()
    env = {**os.environ, "JOBRUNNER_DATABASE_URL": dsn, "NO_COLOR": "1", "COLUMNS": "110"}

    def jobrunner(args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "jobrunner", *args.split()], env=env,
                           text=True, capture_output=True, cwd=REPO)
        if r.returncode:
            raise SystemExit(f"jobrunner {args}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        out.block(f"jobrunner {args}", r.stdout + r.stderr)

    def kubectl(args: list[str], shown: str | None = None) -> str:
        r = cluster.kubectl(*args)
        out.block(shown or "kubectl " + " ".join(args), r.stdout)
        return r.stdout

    try:
        cluster.start()
        cluster.kubectl("create", "namespace", NS)
        apply_crds(cluster)
        create_db_secret(cluster, NS, dsn)
        cluster.kubectl("create", "secret", "generic", "llm-key", "-n", NS,
                        f"--from-literal=api-key={API_KEY}")
        controller = Controller(cluster, NS, root / "controller.log").start()

        out.text(f"""
# Transcript: the summarisation example under a limit

Produced by `hack/flow_control_transcript.py` on the e2e cluster (`tests/e2e/harness`:
one node on 127.0.0.1, the controller installed from the chart, pods on the host
network), PostgreSQL embedded, and the OpenAI-compatible test server
(`tests/support/openai_server.py`) on 127.0.0.1:{server.port}. The server answers
HTTP 429 with `Retry-After: 3` to the first three requests whose text contains
`{MARKER}`; the example's client maps that to `RateLimited`, which blocks the limit
for every worker without using an attempt. `t+` is the time since the script started.

The limit: 4 requests and 4,000 tokens per 2 s (2 calls per second for the 4 workers
x 2 tasks each that the example runs):
""")
        jobrunner("migrate")
        jobrunner("limit set llm --requests 4 --tokens 4000 --per 2")

        doc = yaml.safe_load((REPO / "examples" / "summarise.yaml").read_text())
        added = {
            "limits": ["llm"],
            "tokens": 300,
            "budget": {"cost": "5.00"},
            "template": {"env": [
                {"name": "JOBRUNNER_LLM_BASE_URL", "value": server.base_url},
                {"name": "JOBRUNNER_LLM_API_KEY",
                 "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}},
                {"name": "JOBRUNNER_LLM_LIMIT", "value": "llm"},
                {"name": "JOBRUNNER_LLM_COST_PER_1K_TOKENS", "value": "0.15"},
            ]},
        }
        doc["spec"].update(added)
        out.text("`examples/summarise.yaml` (48 chunks, map-reduce) with these fields added "
                 "to its spec:")
        out.parts.append("```yaml\n" + yaml.safe_dump({"spec": added}, sort_keys=False)
                         + "```\n")
        r = cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))
        out.block(f"kubectl apply -n {NS} -f summarise-limited.yaml", r.stdout)

        last, phase, showed_block, showed_pace = "", "", False, False
        samples: list[tuple[float, int]] = []  # (time, tasks done) while Running
        deadline = time.monotonic() + 600
        while phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            table = cluster.kubectl("get", "br", "-n", NS).stdout
            br = json.loads(cluster.kubectl("get", "br", NAME, "-n", NS, "-o", "json").stdout)
            st = br.get("status") or {}
            phase = st.get("phase", "")
            body = "\n".join(table.splitlines()[1:])
            if body.split()[1:5] != last.split()[1:5]:
                out.block(f"kubectl get br -n {NS}", table)
                last = body
            limit = (st.get("limits") or [{}])[0]
            if not showed_block and limit.get("blockedForSeconds"):
                showed_block = True  # a 429 blocks the limit for every worker
                out.text("A 429 came back: the limit is blocked for every worker until its "
                         "Retry-After has passed (no attempt used):")
                out.block(f"kubectl get br {NAME} -n {NS} -o jsonpath='{{.status.limits[0]}}'",
                          json.dumps(limit))
                jobrunner("limit list")
            if phase == "Running":
                samples.append((time.monotonic(), st.get("counts", {}).get("done", 0)))
                if not showed_pace and showed_block and samples[-1][1] >= 24:
                    showed_pace = True
                    out.text("Mid-run (`requests used` is the GCRA backlog of the current "
                             "period: a limit used at its rate, not ahead of it, reads low):")
                    jobrunner("limit list")
            time.sleep(1)
        paced = [x for x in samples if x[1] >= 8]
        if len(paced) >= 2 and paced[-1][0] > paced[0][0]:
            rate = (paced[-1][1] - paced[0][1]) / (paced[-1][0] - paced[0][0])
            out.text(f"From {paced[0][1]} to {paced[-1][1]} chunks done the batch ran at "
                     f"{rate:.2f} chunks/s: the limit's 2 requests/s (8 tasks could run at "
                     "once, each taking about 0.3 s).")

        out.text("Finished: the batch's tokens and cost, in the BatchRun and in the queue.")
        kubectl(["get", "br", "-n", NS, "-o", "wide"])
        br = json.loads(cluster.kubectl("get", "br", NAME, "-n", NS, "-o", "json").stdout)
        st = br["status"]
        excerpt = {k: st[k] for k in ("phase", "tokens", "inputTokens", "outputTokens", "cost",
                                      "budget", "throttledSeconds", "limits") if k in st}
        out.block(f"kubectl get br {NAME} -n {NS} -o yaml   # status, excerpt",
                  yaml.safe_dump({"status": excerpt}, sort_keys=False))
        jobrunner(f"usage --batch {st['batchId']}")
        assert controller is not None
        url = f"http://127.0.0.1:{controller.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            scraped = response.read().decode()
        wanted = re.compile(r"^jobrunner_(limit_|batchrun_(tokens|cost))")
        out.block(f"curl -s {url} | grep -E '^jobrunner_(limit_|batchrun_(tokens|cost))'",
                  "\n".join(line for line in scraped.splitlines() if wanted.match(line)))
        jobrunner(f"status --batch {st['batchId']}")
        events = cluster.kubectl("get", "events", "-n", NS, "--field-selector",
                                 "involvedObject.kind=BatchRun", "--sort-by=.lastTimestamp",
                                 "-o", "custom-columns=TYPE:.type,REASON:.reason,"
                                 "MESSAGE:.message").stdout
        out.block(f"kubectl get events -n {NS} --field-selector involvedObject.kind=BatchRun",
                  "\n".join(line[:160] for line in events.splitlines()))
        statuses: dict[int, int] = {}
        for req in server.requests:
            statuses[req.status] = statuses.get(req.status, 0) + 1
        out.text(f"The test server saw {len(server.requests)} requests: "
                 + ", ".join(f"{n} answered {s}" for s, n in sorted(statuses.items()))
                 + f"; every request carried the key: "
                   f"{all(r.authorized for r in server.requests)}.")
        OUT.write_text("\n".join(out.parts))
        print(f"wrote {OUT}")
        return 0 if phase == "Succeeded" else 1
    finally:
        if controller is not None:
            controller.stop()
        cluster.stop()
        server.stop()
        pg.stop()


if __name__ == "__main__":
    sys.exit(main())
