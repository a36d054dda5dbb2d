"""Typed errors of the client SDK: one class per gRPC status the gateway returns, all under KVServeError."""

from __future__ import annotations

import grpc


class KVServeError(Exception):
    """A failed gateway call. Raised as such for statuses without a subclass of their own.

    Attributes:
        code: the call's gRPC status code.
        details: the server's (or the gRPC runtime's) description of the failure.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(KVServeError):
    """Bad input: empty prompt, prompt longer than the model allows, sampling values out of range."""


class Unauthenticated(KVServeError):
    """A missing or unknown API key."""


class PermissionDenied(KVServeError):
    """The API key may not do this."""


class NotFound(KVServeError):
    """Something the request names does not exist."""


class ResourceExhausted(KVServeError):
    """A quota or a server capacity limit was reached."""


class FailedPrecondition(KVServeError):
    """The server is not in a state to serve this request."""


class Unavailable(KVServeError):
    """The gateway could not be reached or is shutting down (retried by the clients before it is raised)."""


class DeadlineExceeded(KVServeError):
    """The call's deadline passed before it finished."""


class Cancelled(KVServeError):
    """The call was cancelled."""


class InternalError(KVServeError):
    """The server failed (INTERNAL)."""


_BY_CODE: dict[grpc.StatusCode, type[KVServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: InternalError,
}


def rpc_error_code(e: grpc.RpcError) -> grpc.StatusCode:
    """The status code of a failed call; UNKNOWN for an RpcError that carries none."""
    code = getattr(e, "code", None)
    return code() if callable(code) else grpc.StatusCode.UNKNOWN


def from_rpc_error(e: grpc.RpcError) -> KVServeError:
    """The typed error for a failed call (sync or grpc.aio). Raise it ``from e`` to keep the chain.

    Args:
        e: the gRPC error.

    Returns:
        An instance of the subclass for its status code, or of KVServeError for other codes.
    """
    code = rpc_error_code(e)
    details = getattr(e, "details", None)
    text = details() if callable(details) else None
    return _BY_CODE.get(code, KVServeError)(code, text or "")
