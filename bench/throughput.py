"""Throughput: N worker processes drain a batch of no-op tasks.

One measurement: reset the system's tables, CHECKPOINT, start N workers on the empty
queue and wait until they are all connected and idle, then enqueue the tasks in one
transaction (its NOTIFY wakes the workers) and poll the done count every 50 ms. The
rate is tasks done / seconds from the enqueue's commit to the last task done (or to
the time cap, for systems too slow to drain in time). Worker start-up is therefore not
counted, for any system. Server CPU is that of every server process except the backend
of the harness's own polling connection.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .env import Server, running, tree_cpu, wait_until
from .systems import PgBench, System


@dataclass
class Run:
    system: str
    workers: int
    batch: int
    tasks: int
    done: int
    seconds: float
    rate: float
    pg_cpu_s: float
    worker_cpu_s: float
    capped: bool
    wal_bytes: int = 0
    # time.monotonic() of the poll that saw the run done (not reported): the workers'
    # shutdown after it (seconds, with the notifier's leader hand-over) is not the run's
    ended: float = 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["ended"]
        return out


def measure(server: Server, system: System, workers: int, batch: int, tasks: int,
            cap: float, logdir: Path | None = None) -> Run:
    system.reset()
    server.checkpoint()
    logs = [logdir / f"{system.name}-n{workers}-b{batch}-{i}.log" if logdir else None
            for i in range(workers)]
    procs = [system.worker(batch, log=log) for log in logs]
    with running(procs):
        def ready() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{system.name} worker exited with {p.returncode}"
                                       f" (logs: {logdir})")
            return system.connections() >= workers * system.per_process_connections

        wait_until(ready, timeout=120, interval=0.1, what=f"{system.name} workers to connect")
        time.sleep(1.0)  # let them finish their start-up queries and go idle
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{system.name} worker exited with {p.returncode}"
                                   f" (log: {logdir})")
        harness = frozenset({system.poll_backend()})
        cpu_pg0 = server.cpu_seconds(harness)
        cpu_w0 = sum(tree_cpu(p.pid) for p in procs)
        wal0 = server.wal_lsn()
        system.enqueue(tasks)
        start = time.monotonic()
        done = 0
        capped = False
        while True:
            time.sleep(0.05)
            done = system.done(tasks)
            now = time.monotonic()
            if done >= tasks:
                break
            if now - start > cap:
                capped = True
                break
        seconds = now - start
        cpu_pg = server.cpu_seconds(harness) - cpu_pg0
        cpu_w = sum(tree_cpu(p.pid) for p in procs) - cpu_w0
        wal = server.wal_lsn() - wal0
    return Run(system.name, workers, batch, tasks, done, round(seconds, 3),
               round(done / seconds, 1), round(cpu_pg, 2), round(cpu_w, 2), capped, wal,
               ended=now)


def pgbench_run(server: Server, bench: PgBench, clients: int, seconds: float) -> dict:
    server.checkpoint()
    result = bench.run(clients, seconds)
    return {"system": "pgbench", "workers": clients, **result}
