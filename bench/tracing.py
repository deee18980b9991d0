"""``python -m bench.tracing``: what tracing costs the throughput stage, paired.

The throughput stage's workload (bench.throughput.measure: worker processes running no-op
tasks with shard keys, claim batch 1 and 10) three ways, interleaved in each repetition
(their order rotating from one to the next) on one embedded server: tracing off (no
OTEL_* variable: today's code path), and on, every worker exporting OTLP to a real Jaeger
(tests/support/jaeger.py, built by `make e2e-bins`) with
OTEL_TRACES_SAMPLER=parentbased_traceidratio at 100 % and at 1 %. In the traced variants
the harness's enqueue is traced as well (same sampler), so sampled attempts link to
their stored context as in production. Writes ``bench/results/tracing-cost.md`` and
``tracing-cost.json``.

``--before DIR`` (an older tree's ``jobrunner/`` and ``sql/``, e.g. ``git archive main
jobrunner sql | tar -x -C DIR``, with the same schema as this one) adds the same three
variants with that tree's workers, interleaved in the same repetitions: both trees' cost
in one run, each paired with its own `off`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jobrunner.observability import tracing
from tests.support.jaeger import Jaeger

from . import env
from .report import spread, table
from .systems import Jobrunner
from .throughput import measure


class Traced(Jobrunner):
    """The same workers with the OTEL_* environment of `ratio` sampling into `jaeger`."""

    def __init__(self, server: env.Server, jaeger: Jaeger | None, ratio: float,
                 name: str, tree: Path | None = None) -> None:
        super().__init__(server)
        self.jaeger, self.ratio, self.label, self.tree = jaeger, ratio, name, tree

    def _env(self) -> dict[str, str]:
        if self.jaeger is None:
            return {}
        return self.jaeger.otel_env("bench-worker",
                                    OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                                    OTEL_TRACES_SAMPLER_ARG=str(self.ratio))

    def worker(self, batch_size: int, log: Path | None = None):
        if self.tree is None:
            return env.spawn(self.worker_args(batch_size), log=log,
                             env=env.child_env(**self._env()))
        # (as bench.compare's: `python -m` from the tree imports its jobrunner first;
        # bench.handlers comes from this checkout)
        pythonpath = os.pathsep.join([str(self.tree), str(env.REPO)])
        return env.spawn(self.worker_args(batch_size), log=log, cwd=self.tree,
                         env=env.child_env(PYTHONPATH=pythonpath, **self._env()))

    def enqueue(self, n: int) -> None:
        if self.jaeger is None:
            return super().enqueue(n)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(resource=Resource.create({"service.name": "bench-enqueue"}),
                                  sampler=ParentBased(TraceIdRatioBased(self.ratio)))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
            endpoint=f"http://127.0.0.1:{self.jaeger.otlp}/v1/traces")))
        tracing.use(provider)
        try:
            super().enqueue(n)
        finally:
            tracing.use(None)
            provider.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    parser.add_argument("--before", type=Path, help="another tree's workers as well")
    parser.add_argument("--label", default="before", help="what DIR is, for the table")
    args = parser.parse_args(argv)
    if args.before is not None:
        args.before = args.before.resolve()
        if not (args.before / "jobrunner" / "worker" / "process.py").exists():
            parser.error(f"{args.before} has no jobrunner/worker/process.py")
        # (one database for both: this tree's enqueue and schema)
        if _sql(args.before / "sql") != _sql(env.REPO / "sql"):
            parser.error(f"{args.before}/sql differs from this tree's: not one schema")
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # clean up
    server = env.Server()
    server.start()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = env.load()
    runs = []
    labels: tuple[str, ...] = ("off", "on, 100 %", "on, 1 %")
    if args.before is not None:
        labels += tuple(f"{args.label}: {label}" for label in labels)
    try:
        with tempfile.TemporaryDirectory() as tmp, Jaeger(Path(tmp)) as jaeger:
            systems = [Traced(server, None, 0.0, labels[0]),
                       Traced(server, jaeger, 1.0, labels[1]),
                       Traced(server, jaeger, 0.01, labels[2])]
            if args.before is not None:
                systems += [Traced(server, None, 0.0, labels[3], args.before),
                            Traced(server, jaeger, 1.0, labels[4], args.before),
                            Traced(server, jaeger, 0.01, labels[5], args.before)]
            systems[0].setup()
            for rep in range(args.reps):
                # (the order rotates: a fixed one always ran 1 % right after 100 %, while
                # Jaeger still took in the spans the 100 % workers flushed as they stopped)
                shift = rep % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    for batch in (1, 10):
                        r = measure(server, system, args.workers, batch, args.tasks, 60)
                        runs.append({**r.as_dict(), "variant": system.label, "rep": rep})
                        print(f"  {system.label:>18} b{batch:<2}: {r.rate:8.1f}/s  worker "
                              f"{r.worker_cpu_s / max(1, r.done) * 1e6:.0f} us/task",
                              flush=True)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"started": started, "load_before": load_before, "load_after": env.load(),
            "command": " ".join(["python -m bench.tracing", *sys.argv[1:]]),
            "machine": env.machine()}
    (args.out / "tracing-cost.json").write_text(json.dumps({"meta": meta, "runs": runs},
                                                           indent=1) + "\n")
    rows = []
    for batch in (1, 10):
        def of(label: str, rep: int, batch: int = batch) -> dict:
            return next(r for r in runs if r["variant"] == label and r["batch"] == batch
                        and r["rep"] == rep)

        for label in labels:
            rs = [r for r in runs if r["variant"] == label and r["batch"] == batch]
            # paired: each repetition's rate over the same repetition's rate with tracing off
            off = label.rsplit(": ", 1)[0] + ": off" if ": " in label else "off"
            ratios = [of(label, rep)["rate"] / of(off, rep)["rate"]
                      for rep in range(args.reps)]
            worker = statistics.median(r["worker_cpu_s"] / r["done"] * 1e6 for r in rs)
            rows.append([label, batch, spread([r["rate"] for r in rs]),
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                         f"{worker:,.0f}"])
    text = "\n".join([
        "# What tracing costs the throughput stage (paired, one run)\n",
        f"`{meta['command']}` at {started}; load average before "
        f"{' '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{' '.join(f'{x:.2f}' for x in meta['load_after'])}. {args.workers} worker "
        f"processes, {args.tasks:,} no-op tasks, median of {args.reps} (min-max); the ratio "
        "is each repetition's rate over the same repetition's rate with tracing off"
        + (f" (`{args.label}`: {args.before}'s workers, over their own off)"
           if args.before is not None else "") + ".\n",
        table(["tracing", "claim batch", "tasks/s", "rate / off", "worker µs/task"], rows)
        + "\n"])
    (args.out / "tracing-cost.md").write_text(text)
    print(text)


def _sql(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.sql"))}


if __name__ == "__main__":
    main()
