"""Typed frontend errors; the HTTP layer maps each to a status code and an OpenAI-style body.

    {"error": {"message": "...", "type": "invalid_request_error", "code": 400}}

`code` is the HTTP status, except where OpenAI names the error (`model_not_found`).
Anthropic's Messages API (/v1/messages) gets the same errors in its own shape
(`error_body`): {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}.
"""

from __future__ import annotations


# OpenAI's error types by HTTP status; every other 4xx is an invalid_request_error.
OPENAI_ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "internal_server_error",
                      503: "service_unavailable"}


class FrontendError(Exception):
    """Base class: a message for the client plus the HTTP status and OpenAI error type.

    A subclass names its status, `class ...Error(FrontendError, status_code=404)`, or inherits it;
    its `error_type` follows from the status (OPENAI_ERROR_TYPES).
    """

    status_code = 500
    error_type = "internal_server_error"
    code: int | str | None = None  # None: the status code
    headers: dict[str, str] | None = None  # extra response headers

    def __init_subclass__(cls, status_code: int | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if status_code is not None:
            cls.status_code = status_code
        cls.error_type = OPENAI_ERROR_TYPES.get(cls.status_code, "invalid_request_error")

    def to_dict(self) -> dict:
        code = self.status_code if self.code is None else self.code
        return {"error": {"message": str(self), "type": self.error_type, "code": code}}


ANTHROPIC_PATH_PREFIX = "/v1/messages"
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); the rest are api_error.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         529: "overloaded_error"}


def anthropic_error(status_code: int, message: str) -> dict:
    error_type = ANTHROPIC_ERROR_TYPES.get(status_code, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_body(error: FrontendError, path: str) -> dict:
    """The error's body in the shape of the API `path` belongs to."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        return anthropic_error(error.status_code, str(error))
    return error.to_dict()


class InvalidRequestError(FrontendError, status_code=400):
    """The request itself is wrong: bad sampling params, empty or too-long prompt, bad JSON."""


class AuthenticationError(FrontendError, status_code=401):
    """No API key, or the wrong one, where the server wants one."""


class ModelNotFoundError(FrontendError, status_code=404):
    """The `model` field names a model this server does not serve (OpenAI's and vLLM's 404)."""

    code = "model_not_found"


class ConnectionClosingError(FrontendError):
    """A request the server stops reading: what is left of it on the connection cannot be trusted, so it closes."""

    headers = {"connection": "close"}


class RequestTimeoutError(ConnectionClosingError, status_code=408):
    """The body did not arrive within --body-timeout; the connection is closed."""


class RequestTooLargeError(ConnectionClosingError, status_code=413):
    """The body is over --max-request-bytes; a bounded part of it is read and dropped, then the connection closes."""


class HeadersTooLargeError(ConnectionClosingError, status_code=431):
    """The request line and headers are over their limit; answered by the HTTP protocol, before any app code."""


class ServerBusyError(FrontendError, status_code=429):
    """--max-concurrent-requests are already being served; the client may retry."""

    headers = {"retry-after": "1"}


class EngineDeadError(FrontendError, status_code=503):
    """An engine core died; in-flight requests on it fail and the frontend stops taking new ones."""


class ShuttingDownError(EngineDeadError):
    """The server got SIGTERM: it takes no new requests, and ends those still running after the grace."""


class RequestFailedError(FrontendError, status_code=500):
    """The engine reported an error for this one request; other requests are unaffected."""


class NotFoundError(FrontendError, status_code=404):
    """A stored object (a response by id) that is not there."""
