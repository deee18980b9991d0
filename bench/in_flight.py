"""``python -m bench.in_flight``: hundreds of model calls in flight in one worker process
(issue 30, item 3), against the same load run as many sync worker processes.

The upstream is a local OpenAI-compatible stub (Starlette on uvicorn, its own process on
127.0.0.1) that answers every POST /v1/chat/completions after --delay seconds (1 s): the
shape of a model call, with none of a model's CPU. The tasks are Batch API requests run
by the product's own handler, `jobrunner.openai_batch:handle`.

Rows, interleaved over --reps repetitions, each on a fresh queue of tasks:
- async, 1 process x concurrency 500: the handler's async form on the worker's event loop
  (what `concurrency: 500` now means);
- sync, 1 process x concurrency 500: the same calls made by the sync handler
  (bench.handlers:openai_sync), a handler thread per call: the thread model as it was;
- sync, K processes x concurrency 1: the "one pod per call" deployment. 500 such
  processes do not fit a 2-core machine (each imports Python and the package: about
  1 s of CPU and 50 MiB), so K is --sync-procs (default 50) and the figures that scale
  with the count (memory, connections) are also given per process, x500 for the load.

Measured over --window seconds after --warm seconds of load: tasks/s (done rows);
slots busy (mean leased rows sampled every 0.25 s / slots); the server's CPU per task
(every backend of the embedded server but the harness's own); the workers' CPU per task
and resident memory (sum of the processes' VmRSS at the end of the window), per
in-flight task (RSS / mean leased); server connections of the workers.

The stub reports no usage, so the handler writes no usage rows: the figures are the
queue's and the worker's own cost per call.

Writes bench/results/in-flight.md and in-flight.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue

from . import env
from .report import table
from .scenarios import free_port
from .systems import BATCH, TENANT

DB = "bench_in_flight"
RESULTS = env.REPO / "bench" / "results"


# -- the stub upstream -------------------------------------------------------------------
def stub(port: int, delay: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        await asyncio.sleep(delay)
        return JSONResponse({"id": "chatcmpl-bench", "object": "chat.completion",
                             "created": 1_700_000_000, "model": body.get("model", "stub"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", backlog=4096,
                timeout_keep_alive=120)


# -- one row -----------------------------------------------------------------------------
def enqueue(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        conn.execute("TRUNCATE agent_work_queue, agent_shard_lease, agent_task_effect, "
                     "agent_batch RESTART IDENTITY")
        conn.commit()
        body = {"model": "stub", "messages": [{"role": "user", "content": "hello"}]}
        Queue(conn).enqueue(BATCH, TENANT, [
            TaskSpec(key=f"r{i}", payload={"method": "POST", "url": "/v1/chat/completions",
                                           "body": body}) for i in range(n)])
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE agent_work_queue")


def run_row(server: env.Server, dsn: str, label: str, handler: str, procs: int,
            concurrency: int, tasks: int, args: argparse.Namespace, upstream: str,
            log_dir: Path) -> dict:
    enqueue(dsn, tasks)
    worker_env = env.child_env(OPENAI_BASE_URL=upstream, OPENAI_API_KEY="sk-bench")
    argv = [sys.executable, "-m", "jobrunner", "worker", "--dsn", dsn, "--batch", BATCH,
            "--handler", handler, "--concurrency", str(concurrency),
            "--visibility-timeout", "15", "--log-level", "warning"]
    harness = psycopg.connect(dsn, autocommit=True)
    exclude = frozenset({harness.info.backend_pid})

    def one(sql: str, *params: object) -> int:
        return int(harness.execute(sql, params).fetchone()[0])

    def done() -> int:
        return one("SELECT count(*) FROM agent_work_queue WHERE status = 'done'")

    workers = [env.spawn(argv, env=worker_env, log=log_dir / f"{label[:5]}-{i}.log")
               for i in range(procs)]
    slots = procs * concurrency
    try:
        with env.running(workers):
            # the load is on once most slots are busy (K processes take a while to start)
            env.wait_until(lambda: one("SELECT count(*) FROM agent_work_queue "
                                       "WHERE status = 'leased'") >= 0.5 * slots,
                           timeout=300, what=f"{label}: half the slots busy")
            time.sleep(args.warm)
            t0, d0 = time.monotonic(), done()
            s0 = server.cpu_seconds(exclude)
            w0 = sum(env.tree_cpu(w.pid) for w in workers)
            leased: list[int] = []
            while time.monotonic() - t0 < args.window:
                leased.append(one("SELECT count(*) FROM agent_work_queue "
                                  "WHERE status = 'leased'"))
                time.sleep(0.25)
            dt = time.monotonic() - t0
            d1 = done()
            s1 = server.cpu_seconds(exclude)
            w1 = sum(env.tree_cpu(w.pid) for w in workers)
            rss = sum(env.rss_kib(w.pid) for w in workers)
            connections = one("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                              "AND pid <> pg_backend_pid()", DB)
            left = tasks - d1
    finally:
        harness.close()
    n = d1 - d0
    in_flight = statistics.mean(leased)
    row = {"label": label, "processes": procs, "concurrency": concurrency, "slots": slots,
           "tasks_per_s": n / dt, "busy": in_flight / slots, "in_flight": in_flight,
           "server_cpu_us_per_task": (s1 - s0) / max(1, n) * 1e6,
           "worker_cpu_us_per_task": (w1 - w0) / max(1, n) * 1e6,
           "rss_mib": rss / 1024, "rss_kib_per_in_flight": rss / max(1.0, in_flight),
           "rss_mib_per_process": rss / 1024 / procs, "connections": connections,
           "tasks_left": left, "window_s": dt}
    print(f"  {label}: {row['tasks_per_s']:.0f} tasks/s, busy {row['busy']:.0%}, server "
          f"{row['server_cpu_us_per_task']:.0f} us/task, worker "
          f"{row['worker_cpu_us_per_task']:.0f} us/task, RSS {row['rss_mib']:.0f} MiB, "
          f"{connections} connections", flush=True)
    if left <= 0:
        print(f"  {label}: WARNING the queue ran dry inside the window", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.in_flight")
    sub = parser.add_subparsers(dest="command")
    stub_cmd = sub.add_parser("stub")
    stub_cmd.add_argument("--port", type=int, required=True)
    stub_cmd.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=500)
    parser.add_argument("--sync-procs", type=int, default=50)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--warm", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.command == "stub":
        stub(args.port, args.delay)
        return

    server = env.Server()
    server.start()
    log_dir = Path(server.tmp) / "logs"
    log_dir.mkdir()
    port = free_port()
    upstream_proc = env.spawn([sys.executable, "-m", "bench.in_flight", "stub", "--port",
                               str(port), "--delay", str(args.delay)],
                              log=log_dir / "stub.log")
    upstream = f"http://127.0.0.1:{port}/v1"
    rows: list[dict] = []
    load_before = env.load()
    try:
        dsn = server.create_db(DB)
        with psycopg.connect(dsn) as conn:
            from jobrunner.store.migrate import migrate
            migrate(conn)
        env.wait_until(lambda: _listening(port), timeout=30, what="the stub upstream")
        c, k = args.concurrency, args.sync_procs
        per_s = c / args.delay
        big = int(per_s * (args.warm + args.window + 30) * 1.2)
        small = int(k / args.delay * (args.warm + args.window + 60) * 1.2)
        plan = [
            (f"async, 1 process x {c}", "jobrunner.openai_batch:handle", 1, c, big),
            (f"sync threads, 1 process x {c}", "bench.handlers:openai_sync", 1, c, big),
            (f"sync, {k} processes x 1", "bench.handlers:openai_sync", k, 1, small),
        ]
        for rep in range(args.reps):
            print(f"rep {rep + 1}/{args.reps}", flush=True)
            for label, handler, procs, conc, tasks in plan:
                row = run_row(server, dsn, label, handler, procs, conc, tasks, args,
                              upstream, log_dir)
                row["rep"] = rep
                rows.append(row)
    finally:
        env.stop_processes([upstream_proc])
        server.stop()
    write(rows, args, load_before, env.load())


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def write(rows: list[dict], args: argparse.Namespace, before: tuple, after: tuple) -> None:
    def spread(label: str, key: str, fmt: str = "{:,.0f}") -> str:
        values = [r[key] for r in rows if r["label"] == label]
        text = fmt.format(statistics.median(values))
        if len(values) > 1:
            text += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
        return text

    labels = list(dict.fromkeys(r["label"] for r in rows))
    body = []
    for label in labels:
        body.append([label, spread(label, "tasks_per_s"), spread(label, "busy", "{:.0%}"),
                     spread(label, "server_cpu_us_per_task"),
                     spread(label, "worker_cpu_us_per_task"), spread(label, "rss_mib"),
                     spread(label, "rss_kib_per_in_flight"),
                     spread(label, "rss_mib_per_process", "{:,.1f}"),
                     spread(label, "connections")])
    text = (f"# In flight per pod\n\n`python -m bench.in_flight --reps {args.reps} --window "
            f"{args.window:.0f} --sync-procs {args.sync_procs}` (stub upstream answering after "
            f"{args.delay:.1f} s; median (min-max) of {args.reps} interleaved repetitions; "
            f"load average {before[0]:.1f} before, {after[0]:.1f} after; "
            f"{env.machine()['cores']} cores).\n\n"
            + table(["row", "tasks/s", "slots busy", "server CPU µs/task",
                     "worker CPU µs/task", "worker RSS MiB", "RSS KiB per in-flight task",
                     "RSS MiB per process", "server connections"], body) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "in-flight.json").write_text(json.dumps(
        {"rows": rows, "load_before": before, "load_after": after,
         "machine": env.machine()}, indent=1, default=str))
    draft = args.out / "in-flight.md"
    if draft.exists() and "<!-- measured -->" in draft.read_text():
        # (the analysis below the marker is kept; the table above it is replaced)
        tail = draft.read_text().split("<!-- measured -->", 1)[1]
        text += "\n<!-- measured -->" + tail
    draft.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
