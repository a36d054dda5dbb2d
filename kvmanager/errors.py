"""Typed errors of the kvmanager domain. The servicer maps each to one gRPC status (servicer.ERROR_STATUS).

"Not enough pages" is not an error: it is an OUT_OF_PAGES result the scheduler acts on (it preempts).
"""


class KVManagerError(Exception):
    """Base class; the message says what was wrong."""


class InvalidRequest(KVManagerError):
    """Malformed input; nothing was applied."""


class UnknownWorker(KVManagerError):
    """No pool is registered for the worker_id; nothing was applied."""


class UnknownRequest(KVManagerError):
    """The req_id is not live (never allocated, freed, or reset); nothing was applied."""


class UnknownTenant(KVManagerError):
    """The tenant holds no blocks and no requests."""


class StaleStep(KVManagerError):
    """A step_id lower than one already applied for the same request; nothing was applied."""


class StaleEpoch(KVManagerError):
    """A registration for an epoch older than the registered one, or a changed pool under the same epoch."""


class RequestsRunning(KVManagerError):
    """An operation that would take pages from live requests, refused while there are some; nothing was
    applied."""


class StoreUnavailable(KVManagerError):
    """The write-through to Redis failed. The change is kept in memory and written by the next call that
    succeeds; retry the same call (same step_id) to get its answer."""
