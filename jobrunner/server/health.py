"""Probes: /healthz (the process answers), /readyz (and reaches the database)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobrunner.server.context import context
from jobrunner.store import batch_api as store


def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def readyz(request: Request) -> Response:
    try:
        with context(request).db.connection(timeout=2) as conn:
            store.ping(conn)
    except Exception:
        return JSONResponse({"status": "database unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


routes = [Route("/healthz", healthz), Route("/readyz", readyz)]
