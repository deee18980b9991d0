"""The ASGI application: the routes of each surface, OpenAI-shaped errors, a database
pool, and the sweeper thread that moves open batches on (any replica may; a batch's row
lock makes one do it at a time)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator

from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette

from jobrunner.server import batches, files, health, service
from jobrunner.server.console import views as console
from jobrunner.server.context import Context, Settings
from jobrunner.server.errors import HANDLERS
from jobrunner.store.db import connection_params

log = logging.getLogger("jobrunner.server")


def _sweeper(ctx: Context, stop: threading.Event) -> None:
    while not stop.wait(ctx.settings.sweep_seconds):
        try:
            service.sweep(ctx)
        except Exception as exc:  # (the database away: next tick)
            log.warning("sweep failed: %s: %s", type(exc).__name__, exc)


def _counter(ctx: Context, stop: threading.Event) -> None:
    """Recounts the open batches being watched before their figures age (counts.py)."""
    while not stop.wait(ctx.counts.max_age / 4):
        try:
            with ctx.db.connection() as conn:
                ctx.counts.refresh(conn)
        except Exception as exc:  # (the database away: retrieves count for themselves)
            log.warning("recounting watched batches failed: %s: %s", type(exc).__name__, exc)


def create_app(settings: Settings, *, sweeper: bool = True) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        db = ConnectionPool(settings.dsn, min_size=1, max_size=settings.db_pool_size,
                            kwargs={**connection_params(settings.dsn,
                                                        application_name="jobrunner-serve"),
                                    "row_factory": dict_row},
                            open=True, name="jobrunner-serve")
        ctx = Context(settings, db)
        app.state.context = ctx
        live = None
        if settings.console:
            live = console.Console(ctx, min_gap=settings.console_min_gap,
                                   poll=settings.console_poll)
            ctx.extra["console"] = live
            live.hub.start()
        stop = threading.Event()
        threads = [threading.Thread(target=_counter, args=(ctx, stop), daemon=True,
                                    name="batch-counter")]
        if sweeper:
            threads.append(threading.Thread(target=_sweeper, args=(ctx, stop), daemon=True,
                                            name="batch-sweeper"))
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if live is not None:
                live.hub.stop()
            for thread in threads:
                thread.join(10)
            db.close()

    routes = [*health.routes, *files.routes, *batches.routes]
    if settings.console:
        routes += console.routes
    return Starlette(routes=routes, exception_handlers={**HANDLERS, **console.HANDLERS},
                     lifespan=lifespan)
