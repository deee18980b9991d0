"""``python -m bench.compare --before DIR``: the optimisations' effect, in one run.

DIR holds an older jobrunner tree (its ``jobrunner/`` and ``sql/``), e.g. made with
``git archive <commit> jobrunner sql | tar -x -C DIR``. Its workers and this tree's run
the same workload (4 processes, 20,000 no-op tasks with 1,000 shard keys, claim batch
1 and 10, 3 interleaved repetitions) on one embedded server, against the same schema.
Writes ``bench/results/before-after.md`` and ``before-after.json``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import env
from .report import spread, table
from .systems import BATCH, Jobrunner
from .throughput import measure


class Before(Jobrunner):
    """Workers importing jobrunner from another tree, on its own database with that
    tree's own migrations (an older tree may need an index a newer one dropped)."""

    name = "before"
    db = "bench_before"

    def __init__(self, server: env.Server, tree: Path) -> None:
        super().__init__(server)
        self.tree = tree

    def install(self) -> None:
        pythonpath = os.pathsep.join([str(self.tree), str(env.REPO)])
        subprocess.run([sys.executable, "-m", "jobrunner", "migrate", "--dsn", self.dsn],
                       cwd=self.tree, env=env.child_env(PYTHONPATH=pythonpath), check=True,
                       stdout=subprocess.DEVNULL)

    def api(self) -> tuple[type, type, type]:
        # The older tree's own enqueue, imported under another package name: its SQL
        # matches its schema.
        if "jobrunner_before" not in sys.modules:
            package = self.tree / "jobrunner"
            spec = importlib.util.spec_from_file_location(
                "jobrunner_before", package / "__init__.py",
                submodule_search_locations=[str(package)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["jobrunner_before"] = module
            spec.loader.exec_module(module)
        queue = importlib.import_module("jobrunner_before.queue")
        try:  # (the layered package: model/validation.py; older trees: validation.py)
            validation = importlib.import_module("jobrunner_before.model.validation")
        except ImportError:
            validation = importlib.import_module("jobrunner_before.validation")
        return queue.Queue, queue.Timing, validation.TaskSpec

    def done(self, total: int) -> int:
        # Older schemas have no per-batch task count (migration 0009) but an index on
        # (batch_id, status).
        return self.sql("SELECT count(*) FROM agent_work_queue WHERE batch_id = %s"
                        " AND status = 'done'", (BATCH,))[0][0]

    def worker(self, batch_size: int, log: Path | None = None):
        # `python -m` puts the working directory first on sys.path: run from the tree,
        # so its jobrunner (and its sql/) is the one imported; bench.handlers comes
        # from this checkout through PYTHONPATH.
        pythonpath = os.pathsep.join([str(self.tree), str(env.REPO)])
        return env.spawn(self.worker_args(batch_size), log=log, cwd=self.tree,
                         env=env.child_env(PYTHONPATH=pythonpath))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--label", default="before", help="what DIR is, for the table")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if not any((args.before / "jobrunner" / p).exists()
               for p in ("worker.py", "worker/process.py")):
        parser.error(f"{args.before} has no jobrunner/worker/process.py")
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # clean up
    server = env.Server()
    server.start()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = env.load()
    runs = []
    try:
        after = Jobrunner(server)
        before = Before(server, args.before.resolve())
        after.setup()
        before.setup()
        for rep in range(args.reps):
            for system, label in ((before, args.label), (after, "this tree")):
                for batch in (1, 10):
                    r = measure(server, system, args.workers, batch, args.tasks, 60)
                    runs.append({**r.as_dict(), "variant": label, "rep": rep})
                    print(f"  {label:>12} b{batch:<2}: {r.rate:8.1f}/s  pg "
                          f"{r.pg_cpu_s / max(1, r.done) * 1e6:.0f} us/task, worker "
                          f"{r.worker_cpu_s / max(1, r.done) * 1e6:.0f} us/task", flush=True)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"started": started, "load_before": load_before, "load_after": env.load(),
            "command": " ".join(["python -m bench.compare", *sys.argv[1:]]),
            "machine": env.machine()}
    (args.out / "before-after.json").write_text(json.dumps({"meta": meta, "runs": runs},
                                                           indent=1) + "\n")
    rows = []
    for label in (args.label, "this tree"):
        for batch in (1, 10):
            rs = [r for r in runs if r["variant"] == label and r["batch"] == batch]
            pg = statistics.median(r["pg_cpu_s"] / r["done"] * 1e6 for r in rs)
            worker = statistics.median(r["worker_cpu_s"] / r["done"] * 1e6 for r in rs)
            wal = statistics.median(r["wal_bytes"] / r["done"] for r in rs)
            rows.append([label, batch, spread([r["rate"] for r in rs]), f"{pg:,.0f}",
                         f"{worker:,.0f}", f"{wal:,.0f}"])
    text = "\n".join([
        "# Before and after the optimisations (one run)\n",
        f"`{meta['command']}` at {started}; load average before "
        f"{' '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{' '.join(f'{x:.2f}' for x in meta['load_after'])}. {args.workers} worker "
        f"processes, {args.tasks:,} no-op tasks with 1,000 shard keys, median of "
        f"{args.reps} (min-max). Same server; only the worker, queue code and schema "
        "differ (each on its own database, migrated by its own tree).\n",
        table(["code", "claim batch", "tasks/s", "PostgreSQL µs/task", "worker µs/task",
               "WAL bytes/task"],
              rows) + "\n"])
    (args.out / "before-after.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
