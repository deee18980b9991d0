"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
status codes its SDKs map to their exception classes (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 409 ConflictError, 500 InternalServerError)."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("jobrunner.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status)


def not_found(kind: str, id_: str, param: str = "id") -> APIError:
    return APIError(404, f"No such {kind} object: {id_}", param=param)


async def api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = (f"Invalid URL ({request.method} {request.url.path})"
               if exc.status_code in (404, 405) else str(exc.detail))
    return APIError(exc.status_code, message).response()


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    # The request's headers (the key) are never logged; the exception's type and text are.
    log.error("%s %s failed: %s: %s", request.method, request.url.path,
              type(exc).__name__, exc)
    return APIError(500, "The server had an error while processing your request.",
                    type="server_error").response()


HANDLERS = {APIError: api_error, HTTPException: http_error, Exception: server_error}
