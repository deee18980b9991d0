"""Least privilege in the database (docs/security.md): the components' roles made by
`jobrunner db grant` as an installing role that is not a superuser, what each may do,
and tenants' login roles bound by `jobrunner tenant create`, attacked on the real server.

Roles are the cluster's: every test uses a prefix of its own, and a database of its own
owned by an installing role of its own (CREATEROLE, no superuser), as on a managed
PostgreSQL or CloudNativePG.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store import roles, worker_waits
from jobrunner.store.migrate import MigrationDenied, migrate
from jobrunner.store.privileges import UnsafeBinding
from jobrunner.store.sqlfiles import migrations, sql_dir
from tests.support import attacks
from tests.support.installs import Install, installing_role
from tests.support.processes import cli, start_worker, wait_for

HANDLER = "tests.support.handlers:noop"


@pytest.fixture
def install(pg_admin_dsn: str) -> Iterator[Install]:
    with installing_role(pg_admin_dsn, "roles") as made:
        yield made


def _granted(install: Install) -> roles.GrantReport:
    with psycopg.connect(install.dsn) as conn:
        return roles.grant(conn, install.prefix)


def _granted_on_an_older_schema(install: Install) -> None:
    """Today's grants on a schema of an earlier migration: a table a later migration
    makes stands in as an empty stub while granting (the grants name every table by
    name), and is dropped after."""
    text = (sql_dir() / "grants" / "privileges.sql").read_text()

    def named(kind: str) -> list[str]:
        found = re.search(rf"REVOKE ALL ON {kind}(.*?)\sFROM", text, re.S).group(1)
        return [t.strip() for t in found.split(",")]

    with psycopg.connect(install.dsn) as conn:
        migrate(conn)
        later = [(kind, t) for kind, names in (("TABLE", named("")),
                                               ("SEQUENCE", named("SEQUENCE ")))
                 for t in names
                 if conn.execute("SELECT to_regclass(%s) IS NULL", (t,)).fetchone()[0]]
        for kind, t in later:
            conn.execute(sql.SQL("CREATE {} {}" + (" ()" if kind == "TABLE" else "")).format(
                sql.SQL(kind), sql.Identifier(t)))
        # (and a function a later migration makes, as a stub of its signature)
        functions = re.search(r"REVOKE ALL ON FUNCTION(.*?)\sFROM", text, re.S).group(1)
        stubs = [sql.SQL("{}({})").format(sql.Identifier(name), sql.SQL(args))
                 for name, args in re.findall(r"(\w+)\(([^)]*)\)", functions)
                 if conn.execute("SELECT to_regprocedure(%s) IS NULL",
                                 (f"{name}({args})",)).fetchone()[0]]
        for stub in stubs:
            conn.execute(sql.SQL("CREATE FUNCTION {} RETURNS void LANGUAGE sql AS ''").format(
                stub))
        roles.grant(conn, install.prefix)
        for kind, t in later:
            conn.execute(sql.SQL("DROP {} {}").format(sql.SQL(kind), sql.Identifier(t)))
        conn.commit()
    with psycopg.connect(install.admin_dsn) as conn:  # (grant gave them to the owner role)
        for stub in stubs:
            conn.execute(sql.SQL("DROP FUNCTION {}").format(stub))


def _login(install: Install, component: str, tenants: tuple[str, ...] = (),
           role: str | None = None) -> str:
    name = role or f"{install.prefix}_{component}_{'_'.join(tenants) or 'all'}"
    with psycopg.connect(install.dsn) as conn:
        return roles.create_login(conn, install.dsn, name, component, tenants).dsn


def _denied(dsn: str, statement: str, params: dict | None = None) -> str:
    with (psycopg.connect(dsn, autocommit=True) as conn,
          pytest.raises(psycopg.errors.InsufficientPrivilege) as caught):
        conn.execute(statement, params)
    return caught.value.diag.message_primary or ""


# -- 1. roles ----------------------------------------------------------------------------

def test_grant_as_a_non_superuser_creates_the_roles_and_is_idempotent(install):
    with psycopg.connect(install.dsn, row_factory=dict_row) as conn:
        me = conn.execute("SELECT rolsuper, rolcreaterole FROM pg_roles "
                          "WHERE rolname = current_user").fetchone()
    assert me == {"rolsuper": False, "rolcreaterole": True}

    first = _granted(install)
    assert sorted(first.created) == sorted(f"{install.prefix}_{c}" for c in roles.COMPONENTS)
    last = migrations()[-1]
    assert first.migrations and first.migrations[-1] == f"{last.version:04d}_{last.name}"
    second = _granted(install)
    assert second.created == [] and second.migrations == []

    with psycopg.connect(install.admin_dsn, row_factory=dict_row) as conn:
        owners = {r["relname"]: r["owner"] for r in conn.execute(
            "SELECT c.relname, c.relowner::regrole::text AS owner FROM pg_class c "
            "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'S')")}
        functions = {r["owner"] for r in conn.execute(
            "SELECT p.proowner::regrole::text AS owner FROM pg_proc p "
            "WHERE p.pronamespace = 'public'::regnamespace")}
        # the roles hold no attribute beyond logging in (none logs in: groups)
        attributes = conn.execute(
            "SELECT bool_or(rolsuper OR rolcreaterole OR rolcreatedb OR rolbypassrls "
            "OR rolreplication OR rolcanlogin) AS any FROM pg_roles WHERE rolname LIKE %s",
            (f"{install.prefix}\\_%",)).fetchone()["any"]
    assert set(owners.values()) == {f"{install.prefix}_owner"}, owners
    assert functions == {f"{install.prefix}_owner"}
    assert attributes is False


def test_the_grants_name_every_object_the_migrations_make(install):
    """sql/grants/privileges.sql revokes by name: a table, sequence or function a new
    migration adds and the file forgets would keep whatever was granted on it."""
    import re

    from jobrunner.store.sqlfiles import sql_dir

    text = (sql_dir() / "grants" / "privileges.sql").read_text()
    revoked = " ".join(re.findall(r"^REVOKE ALL ON (.*?)^FROM", text, re.M | re.S))
    _granted(install)
    with psycopg.connect(install.admin_dsn) as conn:
        names = [r[0] for r in conn.execute(
            "SELECT relname::text FROM pg_class WHERE relnamespace = 'public'::regnamespace"
            " AND relkind IN ('r', 'S') UNION ALL SELECT p.oid::regprocedure::text"
            " FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace")]
    assert len(names) > 30
    # (regprocedure writes no space after a comma)
    words = set(re.findall(r"\w+(?:\([^)]*\))?", re.sub(r",\s+", ",", revoked)))
    missing = [n for n in names if n not in words]
    assert missing == []


def test_grant_takes_over_a_database_migrated_by_the_installer(install):
    """An install of before the roles: the installer ran `jobrunner migrate` and owns
    everything; `db grant` gives it all to the owner role, and a later `migrate` by the
    installer still runs as the owner."""
    with psycopg.connect(install.dsn) as conn:
        migrate(conn)
        conn.execute("CREATE TABLE not_jobrunners (x int)")
        conn.commit()
    _granted(install)
    with psycopg.connect(install.admin_dsn, row_factory=dict_row) as conn:
        owners = {r["relname"]: r["owner"] for r in conn.execute(
            "SELECT c.relname, c.relowner::regrole::text AS owner FROM pg_class c "
            "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'")}
    assert owners.pop("not_jobrunners") == install.user  # (not jobrunner's: left alone)
    assert set(owners.values()) == {f"{install.prefix}_owner"}


@pytest.mark.parametrize("component", ["operator", "worker", "api", "readonly"])
def test_no_component_but_the_owner_can_run_ddl(install, component):
    _granted(install)
    dsn = _login(install, component)
    for statement in ("DROP TABLE agent_work_queue",
                      "ALTER TABLE agent_work_queue ADD COLUMN x int",
                      "TRUNCATE agent_work_queue",
                      "CREATE TABLE mine (x int)",
                      "CREATE FUNCTION public.mine() RETURNS int LANGUAGE sql AS 'SELECT 1'",
                      "CREATE INDEX ON agent_batch (created_at)",
                      "ALTER TABLE agent_work_queue DISABLE ROW LEVEL SECURITY",
                      "DROP POLICY jobrunner_all ON agent_work_queue",
                      "CREATE POLICY mine ON agent_work_queue USING (true)",
                      "DELETE FROM jobrunner_tenant_role",
                      "INSERT INTO jobrunner_schema_migrations VALUES (999, 'x')"):
        with (psycopg.connect(dsn, autocommit=True) as conn,
              pytest.raises(psycopg.errors.InsufficientPrivilege)):
            conn.execute(statement)
    # and a component migrating finds nothing to do (the operator migrates on first use)
    with psycopg.connect(dsn) as conn:
        assert migrate(conn) == []


def test_a_component_cannot_apply_a_pending_migration_and_is_told_who_can(install):
    _granted(install)
    operator = _login(install, "operator")
    with psycopg.connect(install.admin_dsn) as conn:
        conn.execute("DELETE FROM jobrunner_schema_migrations WHERE version = 22")
    with (psycopg.connect(operator) as conn,
          pytest.raises(MigrationDenied, match=f"{install.prefix}_owner")):
        migrate(conn)


def test_each_component_does_its_work_and_only_that(install):
    _granted(install)
    operator, worker, api, readonly = (_login(install, c)
                                       for c in ("operator", "worker", "api", "readonly"))
    with psycopg.connect(operator, row_factory=dict_row) as conn:
        Queue(conn).enqueue("b1", "acme", [TaskSpec("k1", {"n": 1})])
        conn.commit()
    with psycopg.connect(readonly, row_factory=dict_row) as conn:
        assert conn.execute("SELECT count(*) AS n FROM agent_work_queue").fetchone()["n"] == 1
    for statement in ("UPDATE agent_work_queue SET status = 'done'",
                      "DELETE FROM agent_work_queue", "SELECT * FROM api_key"):
        _denied(readonly, statement)
    # the worker: no API table, no deleting tasks, no pool weights
    for statement in ("SELECT * FROM api_key", "SELECT * FROM api_file_chunk",
                      "SELECT * FROM console_audit", "DELETE FROM agent_work_queue",
                      "DELETE FROM agent_task_effect", "SELECT * FROM agent_work_queue_archive",
                      "SELECT jobrunner_pool_set_weight('p', 'acme', 2)"):
        _denied(worker, statement)
    # the operator: no API table
    for statement in ("SELECT * FROM api_key", "SELECT * FROM api_file"):
        _denied(operator, statement)
    # the API: its tables, not the operator's administration
    with psycopg.connect(api, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM api_key")
    for statement in ("DELETE FROM agent_work_queue", "UPDATE agent_limit SET lanes = 2",
                      "UPDATE agent_limit SET requests = 1", "DELETE FROM agent_limit"):
        _denied(api, statement)
    # ... but the console's admin actions: a limit's pause and resume (its block only),
    # and a tenant's weight in a pool
    with psycopg.connect(api, autocommit=True) as conn:
        conn.execute("UPDATE agent_limit SET blocked_until = NULL, updated_at = now()")
        conn.execute("SELECT jobrunner_pool_set_weight('p', 'acme', 2)")
    # the worker runs the batch to the end
    start_worker(worker, "b1", HANDLER, "--exit-when-drained")
    with psycopg.connect(operator, row_factory=dict_row) as conn:
        wait_for(lambda: conn.execute("SELECT status FROM agent_work_queue").fetchone()
                 ["status"] == "done", what="the worker role's run")


# -- 2. tenants --------------------------------------------------------------------------

@pytest.fixture
def two_tenants(install) -> dict:
    """Tenants a and b, each a batch with a leased task, a result, an effect and usage;
    and a worker login role bound to a."""
    _granted(install)
    with psycopg.connect(install.admin_dsn, row_factory=dict_row) as conn:
        queue = Queue(conn)
        for tenant in ("a", "b"):
            queue.enqueue(f"batch-{tenant}", tenant,
                          [TaskSpec(f"{tenant}{i}", {"secret": f"of {tenant}"}) for i in range(3)])
        conn.execute("UPDATE agent_work_queue SET status = 'leased', lease_owner = 'w-'"
                     " || tenant_id, attempts = 1, locked_until = now() + interval '1 h'"
                     " WHERE task_key LIKE '%%0'")
        conn.execute("UPDATE agent_work_queue SET status = 'done', result = '{\"r\": 1}',"
                     " finished_at = now() WHERE task_key LIKE '%%1'")
        conn.execute("UPDATE agent_work_queue SET status = 'dead', attempts = 8"
                     " WHERE task_key LIKE '%%2'")
        for tenant in ("a", "b"):
            conn.execute(
                "INSERT INTO agent_task_effect (batch_id, task_key, effect_key, task_id,"
                " attempt, lease_owner, result) SELECT batch_id, task_key, 'e', id, 1,"
                " lease_owner, '{}' FROM agent_work_queue WHERE task_key = %s",
                (f"{tenant}0",))
            conn.execute(
                "INSERT INTO agent_task_usage (task_id, attempt, batch_id, task_key, tokens)"
                " SELECT id, 1, batch_id, task_key, 10 FROM agent_work_queue"
                " WHERE task_key = %s", (f"{tenant}0",))
            conn.execute("INSERT INTO agent_batch_usage (batch_id, tokens) VALUES (%s, 10)",
                         (f"batch-{tenant}",))
        tasks = {r["task_key"]: r for r in conn.execute(
            "SELECT id, task_key, tenant_id, batch_id, lease_owner, attempts, status,"
            " updated_at FROM agent_work_queue")}
    return {"a_dsn": _login(install, "worker", ("a",)), "tasks": tasks}


def _snapshot(admin_dsn: str) -> list:
    with psycopg.connect(admin_dsn) as conn:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall()
                for t in ("agent_work_queue", "agent_batch", "agent_task_effect",
                          "agent_task_usage", "agent_batch_usage", "agent_task_key")]


def test_a_tenant_role_sees_only_its_tenants_rows(install, two_tenants):
    with psycopg.connect(two_tenants["a_dsn"], row_factory=dict_row) as conn:
        seen = {t: {r["t"] for r in conn.execute(sql.SQL(
            "SELECT DISTINCT {} AS t FROM {}").format(sql.SQL(col), sql.Identifier(t)))}
            for t, col in (("agent_work_queue", "tenant_id"), ("agent_batch", "tenant_id"),
                           ("agent_task_effect", "batch_id"), ("agent_task_usage", "batch_id"),
                           ("agent_batch_usage", "batch_id"), ("agent_task_key", "batch_id"),
                           ("agent_pool_stream", "tenant_id"))}
        payloads = [r["payload"] for r in conn.execute("SELECT payload FROM agent_work_queue")]
        by_id = conn.execute("SELECT * FROM agent_work_queue WHERE id = %s",
                             (two_tenants["tasks"]["b1"]["id"],)).fetchall()
    assert seen == {"agent_work_queue": {"a"}, "agent_batch": {"a"},
                    "agent_task_effect": {"batch-a"}, "agent_task_usage": {"batch-a"},
                    "agent_batch_usage": {"batch-a"}, "agent_task_key": {"batch-a"},
                    "agent_pool_stream": set()}
    assert payloads and all(p == {"secret": "of a"} for p in payloads)
    assert by_id == []  # knowing the id is not enough


def test_a_tenant_role_cannot_change_another_tenants_task(install, two_tenants):
    """Ack, fail, heartbeat, release, expiry, requeue, cancel and task.once on tenant b's
    tasks, knowing their ids, owner and attempt: each runs and changes nothing."""
    from datetime import UTC, datetime, timedelta

    from jobrunner.model.errors import LeaseLost, UnknownBatch
    from jobrunner.model.types import Lease, Outcome
    from jobrunner.runtime.effects import Effects
    from jobrunner.store import batches as batch_store
    from jobrunner.store import tasks as task_store

    b0 = two_tenants["tasks"]["b0"]
    lease = Lease(b0["id"], "batch-b", "b0", "b", None, {}, 1, 8,
                  datetime.now(UTC) + timedelta(hours=1))
    before = _snapshot(install.admin_dsn)
    with psycopg.connect(two_tenants["a_dsn"], row_factory=dict_row) as conn:
        queue = Queue(conn)
        assert queue.heartbeat("w-b", [lease]) == set()
        assert queue.ack("w-b", lease, {"forged": True}) is False
        assert queue.fail("w-b", lease, "forged", permanent=True) is None
        assert queue.complete("w-b", [Outcome(lease, True, result={"forged": 1})]) == set()
        assert queue.release("w-b", [lease]) == set()
        # the queue's API says the batch is unknown, as for a batch never made (no
        # hint that it exists), and the statements themselves find no row
        with pytest.raises(UnknownBatch):
            queue.requeue_dead("batch-b")
        with pytest.raises(UnknownBatch):
            queue.cancel("batch-b")
        assert task_store.requeue_dead(conn, "batch-b", None) == 0
        assert batch_store.cancel(conn, "batch-b") == 0
        conn.commit()
        assert queue.claim("batch-b", "w-a", 10) == []
        # (expiry: make b's lease look expired to the superuser, then run it as tenant a)
        with psycopg.connect(install.admin_dsn) as admin:
            admin.execute("UPDATE agent_work_queue SET locked_until = now() - interval '1 s'"
                          " WHERE id = %s", (b0["id"],))
        before = _snapshot(install.admin_dsn)
        assert queue.expire() == []
    effects = Effects(two_tenants["a_dsn"])
    try:
        with pytest.raises(LeaseLost):
            effects.once(lease, "w-b", "forged", lambda conn: None)
    finally:
        effects.close()
    assert _snapshot(install.admin_dsn) == before


def test_a_tenant_role_cannot_write_rows_into_another_tenant(install, two_tenants):
    before = _snapshot(install.admin_dsn)
    a = two_tenants["a_dsn"]
    with psycopg.connect(a, autocommit=True) as conn:
        for statement in (
                "UPDATE agent_work_queue SET tenant_id = 'b' WHERE task_key = 'a2'",
                "INSERT INTO agent_batch (batch_id, tenant_id) VALUES ('forged', 'b')",
                "INSERT INTO agent_work_queue (tenant_id, batch_id, task_key, payload) "
                "VALUES ('b', 'batch-b', 'forged', '{}')",
                "INSERT INTO agent_task_effect (batch_id, task_key, effect_key, task_id, "
                "attempt, lease_owner) VALUES ('batch-b', 'b0', 'x', 1, 1, 'w')",
                "INSERT INTO agent_batch_usage (batch_id, tokens) VALUES ('batch-b', 1) "
                "ON CONFLICT (batch_id) DO UPDATE SET tokens = 0"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege,
                               match="row-level security"):
                conn.execute(statement)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            Queue(conn).enqueue("batch-b", "a", [TaskSpec("forged", {})])
    assert _snapshot(install.admin_dsn) == before


def test_a_tenant_role_cannot_become_another_role(install, two_tenants):
    b = _login(install, "worker", ("b",))
    owner, tenant_b = f"{install.prefix}_owner", conninfo_to_dict(b)["user"]
    a = two_tenants["a_dsn"]
    for target in (owner, tenant_b, install.user, f"{install.prefix}_operator"):
        _denied(a, sql.SQL("SET ROLE {}").format(sql.Identifier(target)).as_string())
        _denied(a, sql.SQL("SET SESSION AUTHORIZATION {}").format(
            sql.Identifier(target)).as_string())
    _denied(a, "SELECT set_config('role', %(r)s, false)", {"r": owner})
    # SET ROLE to its own group changes current_user, not the tenant binding
    with psycopg.connect(a, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("SET ROLE {}").format(
                sql.Identifier(f"{install.prefix}_worker")))
        except psycopg.errors.InsufficientPrivilege:
            pass  # (PostgreSQL 16+: the membership has SET FALSE)
        assert {r[0] for r in conn.execute("SELECT tenant_id FROM agent_work_queue")} == {"a"}
    # a temporary table shadowing the bindings (pg_temp comes first for relations)
    with psycopg.connect(a, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE jobrunner_tenant_role (role_name name, tenant_id text)")
        conn.execute("GRANT SELECT ON pg_temp.jobrunner_tenant_role TO PUBLIC")
        assert {r[0] for r in conn.execute("SELECT tenant_id FROM agent_work_queue")} == {"a"}


def test_a_pool_role_spans_exactly_its_tenants(install, two_tenants):
    with psycopg.connect(install.admin_dsn) as conn:
        Queue(conn).enqueue("batch-c", "c", [TaskSpec("c0", {})])
        conn.commit()
    pool = _login(install, "worker", ("a", "b"), role=f"{install.prefix}_pool_p")
    with psycopg.connect(pool) as conn:
        assert {r[0] for r in conn.execute("SELECT tenant_id FROM agent_work_queue")} == {
            "a", "b"}
    # re-binding replaces: exactly the tenants named
    pool = _login(install, "worker", ("c",), role=f"{install.prefix}_pool_p")
    with psycopg.connect(pool) as conn:
        assert {r[0] for r in conn.execute("SELECT tenant_id FROM agent_work_queue")} == {"c"}


def _tenants_seen(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {r[0] for r in conn.execute("SELECT tenant_id FROM agent_work_queue")}


def _restrictive_policies(admin_dsn: str, role: str) -> set[str]:
    """The tables on which a role has a restrictive (tenant) policy."""
    with psycopg.connect(admin_dsn) as conn:
        return {r[0] for r in conn.execute(
            "SELECT polrelid::regclass::text FROM pg_policy WHERE NOT polpermissive"
            " AND polroles = ARRAY[%s::regrole::oid]", (role,))}


def _protected(admin_dsn: str) -> set[str]:
    with psycopg.connect(admin_dsn) as conn:
        return {r[0] for r in conn.execute(
            "SELECT polrelid::regclass::text FROM pg_policy WHERE polname = 'jobrunner_all'")}


def test_rebinding_narrows_the_rows_and_unbinding_restores_them(install, two_tenants):
    """`tenant bind` replaces a role's policies (one per protected table, its tenants in
    them), and --unbind drops them: the role then sees every tenant, as any unbound
    worker."""
    with psycopg.connect(install.admin_dsn) as conn:
        Queue(conn).enqueue("batch-c", "c", [TaskSpec("c0", {})])
        conn.commit()
    role = f"{install.prefix}_pool_q"
    dsn = _login(install, "worker", ("a", "b"), role=role)
    assert _tenants_seen(dsn) == {"a", "b"}
    protected = _protected(install.admin_dsn)
    assert len(protected) >= 16 and "agent_task_effect" in protected
    assert _restrictive_policies(install.admin_dsn, role) == protected
    with psycopg.connect(install.dsn) as conn:
        roles.bind_tenants(conn, role, ["b"])
    assert _tenants_seen(dsn) == {"b"}
    with psycopg.connect(dsn) as conn:
        assert {r[0] for r in conn.execute("SELECT batch_id FROM agent_task_effect")} == {
            "batch-b"}
    with psycopg.connect(install.dsn) as conn:
        roles.bind_tenants(conn, role, [])
    assert _restrictive_policies(install.admin_dsn, role) == set()
    assert _tenants_seen(dsn) == {"a", "b", "c"}
    with psycopg.connect(install.dsn) as conn:
        assert roles.bound_roles(conn) == [{"role_name": f"{install.prefix}_worker_a",
                                            "tenants": ["a"]}]


def test_a_role_that_could_set_role_out_of_its_policies_is_not_bound(install):
    """Policies TO a role bind it while it is the current user: a login role that may SET
    ROLE to its group (a plain GRANT, PostgreSQL 16+'s default SET TRUE) would leave
    them, so binding it is refused and nothing is written."""
    _granted(install)
    role = f"{install.prefix}_managed"
    with psycopg.connect(install.admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT {} TO {}").format(
            sql.Identifier(f"{install.prefix}_worker"), sql.Identifier(role)))
    with (psycopg.connect(install.dsn) as conn,
          pytest.raises(UnsafeBinding, match=f"SET ROLE to {install.prefix}_worker")):
        roles.bind_tenants(conn, role, ["a"])
    refused = cli("tenant", "bind", role, "a", dsn=install.dsn)
    assert refused.returncode != 0 and "can SET ROLE to" in refused.stderr, refused.stderr
    with psycopg.connect(install.dsn) as conn:
        assert roles.bound_roles(conn) == []
    assert _restrictive_policies(install.admin_dsn, role) == set()
    # granted its group without SET (as CloudNativePG or the platform should): bound
    with psycopg.connect(install.admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE {} FROM {}").format(
            sql.Identifier(f"{install.prefix}_worker"), sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT {} TO {} WITH INHERIT TRUE, SET FALSE").format(
            sql.Identifier(f"{install.prefix}_worker"), sql.Identifier(role)))
    with psycopg.connect(install.dsn) as conn:
        roles.bind_tenants(conn, role, ["a"])
    assert _restrictive_policies(install.admin_dsn, role) == _protected(install.admin_dsn)


LATER = """
CREATE TABLE agent_later (tenant_id text NOT NULL, n int);
CREATE TABLE agent_later_of_batch (batch_id text NOT NULL, n int);
INSERT INTO agent_later VALUES ('a', 1), ('b', 2);
INSERT INTO agent_later_of_batch VALUES ('batch-a', 1), ('batch-b', 2);
ALTER TABLE agent_later ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_later FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_all ON agent_later USING (true);
ALTER TABLE agent_later_of_batch ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_later_of_batch FORCE ROW LEVEL SECURITY;
CREATE POLICY jobrunner_all ON agent_later_of_batch USING (true);
GRANT SELECT ON agent_later, agent_later_of_batch TO PUBLIC;
"""


def test_a_table_a_later_migration_protects_is_covered_after_migrate(
        install, two_tenants, monkeypatch):
    """A later migration's table under row-level security (jobrunner_all) gets every bound
    role's policy when `jobrunner migrate` applies it: no list of tables to keep."""
    from jobrunner.store import migrate as migrate_module
    from jobrunner.store.sqlfiles import Migration

    later = Migration(migrations()[-1].version + 1, "later_table", LATER)
    monkeypatch.setattr(migrate_module, "migrations", lambda: (*migrations(), later))
    with psycopg.connect(install.dsn) as conn:  # (the installer: a member of the owner)
        assert migrate(conn) == [f"{later.version:04d}_later_table"]
    with psycopg.connect(two_tenants["a_dsn"]) as conn:
        assert conn.execute("SELECT tenant_id FROM agent_later").fetchall() == [("a",)]
        assert conn.execute("SELECT batch_id FROM agent_later_of_batch").fetchall() == [
            ("batch-a",)]


def test_an_install_bound_before_the_per_role_policies_is_bound_after_upgrading(
        install, monkeypatch):
    """Bindings made under migration 0022's policies (by session_user) are given their
    per-role policies by the migration that replaces them (0026), in its transaction."""
    from jobrunner.store import migrate as migrate_module

    older = tuple(m for m in migrations() if m.version < 26)
    monkeypatch.setattr(migrate_module, "migrations", lambda: older)
    _granted_on_an_older_schema(install)
    with psycopg.connect(install.admin_dsn) as conn:
        # (rows as the schema of then holds them: today's enqueue writes columns that later
        # migrations added)
        for tenant in ("a", "b"):
            conn.execute("INSERT INTO agent_batch (batch_id, tenant_id) VALUES (%s, %s)",
                         (f"batch-{tenant}", tenant))
            conn.execute("INSERT INTO agent_work_queue (tenant_id, payload, batch_id, task_key)"
                         " VALUES (%s, '{}', %s, 'k')", (tenant, f"batch-{tenant}"))
        # (what the grants of then gave: 0022's policies read the bindings as the user)
        conn.execute(sql.SQL("GRANT SELECT ON jobrunner_tenant_role TO {}").format(
            sql.Identifier(f"{install.prefix}_worker")))
        conn.commit()
    a = _login(install, "worker", ("a",))
    assert _tenants_seen(a) == {"a"}  # (0022's policies)
    monkeypatch.undo()
    with psycopg.connect(install.dsn) as conn:
        assert "0026_tenant_policies_per_role" in migrate(conn)
    assert _tenants_seen(a) == {"a"}
    _denied(a, "SELECT * FROM jobrunner_tenant_role")  # (nothing reads them any more)
    assert _restrictive_policies(install.admin_dsn, conninfo_to_dict(a)["user"]) == (
        _protected(install.admin_dsn))


def test_a_bound_roles_policy_through_its_batch_runs_once_per_statement(install, two_tenants):
    """Effects, usage and task keys have no tenant column: their policy is an uncorrelated
    IN over the tenants' batches, a hashed SubPlan built once per statement, not a probe
    of agent_batch per row."""
    with psycopg.connect(two_tenants["a_dsn"]) as conn:
        for table in ("agent_task_effect", "agent_task_usage", "agent_batch_usage",
                      "agent_task_key"):
            plan = "\n".join(r[0] for r in conn.execute(sql.SQL(
                "EXPLAIN SELECT * FROM {}").format(sql.Identifier(table))))
            assert "hashed SubPlan" in plan, plan


def test_tenant_create_prints_a_dsn_and_its_worker_completes_its_own_tasks(install, tmp_path):
    _granted(install)
    with psycopg.connect(install.admin_dsn) as conn:
        queue = Queue(conn)
        for tenant in ("a", "b"):
            queue.enqueue(f"batch-{tenant}", tenant,
                          [TaskSpec(f"k{i}", {"n": i}) for i in range(20)])
        conn.commit()
    made = cli("tenant", "create", "a", "--prefix", install.prefix, dsn=install.dsn)
    assert made.returncode == 0, made.stderr
    tenant_dsn = made.stdout.strip()
    password = conninfo_to_dict(tenant_dsn)["password"]
    assert conninfo_to_dict(tenant_dsn)["user"] == f"{install.prefix}_tenant_a"
    assert password not in made.stderr
    log = tmp_path / "worker.log"
    # its own batch: done; the other tenant's batch: invisible, so nothing to do
    start_worker(tenant_dsn, "batch-a", HANDLER, "--exit-when-drained", log=log).wait(60)
    other = start_worker(tenant_dsn, "batch-b", HANDLER, "--exit-when-drained", log=log)
    other.wait(60)
    with psycopg.connect(install.admin_dsn) as conn:
        counts = dict(conn.execute("SELECT batch_id || ':' || status, count(*) FROM "
                                   "agent_work_queue GROUP BY 1").fetchall())
    assert counts == {"batch-a:done": 20, "batch-b:pending": 20}
    assert password not in log.read_text()


def test_a_handler_attacking_from_inside_a_tenants_worker_fails_and_its_task_succeeds(
        install, tmp_path):
    _granted(install)
    tenant_dsn = _login(install, "worker", ("a",))
    owner, other = f"{install.prefix}_owner", _login(install, "worker", ("b",))
    with psycopg.connect(install.admin_dsn) as conn:
        queue = Queue(conn)
        queue.enqueue("batch-b", "b", [TaskSpec("b0", {"secret": "of b"})])
        queue.enqueue("batch-a", "a", [TaskSpec("a0", {"become": [
            owner, conninfo_to_dict(other)["user"], install.user]})])
        conn.commit()
    worker = start_worker(tenant_dsn, "batch-a", "tests.support.attack_handlers:attack",
                          "--exit-when-drained", log=tmp_path / "w.log")
    assert worker.wait(60) == 0, (tmp_path / "w.log").read_text()
    with psycopg.connect(install.admin_dsn, row_factory=dict_row) as conn:
        rows = {r["task_key"]: r for r in conn.execute(
            "SELECT task_key, status, result FROM agent_work_queue")}
    assert rows["b0"]["status"] == "pending" and rows["a0"]["status"] == "done"
    result = rows["a0"]["result"]
    assert result.pop("foreign_rows") == 0 and result.pop("foreign_updated") == 0
    assert result.pop("env_dsns") == ["JOBRUNNER_DATABASE_URL"]
    assert result == {  # 42501: insufficient_privilege
        "DROP TABLE agent_work_queue": "42501", "TRUNCATE agent_work_queue": "42501",
        "ALTER TABLE agent_batch ADD COLUMN x int": "42501",
        "CREATE FUNCTION public.mine() RETURNS int LANGUAGE sql AS 'SELECT 1'": "42501",
        "ALTER TABLE agent_work_queue DISABLE ROW LEVEL SECURITY": "42501",
        f"set role {owner}": "42501", f"set role {conninfo_to_dict(other)['user']}": "42501",
        f"set role {install.user}": "42501"}


def test_every_attack_of_issue_29_from_a_tenants_worker_fails_and_its_tasks_succeed(
        install, tmp_path):
    """tests/support/attack_handlers.py:attack_all in a worker process of tenant a (the
    same handler and expectations as tests/e2e/test_attack_e2e.py, which runs it in a
    worker pod on the real node): every attempt on tenant b refused or without effect,
    b's rows and the schema as before, a's tasks done."""
    _granted(install)
    tenant_a, tenant_b = _login(install, "worker", ("a",)), _login(install, "worker", ("b",))
    owner, role_b = f"{install.prefix}_owner", conninfo_to_dict(tenant_b)["user"]
    target = {**attacks.seed_tenant_b(install.admin_dsn), "roles": [owner, role_b, install.user]}
    def witness() -> tuple:  # the superuser's view: b's rows, the schema, the roles
        return (attacks.tenant_b_rows(install.admin_dsn),
                attacks.schema(install.admin_dsn, install.prefix, install.user))

    before = witness()
    with psycopg.connect(install.admin_dsn) as conn:
        Queue(conn).enqueue("batch-a", "a", [TaskSpec(f"a{i}", {"target": target})
                                             for i in range(2)])
        conn.commit()
    log = tmp_path / "w.log"
    worker = start_worker(tenant_a, "batch-a", "tests.support.attack_handlers:attack_all",
                          "--exit-when-drained", log=log)
    assert worker.wait(120) == 0, log.read_text()
    with psycopg.connect(install.admin_dsn, row_factory=dict_row) as conn:
        own = conn.execute("SELECT status, result FROM agent_work_queue"
                           " WHERE tenant_id = 'a'").fetchall()
    expected = attacks.expected(owner, role_b, install.user)
    assert [r["status"] for r in own] == ["done", "done"], own
    for row in own:
        got = {what: outcome for what, outcome, _ in row["result"]["attempts"]}
        assert got == expected, {k: (got.get(k), expected.get(k)) for k in {**expected, **got}
                                 if got.get(k) != expected.get(k)}
        assert row["result"]["who"] == [conninfo_to_dict(tenant_a)["user"], False, False]
        assert row["result"]["own_rows"] == 2
    assert witness() == before


# -- the doorbell's one SECURITY DEFINER function (migration 0031) -----------------------

def test_a_ring_cancels_a_worker_sleep_only_where_the_owner_may_signal_it(install):
    """With the component roles of `jobrunner db roles`, the owner may not cancel a
    worker's statements: can_ring says so (its notifier then LISTENs, as before) and a
    ring cancels nothing. Once a superuser grants the owner pg_signal_backend, it may,
    and a ring cancels the worker's sleep (as the operator's enqueue would)."""
    _granted(install)
    worker_dsn = _login(install, "worker")
    operator_dsn = _login(install, "operator")
    owner = f"{install.prefix}_owner"

    def ring_while_asleep() -> bool:
        """Whether the operator's ring of a sleeping worker session ended its sleep."""
        sleeper = psycopg.connect(worker_dsn, autocommit=True, row_factory=dict_row)
        try:
            pid = sleeper.info.backend_pid
            sleeper.execute("INSERT INTO agent_worker_wait (wait_id, batch_id, pid) "
                            "VALUES (5, 'd', %s)", (pid,))
            result: dict = {}

            def sleep() -> None:
                try:
                    result["gone"], _ = worker_waits.sleep(sleeper, [5], 3.0)
                except psycopg.errors.QueryCanceled:
                    result["rung"] = True

            thread = threading.Thread(target=sleep, daemon=True)
            thread.start()
            with psycopg.connect(install.admin_dsn, row_factory=dict_row) as admin:
                wait_for(lambda: admin.execute(
                    "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = %s AND "
                    "wait_event = 'PgSleep'", (pid,)).fetchone()["n"] == 1, timeout=5,
                    what="the worker's sleep")
            with psycopg.connect(operator_dsn, row_factory=dict_row) as op:
                assert worker_waits.wake(op, 1, batch_id="d") == 1
                thread.join(2.0)
                woken = not thread.is_alive()
                op.rollback()
            thread.join(5)
            return woken and result.get("rung", False)
        finally:
            sleeper.execute("DELETE FROM agent_worker_wait WHERE wait_id = 5")
            sleeper.close()

    with psycopg.connect(worker_dsn, row_factory=dict_row) as conn:
        assert worker_waits.can_ring(conn) is False
    assert ring_while_asleep() is False  # (it slept its 3 s out)
    with psycopg.connect(install.admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("GRANT pg_signal_backend TO {}").format(sql.Identifier(owner)))
    try:
        with psycopg.connect(worker_dsn, row_factory=dict_row) as conn:
            assert worker_waits.can_ring(conn) is True
        assert ring_while_asleep() is True
    finally:
        with psycopg.connect(install.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("REVOKE pg_signal_backend FROM {}").format(
                sql.Identifier(owner)))
