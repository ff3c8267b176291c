"""OpenAI-style errors: one exception type for the API and the handlers that render every failure alike.

Every error leaves the ingress as `{"error": {"message", "type", "param", "code"}}`
with its HTTP status: 400 for invalid requests (bad JSON, wrong types, missing
fields, bad values, prompts too long), 401 for a missing or wrong API key, 404 for
an unknown model or route, 405 for a method a route does not take (with `Allow`),
413 for a body over the size limit, 503 when the decode replicas are overloaded or
unavailable (with `Retry-After`), 500 for anything unexpected (logged with its
traceback). `param` names the field at fault, with list positions
(`messages.2.content`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 503: "service_unavailable_error"}
# Seconds a client is asked to wait before retrying a 503.
RETRY_AFTER_S = 1
# Names pydantic gives the members of a union in an error location; they are not request fields.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


class APIError(Exception):
    """A request the API answers with an error status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error as a response; `headers` are the ones HTTP asks for with the status (`Allow` with a 405)."""
    sent = dict(headers or {})
    if status == 503:
        sent["Retry-After"] = str(RETRY_AFTER_S)
    if status == 401:
        sent["WWW-Authenticate"] = "Bearer"  # HTTP asks a 401 to name the scheme it takes
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=sent)


def _field_path(loc: Sequence[Any]) -> str:
    """`messages.0.content` from pydantic's location, without the request-body root and union member names."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (
        "[" in p or p.lower() in _UNION_MEMBERS or p[:1].isupper()))]
    return ".".join(parts)


def invalid_request(errors: Sequence[dict[str, Any]]) -> APIError:
    """The 400 for pydantic's validation errors: every distinct problem, the first field as `param`."""
    problems: list[str] = []
    params: list[str] = []
    paths = {_field_path(error.get("loc", ())) for error in errors if error.get("type") != "json_invalid"}
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = error.get("ctx", {}).get("error", error["msg"])
            if "hex escape" in reason:  # the parser's words for a lone surrogate too, which reads as a cut body
                reason += r"; a \u escape names a whole character: 4 hex digits, a UTF-16 surrogate only in a pair"
            problems.append(f"the request body is not valid JSON ({reason})")
            continue
        where = _field_path(error.get("loc", ())) or "body"
        if any(path.startswith(f"{where}.") for path in paths):
            continue  # a union member the value is not (a string, for a list that was sent): its inner errors say more
        params.append(where)
        problem = f"{where}: {error['msg'].removeprefix('Value error, ')}"
        if problem not in problems:
            problems.append(problem)
    return APIError(400, "; ".join(problems[:5]) or "invalid request", params[0] if params else None)


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error the app raises an OpenAI-style JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = invalid_request(exc.errors())
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}")
