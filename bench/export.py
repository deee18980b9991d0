"""``python -m bench.export``: `jobrunner results` over a million results, rows/s and memory.

One embedded PostgreSQL; a batch of ROWS finished tasks and one of SMALL (default
1,000,000 and 100,000) are written straight into the queue table with generate_series
(a realistic result: a short summary and a token count, about 120 bytes of JSON), plus
1 % dead tasks in the big batch for the error export. Then each export runs as its own
process, `python -m jobrunner results --batch B --format F --output FILE`, exactly as a
user runs it, interleaved over the repetitions: every format of the big batch into a
file, JSON lines into /dev/null, the small batch, and the errors. Measured per run: wall
time of the whole process (interpreter start included), rows/s over it, and the peak
RSS of that process (ru_maxrss from wait4). Constant memory shows as the same peak RSS
for 100,000 and 1,000,000 rows; `jobrunner --help` gives the floor (interpreter and
imports). Writes ``bench/results/export.md`` and ``export.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from jobrunner.store.migrate import migrate

from . import env
from .report import table

BIG, SMALL = "export-big", "export-small"
FILL = """
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, status, attempts,
    lease_owner, result, last_error, run_after, finished_at, created_at, updated_at)
SELECT %(batch)s, 'bench', 'chunk-' || lpad(g::text, 7, '0'), '{}',
       CASE WHEN g %% 100 = 0 THEN 'dead' ELSE 'done' END, 1, 'bench-worker',
       CASE WHEN g %% 100 = 0 THEN NULL ELSE jsonb_build_object(
           'summary', 'Chunk ' || g || ' of the quarterly report: revenue up, costs flat.',
           'tokens', 200 + g %% 300) END,
       CASE WHEN g %% 100 = 0 THEN 'PermanentError: chunk ' || g || ' is empty' END,
       now(), now(), now(), now()
FROM generate_series(1, %(rows)s::bigint) g
"""


def fill(dsn: str, rows: int, small: int) -> dict[str, float]:
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        for batch, n in ((BIG, rows), (SMALL, small)):
            conn.execute("INSERT INTO agent_batch (batch_id, tenant_id, tasks)"
                         " VALUES (%s, 'bench', %s)", (batch, n))
            conn.execute(FILL, {"batch": batch, "rows": n})
        conn.execute("VACUUM ANALYZE agent_work_queue")
        size = conn.execute("SELECT pg_total_relation_size('agent_work_queue')").fetchone()[0]
    return {"seconds": time.monotonic() - started, "table_mib": size / 2**20}


def run(args: list[str], dsn: str) -> dict[str, float]:
    """One `python -m jobrunner ...` process: wall seconds and its own peak RSS."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jobrunner", *args],
                            env=env.child_env(JOBRUNNER_DATABASE_URL=dsn), cwd=env.REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"jobrunner {' '.join(args[:3])} failed: {stderr.decode()[-2000:]}")
    return {"seconds": wall, "peak_rss_mib": usage.ru_maxrss / 1024,
            "cpu_seconds": usage.ru_utime + usage.ru_stime}


