"""OpenAI-style errors: one exception type for the API and the handlers that render every failure alike.

Every error leaves the ingress as `{"error": {"message", "type", "param", "code"}}`
with its HTTP status: 400 for invalid requests (bad JSON, missing fields, bad
values, prompts too long), 401 for a missing or wrong API key, 404 for an unknown
model or route, 503 when the decode replicas are overloaded or unavailable,
500 for anything unexpected (logged with its traceback).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """A request the API answers with an error status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, params = [], []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            problems.append(f"the request body is not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})")
            continue
        where = ".".join(loc) or "body"
        params.append(where)
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems) or "invalid request", (params[0] if params else None)


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error the app raises an OpenAI-style JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}")
