"""The one error hierarchy of strata; each error knows its HTTP status and OpenAI error type."""
from __future__ import annotations


class StrataError(Exception):
    """Base of every error strata raises on purpose."""

    http_status: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(StrataError):
    """A bad configuration or checkpoint, found at start-up."""

    http_status = 400
    error_type = "BadRequestError"


class UnsupportedModelError(ConfigError):
    """An architecture or feature strata does not serve."""


class RequestError(StrataError):
    """A request with invalid fields; `param` names the field."""

    http_status = 400
    error_type = "BadRequestError"


class NotFoundError(StrataError):
    http_status = 404
    error_type = "NotFoundError"


class AuthError(StrataError):
    http_status = 401
    error_type = "AuthenticationError"


class EngineDeadError(StrataError):
    """The engine (or one of its workers) failed; no request can be served any more."""

    http_status = 503
    error_type = "ServiceUnavailableError"


class OverloadedError(StrataError):
    """The server refuses new work for now (its queue is full, or it is draining); retry after a while."""

    http_status = 503
    error_type = "ServiceUnavailableError"
    retry_after_s = 1


class RequestTooLargeError(StrataError):
    http_status = 413
    error_type = "RequestTooLargeError"