def count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    parser.add_argument("--report-only", action="store_true",
                        help="re-render export.md from the export.json in --out")
    args = parser.parse_args(argv)
    if args.report_only:
        record = json.loads((args.out / "export.json").read_text())
        (args.out / "export.md").write_text(report(record))
        return
    began = time.monotonic()
    load_before = env.load()
    server = env.Server()
    server.start()
    tmp = Path(tempfile.mkdtemp(prefix="jobrunner-export-"))
    runs: list[dict] = []
    try:
        dsn = server.create_db("bench_export")
        filled = fill(dsn, args.rows, args.small)
        print(f"filled {args.rows:,} + {args.small:,} rows in {filled['seconds']:.0f}s "
              f"({filled['table_mib']:.0f} MiB with indexes)", flush=True)
        server.checkpoint()
        big_done = args.rows - args.rows // 100
        cases = [
            ("jsonl", BIG, big_done, ["--format", "jsonl"], True),
            ("csv", BIG, big_done, ["--format", "csv"], True),
            ("openai", BIG, big_done, ["--format", "openai"], True),
            ("jsonl to /dev/null", BIG, big_done, ["--format", "jsonl"], False),
            ("jsonl, small batch", SMALL, args.small - args.small // 100,
             ["--format", "jsonl"], True),
            ("--errors jsonl", BIG, args.rows // 100, ["--errors"], True),
        ]
        floor = run(["--help"], dsn)
        for repetition in range(args.repeat):
            order = cases if repetition % 2 == 0 else list(reversed(cases))
            for name, batch, expected, extra, to_file in order:
                target = tmp / "out" if to_file else Path(os.devnull)
                result = run(["results", "--batch", batch, *extra, "--output", str(target)],
                             dsn)
                if to_file:
                    lines = count_lines(target) - (1 if "csv" in extra else 0)
                    if lines != expected:
                        raise RuntimeError(f"{name}: {lines} lines, expected {expected}")
                    result["file_mib"] = target.stat().st_size / 2**20
                    target.unlink()
                runs.append({"case": name, "batch": batch, "rows": expected,
                             "repetition": repetition, **result})
                print(f"{name:20} {expected:>9,} rows {result['seconds']:6.2f}s "
                      f"{expected / result['seconds']:>9,.0f} rows/s  peak RSS "
                      f"{result['peak_rss_mib']:.0f} MiB", flush=True)
        version = server.version()
    finally:
        server.stop()
    record = {"started": datetime.now(UTC).isoformat(timespec="seconds"),
              "duration_s": round(time.monotonic() - began), "machine": env.machine(),
              "postgres": version, "load_before": load_before, "load_after": env.load(),
              "fill": filled, "floor": floor, "runs": runs,
              "command": "python -m bench.export" + (f" {' '.join(argv)}" if argv else "")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "export.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "export.md").write_text(report(record))
    print(f"wrote {args.out / 'export.md'}")


def memory(record: dict) -> str:
    """The constant-memory comparison, in numbers: the big batch against the small one."""
    def peak(case: str) -> tuple[int, float]:
        runs = [r for r in record["runs"] if r["case"] == case]
        return runs[0]["rows"], max(r["peak_rss_mib"] for r in runs)

    (big, big_rss), (small, small_rss) = peak("jsonl"), peak("jsonl, small batch")
    floor = record["floor"]["peak_rss_mib"]
    above = sorted({round(big_rss - floor), round(small_rss - floor)})
    return (f"Memory: {big:,} rows peak at {big_rss:.1f} MiB, {small:,} rows at "
            f"{small_rss:.1f} MiB ({big / small:.0f}x the rows, "
            f"{abs(big_rss - small_rss):.1f} MiB apart); "
            f"{'-'.join(str(a) for a in above)} MiB above the floor. The export holds one "
            "fetch of a server-side cursor (5,000 rows) and a 1 MiB write buffer, never "
            "the batch.")


def report(record: dict) -> str:
    rows = []
    cases = list(dict.fromkeys(r["case"] for r in record["runs"]))
    for case in cases:
        runs = [r for r in record["runs"] if r["case"] == case]
        seconds = statistics.median(r["seconds"] for r in runs)
        rows.append([case, f"{runs[0]['rows']:,}",
                     f"{seconds:.2f} ({min(r['seconds'] for r in runs):.2f}-"
                     f"{max(r['seconds'] for r in runs):.2f})",
                     f"{runs[0]['rows'] / seconds:,.0f}",
                     f"{statistics.median(r['cpu_seconds'] for r in runs):.2f}",
                     f"{max(r['peak_rss_mib'] for r in runs):.1f}",
                     f"{runs[0]['file_mib']:.0f}" if "file_mib" in runs[0] else "-"])
    machine = record["machine"]
    floor = record["floor"]
    return "\n".join([
        "# Export: `jobrunner results`\n",
        f"Generated by `{record['command']}` on {record['started']} "
        f"({record['duration_s']} s in all). Each row is one `python -m jobrunner results "
        "--batch B ... --output FILE` process, run "
        f"{len(record['runs']) // len(cases)} times, interleaved; seconds are the whole "
        "process's wall time (interpreter start and imports included) as median (min-max), "
        "rows/s is rows over that median, CPU is the process's own user + system time, "
        "peak RSS is the largest ru_maxrss of the process over the runs. The rows were "
        "written with generate_series (results of about 120 bytes of JSON; 1 % of the big "
        "batch dead, with an error).\n",
        table(["export", "rows", "seconds", "rows/s", "CPU s", "peak RSS MiB", "file MiB"],
              rows),
        "",
        f"Floor: `python -m jobrunner --help` peaks at {floor['peak_rss_mib']:.1f} MiB "
        f"(interpreter and imports) in {floor['seconds']:.2f} s.",
        "",
        memory(record),
        "",
        f"Fill: {record['fill']['seconds']:.0f} s; the queue table with its indexes "
        f"{record['fill']['table_mib']:.0f} MiB. Machine: {machine['cpu']}, "
        f"{machine['cores']} cores, {machine['memory_gib']} GiB, Python {machine['python']}, "
        f"{record['postgres'].split(' on ')[0]} (embedded, default settings of the bench "
        f"server). Load average before {' '.join(f'{x:.2f}' for x in record['load_before'])}"
        f", after {' '.join(f'{x:.2f}' for x in record['load_after'])}.",
        "",
    ])


if __name__ == "__main__":
    main()
