"""The typed errors domain code raises, by kind. A domain error subclasses the kind that tells its caller what
to do; each transport maps every kind to one status in one table (kvserve/common/grpc_server.py for gRPC), so a
servicer never decides a status itself and nothing falls through to INTERNAL.

"Not enough pages" is not an error anywhere: it is a result the scheduler acts on (it preempts).
"""

from __future__ import annotations


class DomainError(Exception):
    """Base of every typed error; the message says what was wrong. ``param`` names the request field at fault
    (OpenAI's error.param) and ``req_id`` the one request at fault, where there is one: the gateway then fails that
    request alone and the rest of its step goes on."""

    param: str | None = None
    req_id: str | None = None

    def __init__(self, message: str = "", *, param: str | None = None, req_id: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param
        if req_id is not None:
            self.req_id = req_id


class InvalidArgument(DomainError):
    """The input is malformed; nothing was applied."""


class NotFound(DomainError):
    """Something the call names does not exist; nothing was applied."""


class FailedPrecondition(DomainError):
    """The call is well formed but does not apply to the current state; nothing was applied."""


class ResourceExhausted(DomainError):
    """A capacity limit was reached."""


class Unavailable(DomainError):
    """A service the call depends on did not answer; the same call may succeed later."""


class Unauthenticated(DomainError):
    """A missing or unknown credential."""


class Internal(DomainError):
    """A bug on the server's side (an invariant broke); the message says where."""


class InvalidRequest(InvalidArgument, ValueError):
    """Malformed input (a step, a page op, a generation request); the message names the item and the field."""


class StaleEpoch(FailedPrecondition):
    """The call addresses another incarnation of a worker: a step for an old epoch, a registration of an old or
    changed one."""
