"""Shared fixtures: a real PostgreSQL (embedded by default, JOBRUNNER_TEST_DSN for another
server), a fresh migrated database per test, and helpers to run the CLI and workers as
real processes."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from jobrunner.local.embedded import EmbeddedPostgres
from jobrunner.queue.client import Queue
from jobrunner.store.migrate import migrate
from tests.support.handlers import EXEC_LOG_DDL
from tests.support.processes import spawned

TEMPLATE_DB = "jobrunner_test_template"


# Tests of binaries that `make test` builds in the background while the suite runs
# (hack/test-suite.sh; the cluster's binaries come first, these after): they run last, so
# that they find their binary built instead of holding a pytest worker while it builds.
RUN_LAST = frozenset({"test_alerts.py", "test_chart_api_static.py", "test_dashboard.py",
                      "test_tracing.py", "test_kueue_e2e.py", "test_tracing_e2e.py"})


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in RUN_LAST)  # (stable: order kept otherwise)


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true",
                     help="run the chaos soak at full size (50k tasks) instead of the CI size")


# Figure lines (tests.support.figures.show): measured results a test prints for the CI log.
# Under pytest-xdist a worker's own output never reaches the log, but its reports'
# user_properties do: the lines are collected here, in the process that writes the log.
_FIGURES: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _FIGURES.extend(v for k, v in report.user_properties if k == "figure")


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("figures measured by the tests")
        for line in _FIGURES:
            terminalreporter.write_line(line)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


# Under CI=true no test may skip: a skip there is a guarantee left unproven while the run
# stays green (a missing tool, a JOBRUNNER_TEST_DSN, an import). The test command installs
# everything the suite needs (pyproject's `test` extra, the Makefile's SYSTEM_PACKAGES), so
# a skip in CI is a broken setup, reported as a failure with the skip's reason. Outside CI
# a skip stays a skip (a laptop without pgbouncer).
def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which allows no skip: {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which allows no skip: {_skip_reason(report)}"


def _with_db(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    external = os.environ.get("JOBRUNNER_TEST_DSN")
    if external:
        yield external
        return
    root = Path(tempfile.mkdtemp(prefix="jobrunner-test-pg-"))
    server = EmbeddedPostgres(root)
    dsn = server.start()
    try:
        yield dsn
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def template_db(pg_admin_dsn: str) -> str:
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB}")
        conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    with psycopg.connect(_with_db(pg_admin_dsn, TEMPLATE_DB)) as conn:
        migrate(conn)
        conn.execute(EXEC_LOG_DDL)
    return TEMPLATE_DB


def _scratch_database(admin_dsn: str, template: str | None) -> Iterator[str]:
    """Create a uniquely named database (from a template if given), drop it afterwards."""
    name = f"jr_{uuid.uuid4().hex[:12]}"
    clause = f" TEMPLATE {template}" if template else ""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}{clause}")
    yield _with_db(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def dsn(pg_admin_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    yield from _scratch_database(pg_admin_dsn, template_db)


@pytest.fixture
def empty_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh database without the schema."""
    yield from _scratch_database(pg_admin_dsn, None)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, row_factory=dict_row) as c:
        yield c


@pytest.fixture
def queue(conn: psycopg.Connection) -> Queue:
    return Queue(conn)


@pytest.fixture
def own_server() -> Iterator[EmbeddedPostgres]:
    """A private embedded server a test may stop and restart: embedded whatever
    JOBRUNNER_TEST_DSN says (that server is shared, and not this test's to restart), so
    the restart, chaos and failover tests run against any JOBRUNNER_TEST_DSN too."""
    root = Path(tempfile.mkdtemp(prefix="jobrunner-own-pg-"))
    server = EmbeddedPostgres(root)
    server.start()
    with psycopg.connect(server.dsn()) as c:
        migrate(c)
    try:
        yield server
    finally:
        server.destroy()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _reap_workers() -> Iterator[None]:
    """A failed assertion must not leave worker processes behind for the next test."""
    yield
    while spawned:
        proc = spawned.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait(10)


