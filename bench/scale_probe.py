"""``python -m bench.scale_probe``: where the 16-worker drop of claim batch 10 comes from.

Three shapes of the same work (N workers, claim batch 10, 20,000 no-op tasks), run
interleaved in one invocation:

- ``one``: every worker claims from one batch (the throughput stage's workload);
- ``long``: the same with three times the tasks (is it a start-up or tail effect of a
  run that lasts about a second?);
- ``split``: each worker has a batch of its own (N batches of 20,000 / N tasks): the
  same processes, connections, commits and tasks, but no worker ever scans past or
  waits on another's rows and pages. Timed from before the first of the N enqueues, so
  the split runs carry that handicap.

If ``split`` holds at 16 workers where ``one`` falls, the loss is contention on the shared
head of the batch (index and heap pages every claim reads and writes), not the number
of processes on two cores.

    python -m bench.scale_probe --workers 4,16 --reps 2 --shards 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psycopg
from psycopg.rows import dict_row

from jobrunner.store.sqlfiles import query

from .env import Server, machine, running, spawn, tree_cpu, wait_until
from .systems import TENANT, Jobrunner


class Split(Jobrunner):
    """N batches, one per worker."""

    def __init__(self, server: Server, parts: int, **kw) -> None:
        super().__init__(server, **kw)
        self.parts = parts
        self._next = 0

    def batches(self) -> list[str]:
        return [f"bench-{i}" for i in range(self.parts)]

    def reset(self) -> None:
        super().reset()
        queue, _, _ = self.api()
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            for b in self.batches():
                queue(conn).enqueue(b, TENANT, [])

    def enqueue(self, n: int) -> None:
        queue, timing, _ = self.api()
        per = n // self.parts
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            for i, b in enumerate(self.batches()):
                queue(conn, timing()).enqueue(b, TENANT, self.specs(per, prefix=f"p{i}-"))

    def done(self, total: int) -> int:
        return sum(self.sql(query("batch_counts"), {"batch_id": b})[0][2]
                   for b in self.batches())

    def worker_args_for(self, i: int, batch_size: int) -> list[str]:
        args = self.worker_args(batch_size)
        args[args.index("--batch") + 1] = f"bench-{i}"
        return args


def run(server: Server, system: Jobrunner, workers: int, tasks: int, cap: float) -> dict:
    system.reset()
    server.checkpoint()
    if isinstance(system, Split):
        procs = [spawn(system.worker_args_for(i, 10)) for i in range(workers)]
    else:
        procs = [spawn(system.worker_args(10)) for _ in range(workers)]
    with running(procs):
        wait_until(lambda: system.connections() >= workers, timeout=120, interval=0.1,
                   what="workers")
        time.sleep(1.0)
        harness = frozenset({system.poll_backend()})
        pg0 = server.cpu_seconds(harness)
        w0 = sum(tree_cpu(p.pid) for p in procs)
        start = time.monotonic()
        system.enqueue(tasks)
        while True:
            time.sleep(0.02)
            done = system.done(tasks)
            now = time.monotonic()
            if done >= tasks or now - start > cap:
                break
        pg = server.cpu_seconds(harness) - pg0
        w = sum(tree_cpu(p.pid) for p in procs) - w0
    secs = now - start
    return {"workers": workers, "tasks": tasks, "done": done, "rate": round(done / secs),
            "pg_us_per_task": round(pg / max(done, 1) * 1e6, 1),
            "worker_us_per_task": round(w / max(done, 1) * 1e6, 1),
            "cores_busy": round((pg + w) / secs, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,16")
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cap", type=float, default=30.0)
    ap.add_argument("--shapes", default="one,long,split")
    args = ap.parse_args()
    server = Server()
    server.start()
    try:
        print(json.dumps({"machine": machine()}), flush=True)
        for rep in range(args.reps):
            for n in [int(w) for w in args.workers.split(",")]:
                for shape in args.shapes.split(","):
                    system = (Split(server, n, shards=args.shards) if shape == "split"
                              else Jobrunner(server, shards=args.shards))
                    tasks = args.tasks * (3 if shape == "long" else 1)
                    row = run(server, system, n, tasks, args.cap)
                    print(json.dumps({"rep": rep, "shape": shape, **row}), flush=True)
    finally:
        server.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
