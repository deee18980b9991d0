"""Batches on the queue: creating one (validate the input file line by line while its
tasks stream into the queue, all in one transaction) and moving one on (expiry,
cancellation, finalizing: the output and error files written from the results)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import psycopg

from jobrunner.features import results
from jobrunner.features.openai_batch import ENDPOINTS, error_line, output_line
from jobrunner.model.errors import BadInput
from jobrunner.model.validation import MAX_KEY_CHARS, MAX_PAYLOAD_BYTES
from jobrunner.observability import tracing
from jobrunner.server import faults
from jobrunner.server.context import HANDLER, Context
from jobrunner.server.errors import APIError, not_found
from jobrunner.store import batch_api as store

log = logging.getLogger("jobrunner.server")
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_CHUNK = 1024 * 1024


def _bad_line(line: int, message: str, code: str) -> APIError:
    return APIError(400, f"Line {line}: {message}", param="input_file_id", code=code)


def _lines(conn: psycopg.Connection, file_id: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a stored file, chunk by chunk: one chunk and one line in
    memory. Blank lines are skipped (their numbers still count)."""
    rest = b""
    number = 0
    for chunk in store.file_chunks(conn, file_id):
        data = rest + chunk
        parts = data.split(b"\n")
        rest = parts.pop()
        for part in parts:
            number += 1
            if part.strip():
                yield number, part
    if rest.strip():
        yield number + 1, rest


def _tasks(conn: psycopg.Connection, file_id: str, endpoint: str, routes: dict | None,
           max_attempts: int, found: dict[str, Any]
           ) -> Iterator[tuple[str, str, int, list[str] | None]]:
    """The file's lines as tasks (custom_id, payload, attempts, the flow-control limit of
    the line's route if it names one), checked one by one; the first bad line raises (and
    the transaction writes nothing)."""
    seen: set[str] = set()
    for number, raw in _lines(conn, file_id):
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad_line(number, f"not valid JSON ({exc})", "invalid_json_line") from None
        if not isinstance(obj, dict):
            raise _bad_line(number, "a request must be a JSON object", "invalid_json_line")
        missing = [f for f in ("custom_id", "method", "url", "body") if f not in obj]
        if missing:
            raise _bad_line(number, f"missing required field(s) {', '.join(missing)}",
                            "missing_required_parameter")
        key = obj["custom_id"]
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or "\x00" in key:
            raise _bad_line(number, f"custom_id must be a non-empty string of at most "
                            f"{MAX_KEY_CHARS} characters", "invalid_custom_id")
        if key in ("__reduce__", "__generate__"):
            raise _bad_line(number, f"custom_id {key!r} is reserved", "invalid_custom_id")
        if obj["method"] != "POST":
            raise _bad_line(number, f"method must be 'POST', got {obj['method']!r}",
                            "invalid_method")
        if obj["url"] != endpoint:
            raise _bad_line(number, f"url {obj['url']!r} does not match the batch's endpoint "
                            f"{endpoint!r}", "mismatched_endpoint")
        body = obj["body"]
        if not isinstance(body, dict):
            raise _bad_line(number, "body must be a JSON object", "invalid_body")
        model = body.get("model")
        if routes is not None and model not in routes:
            raise _bad_line(number, f"model {model!r} is not served here (known: "
                            f"{', '.join(sorted(routes))})", "model_not_found")
        if key in seen:
            raise _bad_line(number, f"duplicate custom_id {key!r}", "duplicate_custom_id")
        seen.add(key)
        found.setdefault("model", model)
        payload = _dumps({"method": "POST", "url": endpoint, "body": body})
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise _bad_line(number, f"request is over {MAX_PAYLOAD_BYTES} bytes",
                            "request_too_large")
        found["total"] = found.get("total", 0) + 1
        route = routes.get(model) if routes is not None else None
        # (the route's limit gates every worker's claims, and a 429 pauses it for all)
        yield key, payload, max_attempts, [route.limit] if route and route.limit else None


