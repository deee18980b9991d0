"""A hostile handler in a real worker container on the real node (issue 29, "Bad input and
attacks"): tenant a's BatchRun runs workers whose Secret holds only tenant a's bound
worker DSN (`jobrunner tenant create a`), the controller the operator role's (`jobrunner
db login operator`), all made by `jobrunner db grant` as an installing role that is not a
superuser. Each of a's tasks tries, with the DSN in its own environment, DDL, reading and
writing tenant b's rows, jobrunner's own ack/fail/heartbeat/release/requeue/cancel/claim
and task.once on b's leased task knowing its id, owner and attempt, and becoming b's role
or the owner (tests/support/attack_handlers.py:attack_all). Every attempt must fail,
tenant b's rows and the schema must be as before (read by the superuser, not through the
attacker's role), and a's run must still succeed with all its tasks done."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from tests.support import attacks
from tests.support.figures import show
from tests.support.installs import Install, installing_role
from tests.support.processes import cli

from .operator_support import (
    Controller,
    apply,
    apply_crds,
    batchrun,
    create_db_secret,
    wait_phase,
)

FAST = {"visibilityTimeoutSeconds": 6, "heartbeatSeconds": 2, "backoffBaseSeconds": 0.2,
        "backoffCapSeconds": 1}
TASKS = 3  # tenant a's tasks, each one running every attack


@pytest.fixture
def install(pg_admin_dsn: str) -> Iterator[Install]:
    """An installing role's database, `db grant`ed with a prefix of its own."""
    with installing_role(pg_admin_dsn, "attack") as made:
        granted = cli("db", "grant", "--prefix", made.prefix, dsn=made.dsn)
        assert granted.returncode == 0, granted.stderr
        yield made


def _printed_dsn(install: Install, *args: str) -> str:
    made = cli(*args, "--prefix", install.prefix, dsn=install.dsn)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def test_a_hostile_handler_in_a_worker_pod_fails_at_everything_and_its_run_succeeds(
        k8s, namespace, install, tmp_path, capsys):
    operator_dsn = _printed_dsn(install, "db", "login", "operator")
    tenant_a_dsn = _printed_dsn(install, "tenant", "create", "a")
    tenant_b_dsn = _printed_dsn(install, "tenant", "create", "b")
    role_a, role_b = (conninfo_to_dict(d)["user"] for d in (tenant_a_dsn, tenant_b_dsn))
    owner = f"{install.prefix}_owner"
    target = {**attacks.seed_tenant_b(install.admin_dsn), "roles": [owner, role_b, install.user]}
    b_before = attacks.tenant_b_rows(install.admin_dsn)
    schema_before = attacks.schema(install.admin_dsn, install.prefix, install.user)

    apply_crds(k8s)
    create_db_secret(k8s, namespace, operator_dsn)  # jobrunner-db: the controller's
    create_db_secret(k8s, namespace, tenant_a_dsn, name="jr-worker")
    controller = Controller(k8s, namespace, tmp_path / "controller.log",
                            values=("database.workerSecretName=jr-worker",)).start()
    try:
        apply(k8s, namespace, batchrun("hostile", {
            "tenant": "a", "workers": 1, "handler": "tests.support.attack_handlers:attack_all",
            "shards": [{"key": f"a{i}", "payload": {"target": target}} for i in range(TASKS)],
            **FAST}))
        br = wait_phase(k8s, "hostile", namespace, ("Succeeded", "Failed"), timeout=240,
                        controller=controller)
    finally:
        controller.stop()

    with psycopg.connect(install.admin_dsn, row_factory=dict_row) as conn:
        own = conn.execute("SELECT task_key, status, attempts, result FROM agent_work_queue"
                           " WHERE tenant_id = 'a' ORDER BY task_key").fetchall()
    # The run itself: every task of a's done, once, with the handler's own record.
    assert br["status"]["phase"] == "Succeeded", br["status"]
    assert [(r["status"], r["attempts"]) for r in own] == [("done", 1)] * TASKS, own

    expected = attacks.expected(owner, role_b, install.user)
    for row in own:
        result = row["result"]
        got = {what: outcome for what, outcome, _ in result["attempts"]}
        assert got == expected, {k: (got.get(k), expected.get(k)) for k in {**expected, **got}
                                 if got.get(k) != expected.get(k)}
        # the attacker really was tenant a's bound role, seeing its own rows, with one DSN
        assert result["who"] == [role_a, False, False], result["who"]
        assert result["own_rows"] == TASKS
        assert result["env_dsns"] == ["JOBRUNNER_DATABASE_URL"], result["env_dsns"]

    # The witness: b's rows and the schema, read by the superuser, as they were.
    assert attacks.tenant_b_rows(install.admin_dsn) == b_before
    assert attacks.schema(install.admin_dsn, install.prefix, install.user) == schema_before

    transcript = [f"[attack] worker pod of tenant a (role {role_a}), {len(expected)} attempts"
                  f" x {TASKS} tasks, each refused; run {br['status']['phase']}"]
    transcript += [f"[attack]   {what[:72]:<72} -> {outcome} {detail[:70]}".rstrip()
                   for what, outcome, detail in own[0]["result"]["attempts"]]
    show(capsys, "\n".join(transcript))
