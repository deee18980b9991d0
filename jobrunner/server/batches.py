"""The Batches API: POST/GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel."""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobrunner.server import service
from jobrunner.server.context import context, tenant
from jobrunner.server.errors import APIError, not_found
from jobrunner.store import batch_api as store


async def create_batch(request: Request) -> Response:
    raw = await request.body()  # (a small JSON body: the file is already uploaded)
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        raise APIError(400, "We could not parse the JSON body of your request.") from None
    ctx = context(request)

    def create() -> dict:
        with ctx.db.connection() as conn:
            who = tenant(request, conn)
        return service.create_batch(ctx, who, body, request.headers.get("idempotency-key"))

    return JSONResponse(await run_in_threadpool(create))


def retrieve_batch(request: Request) -> Response:
    ctx, batch_id = context(request), request.path_params["batch_id"]
    with ctx.db.connection() as conn:
        row = store.get_batch(conn, tenant(request, conn), batch_id)
        if row is None:
            raise not_found("Batch", batch_id)
        return JSONResponse(service.batch_object(ctx, conn, row))


def list_batches(request: Request) -> Response:
    ctx = context(request)
    try:
        limit = int(request.query_params.get("limit", "20"))
    except ValueError:
        raise APIError(400, "limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    with ctx.db.connection() as conn:
        who = tenant(request, conn)
        rows = store.list_batches(conn, who, after=request.query_params.get("after"),
                                  limit=limit + 1)
        data = [service.batch_object(ctx, conn, r) for r in rows[:limit]]
    return JSONResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None,
                         "has_more": len(rows) > limit})


def cancel_batch(request: Request) -> Response:
    ctx = context(request)
    with ctx.db.connection() as conn:
        who = tenant(request, conn)
    return JSONResponse(service.cancel(ctx, who, request.path_params["batch_id"]))


routes = [
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
