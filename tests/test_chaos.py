"""Chaos soak: kill -9 workers at random and restart PostgreSQL twice while a batch runs,
directly, through PgBouncer in transaction pooling mode, and through a worker pool (pool
workers, a second tenant's batch beside it). Nothing may be lost, stuck,
duplicated in effect, or leased twice per shard.

Bounded for CI (10k tasks, a minute or two each); `pytest --soak` runs a longer one. The
soak itself (workers, kills, checks) is tests/support/soak.py, shared with the failover
soak (tests/test_failover.py).
"""

from __future__ import annotations

import psycopg
import pytest

from tests.support import pgbouncer
from tests.support.soak import N_POISON, N_WORKERS, Fault, report, run_soak

# A soak's length follows the machine's speed, though no longer its work (kills come with
# the batch's progress: tests/support/soak.py). The suite's 600 s limit per test
# (pyproject.toml) was nearly reached: the direct soak took 559 s in a CI run that shared
# the 2 cores with the e2e cluster's start (load average 15), 35 s alone. The limit is
# there to stop a hung test, not to time one: these get twice the suite's.
pytestmark = pytest.mark.timeout(1200)


def _soak(server, worker_dsn: str, tmp_path, *, tasks: int, label: str, capsys,
          extra_env: dict[str, str] | None = None, pool: str | None = None,
          held: int = 4, **more) -> None:
    restarts = [Fault(tasks // 3, lambda: server.restart("fast")),
                Fault(2 * tasks // 3, lambda: server.restart("immediate"))]
    r = run_soak(server.dsn(), worker_dsn, tmp_path, tasks=tasks, label=label,
                 faults=restarts, extra_env=extra_env, pool=pool, **more)
    report(f"chaos[{label}]: tasks={tasks + N_POISON} kills={r.kills} pg_restarts={r.faults} "
           f"done={r.counts['done']} dead={r.counts['dead']} (designed poison={N_POISON}) "
           f"leased={r.counts['leased']} pending={r.counts['pending']} stuck={r.stuck} "
           f"duplicate_effects={r.duplicate_effects} overlapping_leases="
           f"{len(r.overlaps)} (samples={r.samples}) "
           f"overlapping_acked_runs={r.acked_overlaps} raw_reexecutions={r.reexecutions} "
           f"{r.exits_figure()} elapsed={r.elapsed:.0f}s", tmp_path, capsys)
    assert r.faults == 2 and r.kills >= 3
    r.assert_nothing_lost_or_duplicated()
    # Every re-execution is explained by a fault: a kill interrupts at most what a worker
    # held (a claim batch; with an async handler, its concurrency), a restart at most
    # what all workers held.
    assert 0 <= r.reexecutions <= (r.kills + r.faults * N_WORKERS) * held + r.kills * held


@pytest.fixture
def soak_size(request) -> int:
    return 50_000 if request.config.getoption("--soak") else 10_000


@pytest.mark.slow
def test_chaos_soak_direct(own_server, tmp_path, capsys, soak_size):
    _soak(own_server, own_server.dsn(), tmp_path, tasks=soak_size, label="direct",
          capsys=capsys)


@pytest.mark.slow
def test_chaos_soak_async_handler(own_server, tmp_path, capsys, soak_size):
    """The soak with an async handler (issue 30): tasks on the worker's event loop, 32 in
    flight per worker, claims refilling every free slot, leases lost to kills and
    restarts cancelled as coroutines. The same guarantees."""
    from tests.support.soak import WORKER_ARGS

    _soak(own_server, own_server.dsn(), tmp_path, tasks=soak_size, label="async",
          capsys=capsys, handler="tests.support.chaos:handle_async", held=32,
          worker_args=(*WORKER_ARGS, "--concurrency", "32"))


@pytest.mark.slow
def test_chaos_soak_through_a_worker_pool(own_server, tmp_path, capsys, soak_size):
    """The same soak with the batch in a worker pool next to another tenant's batch, and
    pool workers (issue 18): the pool claim keeps every guarantee. Half the size."""
    _soak(own_server, own_server.dsn(), tmp_path, tasks=soak_size // 2, label="pool",
          capsys=capsys, pool="chaos-pool")


@pytest.mark.slow
def test_chaos_soak_as_tenant_bound_pool_workers(own_server, tmp_path, capsys, soak_size):
    """The pool soak with the workers logging in as a worker role bound to exactly the
    pool's two tenants (issue 29): row-level security applies to every claim, ack,
    heartbeat, expiry and effect, and the soak keeps every guarantee. Half the size."""
    from jobrunner.store import roles

    with psycopg.connect(own_server.dsn()) as conn:
        roles.grant(conn, "chaos")
    with psycopg.connect(own_server.dsn()) as conn:
        worker_dsn = roles.create_login(conn, own_server.dsn(), "chaos_pool_workers", "worker",
                                        ["acme", "other-tenant"]).dsn
    _soak(own_server, worker_dsn, tmp_path, tasks=soak_size // 2, label="tenant-pool",
          capsys=capsys, pool="chaos-pool")


@pytest.mark.slow
def test_chaos_soak_through_pgbouncer(own_server, tmp_path, capsys, soak_size):
    if not pgbouncer.available():  # (under CI=true a skip fails: tests/conftest.py)
        pytest.skip("pgbouncer is not installed (make system-deps installs it)")
    bouncer = pgbouncer.PgBouncer(own_server.dsn(), pool_size=20).start()
    try:
        # The documented PgBouncer settings: per-transaction limits instead of session
        # settings, no server-side prepared statements (PgBouncer 1.18 cannot keep them),
        # and a direct DSN for each process's notifier (LISTEN and the maintenance
        # leader's lock, which a transaction pooler cannot carry).
        _soak(own_server, bouncer.dsn, tmp_path, tasks=soak_size, label="pgbouncer",
              capsys=capsys, extra_env={"JOBRUNNER_PREPARED_STATEMENTS": "0",
                                        "JOBRUNNER_TRANSACTION_POOLING": "1",
                                        "JOBRUNNER_LISTEN_DATABASE_URL": own_server.dsn()})
    finally:
        bouncer.stop()
