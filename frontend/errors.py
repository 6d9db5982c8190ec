"""Typed frontend errors; the HTTP layer maps each to a status code and an OpenAI-style body.

    {"error": {"message": "...", "type": "invalid_request_error", "code": 400}}
"""

from __future__ import annotations


class FrontendError(Exception):
    """Base class: a message for the client plus the HTTP status and OpenAI error type."""

    status_code = 500
    error_type = "internal_server_error"

    def to_dict(self) -> dict:
        return {"error": {"message": str(self), "type": self.error_type, "code": self.status_code}}


class InvalidRequestError(FrontendError):
    """The request itself is wrong: bad sampling params, empty or too-long prompt, bad JSON."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(FrontendError):
    status_code = 401
    error_type = "authentication_error"


class EngineDeadError(FrontendError):
    """An engine core died; in-flight requests on it fail and the frontend stops taking new ones."""

    status_code = 503
    error_type = "service_unavailable"


class RequestFailedError(FrontendError):
    """The engine reported an error for this one request; other requests are unaffected."""

    status_code = 500
    error_type = "internal_server_error"
