"""The Batch API's figures (issue 27; docs/batch-api.md), with the real openai SDK:

1. upload a LINES-line input file (~LINE_BYTES each: 50,000 x 2,000 = ~100 MB) with
   files.create; the server's peak RSS (VmHWM) over upload and validation (goal < 150 MB);
2. batches.create: validation of every line and all tasks enqueued, lines per second
   (goal >= 20,000/s);
3. batches.retrieve latency p50/p99 while the batch's requests run (goal p99 < 50 ms);
4. end-to-end throughput of the requests (WORKERS pool workers x CONCURRENCY) against a
   fast local upstream, against calling that upstream directly from one process with as
   many threads: the queue's overhead as a ratio.

    python -m bench.batch_api [--lines 50000] [--line-bytes 2000] [--workers 2]
                              [--concurrency 16] [--json FILE]

The upstream is tests/support/openai_server.py (a threaded http.server in this process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psycopg

from bench import env
from jobrunner.store.migrate import migrate
from tests.support.openai_server import OpenAITestServer

ENDPOINT = "/v1/chat/completions"


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def input_file(lines: int, line_bytes: int) -> bytes:
    filler = "w" * max(0, line_bytes - 130)
    return b"".join(json.dumps({
        "custom_id": f"req-{i:06d}", "method": "POST", "url": ENDPOINT,
        "body": {"model": "bench", "max_tokens": 1,
                 "messages": [{"role": "user", "content": f"{i} {filler}"}]}}).encode() + b"\n"
        for i in range(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_api", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--line-bytes", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--direct-requests", type=int, default=5000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    out: dict[str, object] = {"lines": args.lines, "line_bytes": args.line_bytes,
                              "workers": args.workers, "concurrency": args.concurrency}

    server = env.Server()
    server.start()
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="jobrunner-bench-api-"))
    try:
        dsn = server.create_db("bench_api")
        with psycopg.connect(dsn) as conn:
            migrate(conn)
        upstream = OpenAITestServer().start()
        routes = tmp / "routes.json"
        routes.write_text(json.dumps({"models": {"bench": {"base_url": upstream.base_url}}}))
        child = env.child_env(JOBRUNNER_DATABASE_URL=dsn, JOBRUNNER_MODEL_ROUTES=str(routes))
        port = 18000 + (int(time.time()) % 1000)
        api = env.spawn([sys.executable, "-m", "jobrunner", "serve", "--port", str(port),
                         "--max-file-bytes", str(400 * 1024 * 1024), "--max-file-lines",
                         str(max(args.lines, 50_000)), "--log-level", "warning"],
                        env=child, log=tmp / "serve.log")
        procs.append(api)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("jobrunner serve did not start; see " + str(tmp / "serve.log"))
            time.sleep(0.2)
        key = subprocess.run([sys.executable, "-m", "jobrunner", "api-key", "create",
                              "--tenant", "bench"], env=child, capture_output=True, text=True,
                             check=True).stdout.strip()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=600, max_retries=0)
        rss_start = env.rss_kib(api.pid)

        data = input_file(args.lines, args.line_bytes)
        out["file_bytes"] = len(data)
        t0 = time.perf_counter()
        uploaded = client.files.create(file=("bench.jsonl", data), purpose="batch")
        out["upload_seconds"] = round(time.perf_counter() - t0, 2)
        del data
        t0 = time.perf_counter()
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                                      completion_window="24h")
        created = time.perf_counter() - t0
        out["create_seconds"] = round(created, 2)
        out["create_lines_per_second"] = round(args.lines / created)
        out["server_rss_start_mib"] = round(rss_start / 1024, 1)
        out["server_peak_rss_mib"] = round(_peak_rss_kib(api.pid) / 1024, 1)
        print(json.dumps(out), flush=True)

        # the batch runs: pool workers, retrieve latencies sampled meanwhile
        for _ in range(args.workers):
            procs.append(env.spawn(
                [sys.executable, "-m", "jobrunner", "worker", "--pool", "batch-api",
                 "--handler", "jobrunner.openai_batch:handle", "--concurrency",
                 str(args.concurrency), "--log-level", "warning"],
                env=child, log=tmp / "workers.log"))
        latencies: list[float] = []
        started = time.perf_counter()
        first_done = None
        while True:
            t0 = time.perf_counter()
            current = client.batches.retrieve(batch.id)
            latencies.append(time.perf_counter() - t0)
            if first_done is None and current.request_counts.completed:
                first_done = time.perf_counter()
            if current.status not in ("in_progress", "finalizing"):
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
        latencies.sort()
        out["status"] = current.status
        out["run_seconds"] = round(elapsed, 1)
        out["requests_per_second_queue"] = round(args.lines / elapsed)
        out["retrieve_samples"] = len(latencies)
        out["retrieve_p50_ms"] = round(statistics.median(latencies) * 1000, 1)
        out["retrieve_p99_ms"] = round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 1)

        # the same upstream, called directly from one process with as many threads
        threads = args.workers * args.concurrency
        body = {"model": "bench", "max_tokens": 1,
                "messages": [{"role": "user", "content": "x " + "w" * args.line_bytes}]}
        local = threading.local()

        def call(_: int) -> None:
            http = getattr(local, "client", None)
            if http is None:
                http = local.client = httpx.Client(timeout=60)
            http.post(f"{upstream.base_url}/chat/completions", json=body).raise_for_status()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(call, range(args.direct_requests)))
        direct = args.direct_requests / (time.perf_counter() - t0)
        out["requests_per_second_direct"] = round(direct)
        out["queue_over_direct"] = round(out["requests_per_second_queue"] / direct, 3)
        print(json.dumps(out), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        upstream.stop()
    finally:
        env.stop_processes(procs)
        server.stop()


if __name__ == "__main__":
    main()
