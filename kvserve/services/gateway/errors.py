"""The gateway's typed errors, each a kind of kvserve/common/errors.py (which decides its status on every front-end).

The backends' clients (rpc/clients.py over gRPC, or any other implementation of backends.py) raise the
BackendFailure family, so that the engine acts on what happened, never on a transport's status codes.
"""

from __future__ import annotations

from kvserve.common.errors import Internal, InvalidArgument, ResourceExhausted, Unavailable


class ShuttingDown(Unavailable):
    """The gateway stopped admitting requests (graceful shutdown)."""


class GatewayBusy(ResourceExhausted):
    """The gateway's queue of requests waiting for pages is full (max_queued_requests): retry later."""


class OutOfCapacity(ResourceExhausted):
    """A request fits no worker pool even with nothing else running (pinned blocks hold the pages)."""


class BackendFailure(Unavailable):
    """A worker or the kvmanager failed a request's step; the request ends with this error, its pages freed."""


class KVManagerFailed(BackendFailure):
    """The kvmanager refused a call (a page op it found malformed or stale)."""


class KVManagerUnavailable(KVManagerFailed):
    """The kvmanager did not answer, also after the client's retries (down, restarting, or its Redis down)."""


class WorkerUnavailable(BackendFailure):
    """A worker did not answer a step, also after the client's retries, or refused it."""


class WorkerRejected(BackendFailure):
    """A worker refused a whole step for another reason than a lost connection, a timeout or a new epoch (a step
    malformed as a whole, an error while computing it). It is alive: never a reason to declare it gone. The
    engine computes the step's requests again, one under suspicion per step, and fails the one whose step fails
    again."""


class RequestRejected(InvalidArgument):
    """A worker rejected this request's item of a step as malformed (its own check): this request alone fails."""


class RequestFailed(Internal):
    """This request alone could not be computed: its logits came out non-finite, the kvmanager refused its page
    op, or its steps failed twice in a row (on two workers, or twice on one, the second time as the only request
    under suspicion in its step). It is never handed around again."""


class WorkerRestarted(BackendFailure):
    """A worker answered as another incarnation (a new epoch): its pages are gone; the engine registers the new
    pool and recomputes what ran there."""


class WorkerIncompatible(BackendFailure):
    """A restarted worker serves another model, page size or context length than the engine started with."""