def create_batch(ctx: Context, who: str, body: Any, idempotency: str | None
                 ) -> dict[str, Any]:
    """Validate the request and the input file and enqueue its lines, in one
    transaction: a bad line, a crash or a lost connection leave nothing behind."""
    settings = ctx.settings
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise APIError(400, f"Missing required parameter: '{name}'.", param=name,
                           code="missing_required_parameter")
    endpoint = body["endpoint"]
    if endpoint not in ENDPOINTS:
        raise APIError(400, f"Invalid value for 'endpoint': {endpoint!r} (one of "
                       f"{', '.join(ENDPOINTS)})", param="endpoint", code="invalid_value")
    window = settings.window_seconds(body["completion_window"])
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                    and len(v) <= 512 for k, v in metadata.items())):
        raise APIError(400, "metadata: at most 16 string keys (64 characters) and string "
                       "values (512 characters)", param="metadata", code="invalid_value")
    routes = settings.routes()
    with ctx.db.connection() as conn:
        if idempotency:
            existing = store.batch_by_idempotency(conn, who, idempotency)
            if existing:
                return batch_object(ctx, conn, store.get_batch(conn, who, existing))
        file = store.get_file(conn, who, body["input_file_id"])
        if file is None:
            raise not_found("File", body["input_file_id"], "input_file_id")
        if file["purpose"] != "batch":
            raise APIError(400, f"File {file['file_id']} has purpose {file['purpose']!r}, "
                           "not 'batch'", param="input_file_id", code="invalid_value")
        if file["lines"] > settings.max_file_lines:
            raise APIError(400, f"File has more than {settings.max_file_lines} requests",
                           param="input_file_id", code="too_many_requests")
        batch_id = store.new_id("batch_")
        found: dict[str, Any] = {}
        try:
            # The file is read on a second connection: the first is busy with the COPY
            # its lines stream into.
            with (tracing.enqueue_span(batch_id, who, pool=settings.pool),
                  ctx.db.connection() as reader, conn.transaction()):
                store.enqueue_batch(conn, batch_id=batch_id, tenant_id=who, pool=settings.pool,
                                    handler=HANDLER, rows=_tasks(
                                        reader, file["file_id"], endpoint, routes,
                                        settings.max_attempts, found),
                                    trace_context=tracing.carrier())
                if not found.get("total"):
                    raise APIError(400, "The input file has no requests",
                                   param="input_file_id", code="empty_file")
                store.insert_batch(conn, batch_id=batch_id, tenant_id=who,
                                   input_file_id=file["file_id"], endpoint=endpoint,
                                   completion_window=body["completion_window"],
                                   metadata=metadata, model=found.get("model"),
                                   total=found["total"], window_seconds=window,
                                   idempotency_key=idempotency)
                faults.point("batches.before_commit")
        except psycopg.errors.UniqueViolation:
            raise APIError(409, "A request with this Idempotency-Key is in progress",
                           code="idempotency_conflict") from None
        except BadInput as exc:  # (a route names a limit this server does not define)
            raise APIError(400, f"The model's route cannot be used: {exc}",
                           param="input_file_id", code="limit_not_defined") from None
        conn.commit()
        faults.point("batches.after_commit")
        return batch_object(ctx, conn, store.get_batch(conn, who, batch_id))


