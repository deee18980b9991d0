"""`jobrunner db grant|login` and `jobrunner tenant create|bind|list`: least privilege in the
database (docs/security.md). Registered on the main app by `register(app)`.

A printed DSN holds a password: it goes to standard output only, for a Secret, and is
never logged (the commands log nothing).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from jobrunner.model.errors import BadInput
from jobrunner.store import db
from jobrunner.store import roles as store_roles

db_app = typer.Typer(no_args_is_help=True,
                     help="The database's roles: one per component, least privilege.")
tenant_app = typer.Typer(no_args_is_help=True,
                         help="Login roles bound to tenants: they see only their rows.")
out = Console()

DsnOpt = Annotated[str | None, typer.Option(
    "--dsn", help="The installing role's connection string (default: "
    "$JOBRUNNER_DATABASE_URL). It needs CREATEROLE and to own jobrunner's schema; it "
    "need not be a superuser.", show_default=False)]
PrefixOpt = Annotated[str, typer.Option(
    "--prefix", help="Prefix of the components' role names (<prefix>_owner, _operator, "
    "_worker, _api, _readonly). Roles are the cluster's, not the database's: give each "
    "jobrunner database of a cluster its own prefix.")]


@db_app.command("grant")
def grant(prefix: PrefixOpt = "jobrunner", dsn: DsnOpt = None) -> None:
    """Create the components' roles (idempotent), give jobrunner's tables to the owner
    role, apply pending migrations as it, and grant each role only what it needs."""
    store_roles.check_role_name(f"{prefix}_readonly")
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-grant") as conn:
        report = store_roles.grant(conn, prefix)
    out.print(f"roles: {', '.join(report.roles.values())}"
              + (f" ({len(report.created)} created)" if report.created else " (all existed)"),
              highlight=False)
    out.print(f"applied {len(report.migrations)} migration(s)"
              + (f": {', '.join(report.migrations)}" if report.migrations else ""),
              highlight=False)
    out.print("privileges granted (sql/grants/privileges.sql). Log in as a member of a "
              "component's role: `jobrunner db login COMPONENT`, or `jobrunner tenant "
              "create` for a tenant's workers.", highlight=False)


@db_app.command("login")
def login(
    component: Annotated[str, typer.Argument(help="operator, worker, api or readonly.")],
    role: Annotated[str | None, typer.Option(
        "--role", help="The login role's name (default: <prefix>_<component>_login).")] = None,
    prefix: PrefixOpt = "jobrunner",
    dsn: DsnOpt = None,
) -> None:
    """Create a login role in a component's role (or give it a new password) and print
    the DSN that logs in as it: store it in that component's Secret. Sees every tenant."""
    name = role or f"{prefix}_{component}_login"
    dsn = db.resolve_dsn(dsn)
    with db.connect(dsn, purpose="jobrunner-grant") as conn:
        made = store_roles.create_login(conn, dsn, name, component)
    _print_login(made)


@tenant_app.command("create")
def create(
    tenants: Annotated[list[str], typer.Argument(
        help="The tenant, or a pool's tenants (exactly those: re-running with another "
        "list replaces the binding).")],
    role: Annotated[str | None, typer.Option(
        "--role", help="The login role's name (default: <prefix>_tenant_<tenant>; "
        "required for several tenants, e.g. <prefix>_pool_<pool>).")] = None,
    prefix: PrefixOpt = "jobrunner",
    dsn: DsnOpt = None,
) -> None:
    """A worker login role bound to tenants: its sessions see and change only their
    tasks, batches, results, effects and usage. Prints its DSN (a new password on every
    run) for the worker Secret of the tenant's namespace or pool."""
    if len(tenants) > 1 and not role:
        raise BadInput("several tenants (a pool's worker role): name the role with --role")
    name = role or f"{prefix}_tenant_{tenants[0]}"
    dsn = db.resolve_dsn(dsn)
    with db.connect(dsn, purpose="jobrunner-grant") as conn:
        made = store_roles.create_login(conn, dsn, name, "worker", tenants)
    _print_login(made)


@tenant_app.command("bind")
def bind(
    role: Annotated[str, typer.Argument(help="An existing login role, a member of the "
                                        "worker role (e.g. a CloudNativePG managed role).")],
    tenants: Annotated[list[str] | None, typer.Argument(
        help="Exactly the tenants it may see.")] = None,
    unbind: Annotated[bool, typer.Option(
        "--unbind", help="Bind it to no tenant: it then sees every tenant's rows.")] = False,
    dsn: DsnOpt = None,
) -> None:
    """Bind a login role made elsewhere to tenants (its password is not touched)."""
    if bool(tenants) == unbind:
        raise BadInput("give the tenants, or --unbind (which lets the role see every tenant)")
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-grant") as conn:
        store_roles.bind_tenants(conn, role, tenants or [])
    out.print(f"{role}: {', '.join(tenants) if tenants else 'bound to no tenant (sees all)'}",
              highlight=False)


@tenant_app.command("list")
def list_bound(dsn: DsnOpt = None) -> None:
    """The login roles bound to tenants, and their tenants."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli") as conn:
        rows = store_roles.bound_roles(conn)
    table = Table("role", "tenants")
    for row in rows:
        table.add_row(row["role_name"], ", ".join(row["tenants"]))
    out.print(table)


def _print_login(made: store_roles.Login) -> None:
    # stderr for the words, stdout for the DSN alone: `... > dsn` or `$(...)` keeps it.
    typer.echo(f"{'created' if made.created else 'new password for'} role {made.role}",
               err=True)
    typer.echo(made.dsn)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.add_typer(tenant_app, name="tenant")
