"""Step ids for tests that call a kvmanager themselves. Every step call carries one, >= 1 and increasing per
caller, as the gateway's scheduler sends them (counted from 1). A test that means "a new call" takes its caller's
next id; a test whose meaning depends on the id (a retry sends the same one, a stale call an older one) writes
it out, and the ids taken after it are newer still."""

from __future__ import annotations

import weakref

_last: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def next_step_id(caller: object) -> int:
    """An id newer than every id ``caller`` (a KVManager, a KVService, a client) took or was given here: a new
    call, never a retry nor a stale one."""
    step_id = _last.get(caller, 0) + 1
    _last[caller] = step_id
    return step_id


def step_id_for(caller: object, step_id: int | None = None) -> int:
    """``step_id`` as given (noted, so that the next id taken is newer), or the caller's next id when None."""
    if step_id is None:
        return next_step_id(caller)
    _last[caller] = max(_last.get(caller, 0), step_id)
    return step_id
