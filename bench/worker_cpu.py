"""``python -m bench.worker_cpu --before DIR``: a worker's own CPU per task, two trees.

The throughput runs measure the workers' CPU while four of them and the server share
two cores, which moves by ±20 % from run to run. This measures one worker process
alone (the server idle otherwise): the process's user + system CPU per task over
6,000 no-op tasks with 1,000 shard keys, heartbeat and LISTEN threads on, for the
older tree in DIR (its ``jobrunner/``, e.g. from ``git archive <commit> jobrunner sql``)
and this one, interleaved round by round on one embedded server. Both trees must use
the same schema (this tree migrates it).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (bench.env and bench.systems import jobrunner: only the parent process loads them, so
# that a child imports the jobrunner of the tree it was given)


def child(tree: str, dsn: str, batch_size: int, tasks: int, batch: str) -> None:
    """One worker of `tree`, in this process: prints its CPU and wall time per task."""
    sys.path.insert(0, tree)
    import psycopg

    import jobrunner
    from jobrunner.model.types import Timing
    from jobrunner.model.validation import TaskSpec
    from jobrunner.queue.client import Queue
    from jobrunner.worker.config import WorkerConfig
    from jobrunner.worker.process import Worker
    if not Path(jobrunner.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"imported {jobrunner.__file__}, not the jobrunner of {tree}")

    with psycopg.connect(dsn) as conn:
        Queue(conn, Timing()).enqueue(batch, "bench", [
            TaskSpec(key=f"k{i}", payload={}, shard_key=f"s{i % 1000}")
            for i in range(tasks + 2000)])
    worker = Worker(WorkerConfig(dsn=dsn, batch_id=batch, handler=lambda task: None,
                                 max_tasks=tasks, batch_size=batch_size))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, wall0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
    worker.run()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    done = worker.stats["claimed"]
    print(f"{(usage.ru_utime + usage.ru_stime - cpu0) / done * 1e6:.2f}"
          f" {(time.perf_counter() - wall0) / done * 1e6:.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=6000)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        tree, dsn, batch_size, tasks, batch = args.child
        child(tree, dsn, int(batch_size), int(tasks), batch)
        return
    if args.before is None or not (args.before / "jobrunner" / "__init__.py").is_file():
        parser.error("--before DIR is required, DIR holding an older tree's jobrunner/")
    from . import env
    from .report import table
    from .systems import Jobrunner

    trees = {"before": str(args.before.resolve()), "this tree": str(env.REPO)}
    server = env.Server()
    server.start()
    try:
        system = Jobrunner(server)
        system.setup()
        cpu: dict[tuple[str, int], list[float]] = {}
        runs = 0
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for batch_size in (1, 10):
                for name in order:
                    runs += 1
                    out = subprocess.run(
                        [sys.executable, "-m", "bench.worker_cpu", "--child", trees[name],
                         system.dsn, str(batch_size), str(args.tasks), f"cpu{runs}"],
                        cwd=env.REPO, env=env.child_env(), capture_output=True, text=True)
                    if out.returncode:
                        # (its stderr, not the command line: that holds the DSN's password)
                        raise SystemExit(f"{name}, batch {batch_size}: worker failed\n"
                                         f"{out.stderr[-3000:]}")
                    cpu.setdefault((name, batch_size), []).append(
                        float(out.stdout.split()[-2]))
        print(table(["code", "claim batch", "worker CPU µs/task, median", "every round"],
                    [[name, batch_size, f"{statistics.median(cpu[(name, batch_size)]):.1f}",
                      ", ".join(f"{v:.0f}" for v in cpu[(name, batch_size)])]
                     for batch_size in (1, 10) for name in trees]))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
