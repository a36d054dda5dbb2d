"""Typed errors of the kvmanager domain, each a kind of kvserve/common/errors.py (which decides its status on every
transport). Malformed input is common.errors.InvalidRequest; a registration of an old or changed epoch is
common.errors.StaleEpoch.

"Not enough pages" is not an error: it is an OUT_OF_PAGES result the scheduler acts on (it preempts).
"""

from __future__ import annotations

from kvserve.common.errors import FailedPrecondition, NotFound, Unavailable


class UnknownWorker(NotFound):
    """No pool is registered for the worker_id; nothing was applied."""


class UnknownRequest(NotFound):
    """The req_id is not live (never allocated, freed, or reset); nothing was applied."""


class UnknownTenant(NotFound):
    """The tenant holds no blocks and no requests."""


class StaleStep(FailedPrecondition):
    """A step_id lower than one already applied for the same request; nothing was applied."""


class RequestsRunning(FailedPrecondition):
    """An operation that would take pages from live requests, refused while there are some; nothing was
    applied."""


class TextUnsupported(FailedPrecondition):
    """Text input, but the kvmanager was started without a tokenizer (``--model``)."""


class StoreUnavailable(Unavailable):
    """The write to Redis failed. The change is kept in memory and written by the next call that succeeds;
    retry the same call (same step_id) to get its answer."""


class NotLeader(Unavailable):
    """This kvmanager is not the leader: a standby, or a leader that stepped down. Nothing was applied; the
    message names the leader when one is known. Retry (the clients' channels route to the leader)."""


class Fenced(NotLeader):
    """A write to Redis refused by the fencing token (kvserve/kvmanager/fencing.py): another kvmanager has claimed the
    prefix since this one did. Nothing was written; this kvmanager's state is stale, and it steps down."""


class StateLayoutError(RuntimeError):
    """The state under the Redis prefix is in a layout this kvmanager cannot read; nothing was loaded."""
