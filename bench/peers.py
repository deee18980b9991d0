"""The same no-op workload for the peers, through their documented worker entry points.

pgqueuer:      ``pgq run bench.peers:pgqueuer_factory --batch-size B`` (a factory that
               yields a PgQueuer with one entrypoint, as its docs show).
procrastinate: ``procrastinate --app=bench.peers.procrastinate_app worker`` (an App with
               a PsycopgConnector and one task; concurrency 1, its default).

The DSN comes from BENCH_PEER_DSN.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import procrastinate

PGQ_ENTRYPOINT = "noop"


@asynccontextmanager
async def pgqueuer_factory():
    import asyncpg
    from pgqueuer import PgQueuer

    conn = await asyncpg.connect(os.environ["BENCH_PEER_DSN"])
    pgq = PgQueuer.from_asyncpg_connection(conn)

    @pgq.entrypoint(PGQ_ENTRYPOINT)
    async def noop(job) -> None:
        return None

    try:
        yield pgq
    finally:
        await conn.close()


procrastinate_app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("BENCH_PEER_DSN", "")))


@procrastinate_app.task(name="noop")
async def procrastinate_noop() -> None:
    # async: no hop through a thread, procrastinate's fastest path for a no-op.
    return None


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.peers pgqueuer --batch-size B``: what ``pgq run`` does (its
    documented ``pgqueuer.run(factory)``, on the event loop its CLI picks: uvloop when
    installed), without the CLI, whose --log-level parsing fails with this typer."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["pgqueuer"])
    parser.add_argument("--batch-size", type=int, default=10)
    args = parser.parse_args(argv)
    import logging

    import pgqueuer
    from pgqueuer.adapters.cli.cli import asyncio_run

    logging.basicConfig(level=logging.WARNING)
    asyncio_run(pgqueuer.run(pgqueuer_factory, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
