"""The Files API: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content.

An upload is parsed as it arrives (python-multipart's streaming parser) and written to
the database in ~1 MiB chunks inside one transaction: memory stays constant whatever
the file's size, and a replica that dies mid-upload leaves nothing (the transaction
never commits)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jobrunner.server import faults
from jobrunner.server.context import context, tenant
from jobrunner.server.errors import APIError, not_found
from jobrunner.store import batch_api as store

CHUNK = 1024 * 1024
PURPOSES = ("batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals")


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["file_id"], "object": "file", "bytes": int(row["bytes"]),
            "created_at": int(row["created_at"].timestamp()), "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": int(row["expires_at"].timestamp()) if row["expires_at"] else None}


class _Upload:
    """The multipart parser's callbacks: form fields kept (small), the file part's bytes
    buffered up to CHUNK before they go to the database."""

    def __init__(self, limit_bytes: int) -> None:
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.buffer = bytearray()
        self.limit_bytes = limit_bytes
        self.total = 0
        self.last_byte: int | None = None
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._name: str | None = None
        self._value = bytearray()
        self._is_file = False

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self._begin, "on_part_data": self._data,
                "on_part_end": self._end, "on_header_field": self._hfield,
                "on_header_value": self._hvalue, "on_header_end": self._hend,
                "on_headers_finished": self._headers_done}

    def _begin(self) -> None:
        self._headers, self._name, self._value, self._is_file = {}, None, bytearray(), False

    def _hfield(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _hend(self) -> None:
        self._headers[bytes(self._header_field).lower().decode("latin-1")] = bytes(
            self._header_value)
        self._header_field, self._header_value = bytearray(), bytearray()

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get("content-disposition", b""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options and self._name == "file":
            self._is_file = True
            self.filename = options[b"filename"].decode("utf-8", "replace") or "upload.jsonl"

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.total += end - start
            if self.total > self.limit_bytes:
                raise APIError(400, f"File is too large: the limit is {self.limit_bytes} bytes",
                               param="file", code="file_too_large")
            self.buffer += data[start:end]
            if end > start:
                self.last_byte = data[end - 1]
        else:
            self._value += data[start:end]
            if len(self._value) > 4096:
                raise APIError(400, f"Form field {self._name!r} is too long", param=self._name)

    def _end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


async def create_file(request: Request) -> Response:
    ctx = context(request)
    settings = ctx.settings
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in options:
        raise APIError(400, "Expected a multipart/form-data body with `file` and `purpose`")
    conn = await run_in_threadpool(ctx.db.getconn)
    try:
        who = await run_in_threadpool(tenant, request, conn)
        idempotency = request.headers.get("idempotency-key")
        if idempotency:
            existing = await run_in_threadpool(store.file_by_idempotency, conn, who, idempotency)
            if existing:
                row = await run_in_threadpool(store.get_file, conn, who, existing)
                await run_in_threadpool(conn.rollback)
                if row:
                    return JSONResponse(file_object(row))
        upload = _Upload(settings.max_file_bytes)
        parser = MultipartParser(options[b"boundary"], upload.callbacks())
        writer: store.FileWriter | None = None
        lines = 0

        def flush(final: bool = False) -> None:
            nonlocal writer, lines
            if not upload.buffer and not final:
                return
            if writer is None:
                writer = store.FileWriter(
                    conn, who, upload.filename or "upload.jsonl", "batch",
                    settings.input_retention_seconds, idempotency)
            data = bytes(upload.buffer)
            upload.buffer.clear()
            lines += data.count(b"\n")
            if lines > settings.max_file_lines:
                raise APIError(400, f"File has more than {settings.max_file_lines} lines",
                               param="file", code="too_many_lines")
            writer.write(data)
            if writer.seq == 1:
                faults.point("files.after_first_chunk")

        async for data in request.stream():
            parser.write(data)
            if len(upload.buffer) >= CHUNK:
                await run_in_threadpool(flush)
        parser.finalize()
        if upload.filename is None:
            raise APIError(400, "Missing required parameter: 'file'", param="file")
        purpose = upload.fields.get("purpose")
        if purpose not in PURPOSES:
            raise APIError(400, f"Invalid value for 'purpose': {purpose!r}", param="purpose",
                           code="invalid_value")
        if purpose != "batch":
            raise APIError(400, "Only purpose 'batch' is served here", param="purpose",
                           code="invalid_value")
        await run_in_threadpool(flush, True)
        assert writer is not None
        row = await run_in_threadpool(writer.finish, purpose, upload.last_byte)
        if row["lines"] > settings.max_file_lines:
            raise APIError(400, f"File has more than {settings.max_file_lines} lines",
                           param="file", code="too_many_lines")
        try:
            await run_in_threadpool(conn.commit)
        except psycopg.errors.UniqueViolation:
            # the same Idempotency-Key, committed meanwhile by a concurrent request: retry
            raise APIError(409, "A request with this Idempotency-Key is in progress",
                           code="idempotency_conflict") from None
        faults.point("files.after_commit")
        return JSONResponse(file_object(row))
    finally:
        await run_in_threadpool(_release, ctx.db, conn)


def _release(db: Any, conn: psycopg.Connection) -> None:
    try:
        conn.rollback()  # (nothing after a commit; everything after an error)
    finally:
        db.putconn(conn)


def list_files(request: Request) -> Response:
    ctx = context(request)
    try:
        limit = int(request.query_params.get("limit", "10000"))
    except ValueError:
        raise APIError(400, "limit must be an integer", param="limit") from None
    if not 1 <= limit <= 10000:
        raise APIError(400, "limit must be between 1 and 10000", param="limit")
    with ctx.db.connection() as conn:
        who = tenant(request, conn)
        rows = store.list_files(conn, who, after=request.query_params.get("after"),
                                limit=limit + 1, purpose=request.query_params.get("purpose"))
    data = [file_object(r) for r in rows[:limit]]
    return JSONResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None,
                         "has_more": len(rows) > limit})


def retrieve_file(request: Request) -> Response:
    ctx, file_id = context(request), request.path_params["file_id"]
    with ctx.db.connection() as conn:
        row = store.get_file(conn, tenant(request, conn), file_id)
    if row is None:
        raise not_found("File", file_id)
    return JSONResponse(file_object(row))


def delete_file(request: Request) -> Response:
    ctx, file_id = context(request), request.path_params["file_id"]
    with ctx.db.connection() as conn:
        if not store.delete_file(conn, tenant(request, conn), file_id):
            raise not_found("File", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def file_content(request: Request) -> Response:
    ctx, file_id = context(request), request.path_params["file_id"]
    with ctx.db.connection() as conn:
        row = store.get_file(conn, tenant(request, conn), file_id)
    if row is None:
        raise not_found("File", file_id)

    def chunks() -> Iterator[bytes]:
        with ctx.db.connection() as conn:
            yield from store.read_file(conn, file_id)

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"content-length": str(row["bytes"])})


routes = [
    Route("/v1/files", create_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
]
