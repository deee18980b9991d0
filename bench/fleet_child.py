"""``python -m bench.fleet_child SYSTEM --pods N``: N simulated worker pods in one process,
for the idle-fleet and wake-up benchmarks (bench/idle_fleet.py).

Each pod is what a worker pod runs, with its own connections and timers; only the
Python process is shared (1,000 processes of 50 MiB each would not fit the machine):

- jobrunner: a `Worker` per pod (claim loop, heartbeat thread, executor), its queue and
  heartbeat connections on --dsn (PgBouncer), and, with --listen-dsn, a `Notifier` of its
  own per pod (one LISTEN connection and one leadership candidacy per pod, as one process
  per pod would have). An older tree (PYTHONPATH) has no notifier: --no-listen, as
  docs/scaling.md told fleets behind PgBouncer to run.
- pgqueuer: a `PgQueuer` per pod on its own asyncpg connection, `run()` with its defaults
  (what `pgq run` starts), all on one event loop.
- procrastinate: an `App` per pod with its own `PsycopgConnector` (pool min_size 1: its
  pool's default of 4 would need 5,000 connections at 1,000 pods) running
  `run_worker_async` (concurrency 1, LISTEN/NOTIFY on, its defaults otherwise).

SIGTERM stops every pod. It prints "ready" once every pod was started.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import signal
import sys
import threading
import time

BATCH = "bench"


def jobrunner_pods(args: argparse.Namespace) -> None:
    from jobrunner.runtime.taskhandlers import make_handler
    from jobrunner.worker.process import Worker, WorkerConfig

    try:
        from jobrunner.worker.notifier import Notifier
    except ImportError:  # an older tree
        Notifier = None
    handler = make_handler(args.handler, None)
    fields = inspect.signature(WorkerConfig).parameters
    workers, threads = [], []
    for i in range(args.pods):
        extra = {}
        if "backoff_base" in fields:
            extra["backoff_base"] = args.backoff_base
        notifier = None
        if args.listen_dsn and Notifier is not None:
            notifier = Notifier(args.listen_dsn)
            extra["listen_dsn"] = args.listen_dsn
        config = WorkerConfig(dsn=args.dsn, batch_id=BATCH, handler=handler,
                              listen=notifier is not None, **extra)
        worker = Worker(config, notifier) if notifier is not None else Worker(config)
        workers.append((worker, notifier))
        thread = threading.Thread(target=worker.run, name=f"pod-{i}", daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(args.stagger)
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    for worker, _ in workers:
        worker.request_stop()
    for thread in threads:
        thread.join(timeout=20)
    for _, notifier in workers:
        if notifier is not None:
            notifier.close()


async def pgqueuer_pods(args: argparse.Namespace) -> None:
    import asyncpg
    from pgqueuer import PgQueuer

    pods = []
    for _ in range(args.pods):
        conn = await asyncpg.connect(args.dsn)
        pgq = PgQueuer.from_asyncpg_connection(conn)

        @pgq.entrypoint("noop")
        async def noop(job) -> None:
            return None

        pods.append((conn, pgq))
    tasks = [asyncio.create_task(pgq.run()) for _, pgq in pods]
    print("ready", flush=True)
    await _until_stopped()
    for _, pgq in pods:
        pgq.shutdown.set()
    await asyncio.wait(tasks, timeout=20)
    for task in tasks:
        task.cancel()
    for conn, _ in pods:
        await conn.close()


async def procrastinate_pods(args: argparse.Namespace) -> None:
    import procrastinate

    apps = []
    for _ in range(args.pods):
        app = procrastinate.App(connector=procrastinate.PsycopgConnector(
            conninfo=args.dsn, min_size=1))

        @app.task(name="noop")
        async def noop() -> None:
            return None

        await app.open_async()
        apps.append(app)
    tasks = [asyncio.create_task(app.run_worker_async(
        concurrency=1, wait=True, install_signal_handlers=False)) for app in apps]
    print("ready", flush=True)
    await _until_stopped()
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=20)
    for app in apps:
        await app.close_async()


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_child")
    parser.add_argument("system", choices=["jobrunner", "pgqueuer", "procrastinate"])
    parser.add_argument("--pods", type=int, required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--listen-dsn")
    parser.add_argument("--handler", default="bench.handlers:stamp")
    parser.add_argument("--backoff-base", type=float, default=1.0)
    parser.add_argument("--stagger", type=float, default=0.01)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.system == "jobrunner":
        jobrunner_pods(args)
    elif args.system == "pgqueuer":
        asyncio.run(pgqueuer_pods(args))
    else:
        asyncio.run(procrastinate_pods(args))


if __name__ == "__main__":
    main()
