"""The HTTP front-end's one table of errors: each kind of typed error (kvserve/common/errors.py) is one HTTP status and
one OpenAI error type, as ERROR_STATUS is for gRPC; the body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from kvserve.common.errors import (
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

# kind -> (status, OpenAI error type). ResourceExhausted is 429: the gateway's queue is full (GatewayBusy) or
# the request does not fit beside the pages others hold (OutOfCapacity), both worth a retry later.
# Unavailable is 503: the gateway is shutting down, or the kvmanager or a worker did not answer.
ERROR_STATUS: dict[type[DomainError], tuple[int, str]] = {
    InvalidArgument: (400, "invalid_request_error"),
    NotFound: (404, "invalid_request_error"),
    FailedPrecondition: (400, "invalid_request_error"),
    ResourceExhausted: (429, "rate_limit_error"),
    Unavailable: (503, "service_unavailable"),
    Unauthenticated: (401, "authentication_error"),
}
INTERNAL = (500, "internal_error")
RETRY_AFTER_S = 1  # the Retry-After of a 429 or a 503


class ModelNotFound(NotFound):
    """The body names another model than the one this gateway serves."""

    code, param = "model_not_found", "model"


class BodyTooLarge(InvalidArgument):
    """The request body is over the front-end's limit (413)."""


class CancelledByServer(Unavailable):
    """The gateway ended the request (shutdown) while the client still waited for it."""


def status_of(error: Exception) -> tuple[int, str]:
    if isinstance(error, BodyTooLarge):
        return 413, "invalid_request_error"
    return next((v for kind, v in ERROR_STATUS.items() if isinstance(error, kind)), INTERNAL)


def error_body(error: Exception) -> dict:
    """OpenAI's error object for ``error``; its message is the typed error's own."""
    _, kind = status_of(error)
    code = getattr(error, "code", None)
    if isinstance(error, Unauthenticated):
        code = "invalid_api_key"
    message = str(error) if isinstance(error, DomainError) else "internal error (a bug): see the gateway's log"
    return {"error": {"message": message, "type": kind, "param": getattr(error, "param", None), "code": code}}


def headers_of(error: Exception) -> dict[str, str]:
    status, _ = status_of(error)
    return {"retry-after": str(RETRY_AFTER_S)} if status in (429, 503) else {}