def _ts(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


def batch_object(ctx: Context, conn: psycopg.Connection, row: dict[str, Any]
                 ) -> dict[str, Any]:
    """The batch as OpenAI returns it. An open batch's counts and usage come from the
    queue, at most a second old (counts.py); an ended batch's are final."""
    if row["status"] in ("in_progress", "finalizing", "cancelling"):
        usage = ctx.counts.read(conn, row["batch_id"])
        completed, failed = usage["completed"], usage["failed"]
    else:
        completed, failed = row["completed"], row["failed"]
        usage = store.batch_usage(conn, row["batch_id"])
    return {
        "id": row["batch_id"], "object": "batch", "endpoint": row["endpoint"],
        "model": row["model"], "errors": None, "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"], "status": row["status"],
        "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": _ts(row["created_at"]), "in_progress_at": _ts(row["in_progress_at"]),
        "expires_at": _ts(row["expires_at"]), "finalizing_at": _ts(row["finalizing_at"]),
        "completed_at": _ts(row["completed_at"]), "failed_at": _ts(row["failed_at"]),
        "expired_at": _ts(row["expired_at"]), "cancelling_at": _ts(row["cancelling_at"]),
        "cancelled_at": _ts(row["cancelled_at"]),
        "request_counts": {"total": row["total"], "completed": completed, "failed": failed},
        "usage": {"input_tokens": usage["input_tokens"],
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["output_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["tokens"]},
        "metadata": row["metadata"],
    }


# -- moving batches on (every replica's sweeper) --------------------------------------------
def advance(ctx: Context, batch_id: str) -> str | None:
    """One step for an open batch, under its row lock (a batch another replica is moving
    is skipped): expire it at its deadline; once no task runs, write its files and end it.
    Returns its status after the step, or None if skipped."""
    with ctx.db.connection() as conn, conn.transaction():
        row = store.lock_batch(conn, batch_id)
        if row is None:
            return None
        status = row["status"]
        if status == "in_progress":
            if row["due"]:
                store.expire_batch(conn, batch_id)  # pending tasks cancelled, files next
                return "finalizing"
            if store.batch_open(conn, batch_id):
                return status
        else:
            store.cancel_tasks(conn, batch_id)  # (tasks released back to pending meanwhile)
            if store.batch_leased(conn, row["tenant_id"], batch_id):
                return status
        final = ("expired" if row["expired_at"] else
                 "cancelled" if row["cancelling_at"] else "completed")
        retention = ctx.settings.output_retention_seconds
        with ctx.db.connection() as reader:
            output, completed = _write_file(
                conn, row["tenant_id"], f"{batch_id}_output.jsonl", retention,
                (output_line(batch_id, key, result) for key, _s, result, _a, _f
                 in results.rows(reader, batch_id)))
            errors, failed = _write_file(
                conn, row["tenant_id"], f"{batch_id}_error.jsonl", retention,
                (error_line(batch_id, key, st, error) for key, st, error, _a, _f
                 in results.rows(reader, batch_id, errors=True)))
        store.end_batch(conn, batch_id, status=final, completed=completed, failed=failed,
                        output_file_id=output, error_file_id=errors)
        ctx.counts.forget(batch_id)
        return final


def _write_file(conn: psycopg.Connection, tenant_id: str, filename: str, retention: float,
                lines: Iterator[str]) -> tuple[str | None, int]:
    """A batch_output file of these lines, in ~1 MiB chunks (constant memory); no file
    when there are none."""
    writer, buffer, count = None, bytearray(), 0
    for line in lines:
        if writer is None:
            writer = store.FileWriter(conn, tenant_id, filename, "batch_output", retention)
        buffer += line.encode() + b"\n"
        count += 1
        if len(buffer) >= _CHUNK:
            writer.write(bytes(buffer))
            buffer.clear()
    if writer is None:
        return None, 0
    writer.write(bytes(buffer))
    writer.finish("batch_output", 0x0A)
    return writer.file_id, count


def cancel(ctx: Context, who: str, batch_id: str) -> dict[str, Any]:
    with ctx.db.connection() as conn, conn.transaction():
        row = store.get_batch(conn, who, batch_id)
        if row is None:
            raise not_found("Batch", batch_id)
        if row["status"] in ("completed", "expired", "failed"):
            raise APIError(400, f"Cannot cancel a batch with status {row['status']}.",
                           code="invalid_state")
        store.request_cancel(conn, who, batch_id)
    advance(ctx, batch_id)  # ends it now if nothing runs
    with ctx.db.connection() as conn:
        return batch_object(ctx, conn, store.get_batch(conn, who, batch_id))


def sweep(ctx: Context) -> None:
    """Advance every open batch once, and delete expired files."""
    with ctx.db.connection() as conn:
        open_ids = store.open_batches(conn)
    for batch_id in open_ids:
        try:
            advance(ctx, batch_id)
        except Exception as exc:
            log.error("advancing %s failed: %s: %s", batch_id, type(exc).__name__, exc)
    with ctx.db.connection() as conn:
        store.delete_expired_files(conn)
