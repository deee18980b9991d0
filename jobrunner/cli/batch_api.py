"""`jobrunner serve` (the OpenAI Files and Batches API, docs/batch-api.md) and
`jobrunner api-key create|list|revoke`. Registered on the main app by `register(app)`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import httpx
import typer

from jobrunner.cli.options import DsnOpt, _fail, err, out
from jobrunner.model.validation import check_identifier
from jobrunner.store import batch_api as store
from jobrunner.store import db

key_app = typer.Typer(no_args_is_help=True,
                      help="Keys of the Batch API (`jobrunner serve`): one tenant each.")


@key_app.command("create")
def create_key(
    tenant: Annotated[str, typer.Option("--tenant", help=(
        "The tenant the key acts for; '*' makes a console key that sees every tenant "
        "(the Batch API refuses it)."))],
    name: Annotated[str | None, typer.Option("--name", help="A label for the key.")] = None,
    role: Annotated[str, typer.Option("--role", help=(
        "The key's role in the web console (/console, docs/console.md): read (pages "
        "only) or admin (also requeue dead tasks, cancel batches)."))] = "read",
    dsn: DsnOpt = None,
) -> None:
    """Create a key; it is printed once (only its hash is stored)."""
    check_identifier(tenant, "tenant id")
    if role not in store.ROLES:
        _fail(f"--role must be one of {', '.join(store.ROLES)}, not {role!r}", 2)
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli") as conn:
        row, key = store.create_key(conn, tenant, name, role)
    err.print(f"key {row['key_id']} for tenant {tenant} (console role {role}): store it now, "
              "it is not shown again", highlight=False)
    print(key)


@key_app.command("list")
def list_keys(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's.")] = None,
    dsn: DsnOpt = None,
) -> None:
    """Keys (id, tenant, name, role, created, revoked), never the keys themselves."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli") as conn:
        rows = store.list_keys(conn, tenant)
    for r in rows:
        print(json.dumps({k: (v.isoformat() if hasattr(v, "isoformat") else v)
                          for k, v in r.items()}))


@key_app.command("revoke")
def revoke_key(
    key_id: Annotated[str, typer.Argument(help="The key's id (printed by create and list).")],
    dsn: DsnOpt = None,
) -> None:
    """Revoke a key: its next request gets 401."""
    with db.connect(db.resolve_dsn(dsn), purpose="jobrunner-cli") as conn:
        if not store.revoke_key(conn, key_id):
            _fail(f"no key {key_id!r}", 1)
    out.print(f"key {key_id} revoked", highlight=False)


def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    pool: Annotated[str, typer.Option(help="Worker pool that runs the API's batches.")] =
        "batch-api",
    routes: Annotated[str | None, typer.Option(
        "--routes", help="Model routing table (YAML or JSON; default "
        "$JOBRUNNER_MODEL_ROUTES). Without one, any model is accepted.")] = None,
    max_file_bytes: Annotated[int, typer.Option(min=1)] = 200 * 1024 * 1024,
    max_file_lines: Annotated[int, typer.Option(min=1)] = 50_000,
    max_attempts: Annotated[int, typer.Option(min=1, max=1000)] = 5,
    output_retention_days: Annotated[float, typer.Option(min=0.0001)] = 30,
    min_window_seconds: Annotated[int, typer.Option(
        min=1, help="Shortest completion_window accepted (24h is OpenAI's only one).")] = 60,
    max_window_seconds: Annotated[int, typer.Option(min=1)] = 7 * 86400,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    reuse_port: Annotated[bool, typer.Option(
        "--reuse-port", help="SO_REUSEPORT: several replicas on one host and port.")] = False,
    console: Annotated[bool, typer.Option(
        "--console/--no-console", help="Serve the web console under /console "
        "(docs/console.md).")] = True,
    console_proxy_auth: Annotated[bool, typer.Option(
        "--console-proxy-auth", help="Trust the proxy's user and groups headers in the "
        "console (oauth2-proxy). Only when every request comes through that proxy: anyone "
        "reaching the server directly could send them. Off: the headers are ignored.")
    ] = False,
    console_proxy_user_header: Annotated[str, typer.Option(
        help="The header naming the proxy's user.")] = "X-Forwarded-User",
    console_proxy_groups_header: Annotated[str, typer.Option(
        help="The header listing the user's groups, comma-separated.")] = "X-Forwarded-Groups",
    console_proxy_admin_group: Annotated[str, typer.Option(
        help="The group whose users are console admins (others: read).")] = "jobrunner-admins",
    console_secret: Annotated[str | None, typer.Option(
        envvar="JOBRUNNER_CONSOLE_SECRET", show_default=False,
        help="Key of the proxy users' CSRF tokens, the same on every replica (default: "
        "random per process, so a form works only on the replica that served it).")] = None,
    dsn: DsnOpt = None,
) -> None:
    """The OpenAI Files and Batches API over HTTP (docs/batch-api.md), and the web
    console under /console (docs/console.md)."""
    from jobrunner.server.context import Settings
    from jobrunner.server.main import serve as run

    settings = Settings(dsn=db.resolve_dsn(dsn), pool=pool, routes_file=routes,
                        max_file_bytes=max_file_bytes, max_file_lines=max_file_lines,
                        max_attempts=max_attempts, min_window_seconds=min_window_seconds,
                        max_window_seconds=max_window_seconds,
                        output_retention_seconds=output_retention_days * 86400,
                        console=console, console_proxy_auth=console_proxy_auth,
                        console_proxy_user_header=console_proxy_user_header,
                        console_proxy_groups_header=console_proxy_groups_header,
                        console_proxy_admin_group=console_proxy_admin_group,
                        console_secret=console_secret)
    settings.routes()  # a bad routing table stops here, not at the first batch
    run(settings, host, port, reuse_port=reuse_port, log_level=log_level)


@contextmanager
def console_beside_run(dsn: str, port: int = 0) -> Iterator[None]:
    """`jobrunner run --console`: `jobrunner serve` on the run's database for as long as
    the run lasts, on 127.0.0.1, with an admin key of every tenant made for it and
    revoked when the run ends. The DSN reaches the server in its environment, never on
    its command line (where ps shows it)."""
    with db.connect(dsn, purpose="jobrunner-cli") as conn:
        row, key = store.create_key(conn, store.ALL_TENANTS, "jobrunner run --console",
                                    "admin")
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    env = {**os.environ, db.DSN_ENV: dsn}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobrunner", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                _fail(f"the console did not start on 127.0.0.1:{port}", 1)
            time.sleep(0.1)
        # (localhost, not 127.0.0.1: browsers keep the login's Secure cookie there)
        out.print(f"console: http://localhost:{port}/console/ (log in with the key {key}: "
                  "admin, every tenant, revoked when the run ends)", highlight=False,
                  soft_wrap=True)
        yield
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        with db.connect(dsn, purpose="jobrunner-cli") as conn:
            store.revoke_key(conn, row["key_id"])


def register(app: typer.Typer) -> None:
    app.add_typer(key_app, name="api-key")
    app.command("serve")(serve)
