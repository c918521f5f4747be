"""Every error the server answers, raised once as one internal type and rendered in the shape
of the wire it happened on. OpenAI's is the app's: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status that says who must act (4xx: the client, 5xx: the server). A wire
with a shape of its own (Anthropic's, ``anthropic_error_body``) builds its
handlers with ``exception_handlers(its_error_body)`` and hangs them on its controller, so
everything raised under its routes — the key guard, the web guard, its handlers — answers in its
shape with the same status. A request that no route takes (404, 405) has no controller: it
answers in the shape of the wire whose path it is under (``exception_handlers(unrouted=...)``).

Invariant: no exception reaches the client as Litestar's own error body or a traceback. Body
decoding errors (malformed JSON, invalid UTF-8, wrong field types) are 400 and name the field; a
prompt over the context is 400 ``context_length_exceeded``; JSON nested too deeply to decode is
400; a body over the size limit is 413; unknown routes are 404, and the OpenAI/Anthropic
endpoints agentd does not serve are a 404 that names them (``unsupported_endpoint``); a full
queue is 503 with ``Retry-After``; anything unexpected is a 500 that is also logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

logger = logging.getLogger("agentd.server")

ErrorBody = Callable[["APIError"], Any]  # a wire's rendering of an error
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
          413: "request_too_large", 503: "service_unavailable"}


class APIError(Exception):
    """An error a handler raises to answer ``status`` with the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or error_type(status)
        self.headers = headers


class RequestValidationError(ValueError):
    """A request the client must fix; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def to_api_error(self) -> APIError:
        return APIError(self.status, self.message, param=self.param, code=self.code)

    def to_body(self) -> ErrorResponse:
        return error_body(self.message, param=self.param)


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> ErrorResponse:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))


def openai_error_body(error: APIError) -> ErrorResponse:
    """The app's shape: OpenAI's envelope."""
    return error_body(error.message, type=error.type, param=error.param, code=error.code)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """The wire's error shape: ``{"type": "error", "error": {"type", "message"}}``, with the
    same status as on every wire."""
    kind = _ANTHROPIC_TYPES.get(error.status) or (
        "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


# Endpoints of the OpenAI and Anthropic APIs that agentd does not serve, by path pattern.
_UNSUPPORTED = tuple((re.compile(pattern), what) for pattern, what in (
    (r"^/v1/embeddings", "embeddings"), (r"^/v1/audio", "audio (speech and transcription)"),
    (r"^/v1/images", "image generation"), (r"^/v1/moderations", "moderations"),
    (r"^/v1/(files|uploads)", "file uploads"), (r"^/v1/batches", "the Batch API"),
    (r"^/v1/fine_tuning", "fine-tuning"), (r"^/v1/(assistants|threads)", "the Assistants API"),
    (r"^/v1/vector_stores", "vector stores"), (r"^/v1/realtime", "the Realtime API"),
    (r"^/v1/conversations", "the Conversations API"), (r"^/v1/evals", "evals"),
    (r"^/v1/responses/[^/]+/input_items", "listing a response's input items"),
    (r"^/v1/responses/[^/]+/cancel", "cancelling background responses"),
    (r"^/v1/responses/(input_tokens|compact)", "this Responses API helper"),
    (r"^/v1/messages/batches", "Anthropic message batches"),
    (r"^/v1/complete$", "Anthropic's legacy text completions (use /v1/messages)")))
SERVED = ("/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
          "/v1/messages/count_tokens and /v1/models")


def error_response(error: APIError, render: ErrorBody = openai_error_body) -> Response[Any]:
    return Response(render(error), status_code=error.status, headers=error.headers)


def unsupported_endpoint(path: str) -> str | None:
    """What the OpenAI or Anthropic endpoint at ``path`` does, if agentd does not serve it."""
    return next((what for pattern, what in _UNSUPPORTED if pattern.search(path)), None)


def as_api_error(exc: Exception, path: str, method: str = "") -> APIError:
    """Whatever a request raised, as the error it answers (an unexpected one is logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return exc.to_api_error()
    if isinstance(exc, ValidationException):
        return _litestar_validation(exc)
    if isinstance(exc, SerializationException):  # a body that is not JSON, read by our hook
        return APIError(400, f"the request body is not valid JSON: {_json_decode_reason(exc)}")
    if isinstance(exc, HTTPException):
        return _http_error(exc, path)
    if isinstance(exc, RecursionError):
        # JSON nested past Python's recursion limit (msgspec decodes, and our canonicalising of
        # tool schemas walks, recursively): the client's body, so a 400, not a crash.
        return APIError(400, "the request body nests too deeply (JSON nested hundreds of "
                        f"levels deep is refused): {exc}")
    logger.exception("unhandled error on %s %s", method, path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _litestar_validation(exc: ValidationException) -> APIError:
    """Litestar's msgspec decoding failed: name the first bad field like OpenAI does."""
    if (reason := _json_decode_reason(exc)) is not None:
        return APIError(400, f"the request body is not valid JSON: {reason}")
    problems: list[Any] = exc.extra if isinstance(exc.extra, list) else []
    first = problems[0] if problems and isinstance(problems[0], dict) else {}
    key = first.get("key")
    message = first.get("message") or exc.detail
    if key:
        message = f"invalid value for {key}: {message}"
    return APIError(400, str(message), param=key or None)


def _json_decode_reason(exc: BaseException) -> str | None:
    """msgspec's reason if ``exc`` was caused by a body that is not JSON at all."""
    seen: BaseException | None = exc
    while seen is not None:
        not_json = isinstance(seen, SerializationException) or (
            isinstance(seen, msgspec.DecodeError) and not isinstance(seen, msgspec.ValidationError))
        if not_json:
            return str(seen).removeprefix("JSON is malformed: ")
        seen = seen.__cause__ or seen.__context__
    return None


def _http_error(exc: HTTPException, path: str) -> APIError:
    status = exc.status_code
    message = exc.detail
    if status == 404 and (what := unsupported_endpoint(path)) is not None:
        return APIError(404, f"agentd does not serve {what} ({path}); it serves {SERVED}",
                        code="unsupported_endpoint")
    if status == 400 and (reason := _json_decode_reason(exc)) is not None:
        message = f"the request body is not valid JSON: {reason}"
    elif status == 413:
        message = "the request body is too large"
    elif status == 404:
        message = f"not found: {message}" if message and message != "Not Found" else "not found"
    headers = dict(exc.headers) if exc.headers else None
    return APIError(status, str(message), headers=headers)


def exception_handlers(render: ErrorBody = openai_error_body,
                       unrouted: Mapping[str, ErrorBody] | None = None
                       ) -> dict[type[Exception], Any]:
    """Litestar exception handlers that answer every error in ``render``'s shape; a request no
    route took answers in the shape of the first ``unrouted`` path prefix it is under."""

    def handle(request: Request, exc: Exception) -> Response[Any]:
        path = request.url.path
        shape = render
        if "route_handler" not in request.scope:
            shape = next((r for prefix, r in (unrouted or {}).items()
                          if path.startswith(prefix)), render)
        return error_response(as_api_error(exc, path, request.method), shape)

    return {Exception: handle}
