"""The kvmanager service core: the in-memory manager plus its persistence in a store, serialised by one lock.

Every call that changes state is made durable in the store (oplog.py: appended to the call log) before it is
answered. If that write fails, the change stays in memory, the store keeps what it could not write, and the
call raises StoreUnavailable (UNAVAILABLE): the caller retries with the same step_id and gets the remembered
answer once the store is back. So an answer the caller sees is always durable, a page is never handed to two
holders (memory is the single source of truth while the process lives), and a restarted kvmanager only ever
reloads state that was written, never a block that was not committed.

Leadership (leader.py): with a standby, one KVService per kvmanager process is ``leading`` at a time. A standby's
service refuses every call with NotLeader (UNAVAILABLE); take_over() loads the state from the store and serves.
A write the store refuses by the fencing token (Fenced: another kvmanager claimed the prefix since) is never
acknowledged: the service stops leading at once, before its lock is released, so no later call is answered
from its stale state, and on_fenced tells the election loop to step down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvserve.common.wire.pages import PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.kvmanager.errors import Fenced, NotLeader, StoreUnavailable
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.state import Changes


class Store(Protocol):
    """Persistence of the manager's state (oplog.py's LoggedStore, or NullStore)."""

    def write(self, mgr: KVManager, record: tuple, reset: bool = False) -> None:
        """Makes a call durable, atomically: ``record`` is the call itself (("step", StepOps), ("register",
        PoolSpec, release_requests) or ("admin", name, args)); ``reset``: the calls since the last write
        dropped everything (an admin reset), so the store writes ``mgr``'s state whole. Raises on failure.

        A store may also have ``send_early(record) -> bool``: called with a validated step before it is applied;
        True means the record is on its way and the next write() completes it (it is then called even if the
        call changed nothing)."""
        ...

    def load(self, mgr: KVManager) -> None:
        """Fills an empty manager with the stored state."""
        ...


class NullStore:
    """No persistence (tests of the domain, --no-persistence)."""

    def write(self, mgr: KVManager, record: tuple, reset: bool = False) -> None:
        pass

    def load(self, mgr: KVManager) -> None:
        pass


class KVService:
    """Thread-safe entry point used by the servicers. ``last_store_ms`` is the latest store write's time."""

    def __init__(self, manager: KVManager | None = None, store: Store | None = None):
        self.manager = manager or KVManager()
        self.store = store or NullStore()
        self.lock = threading.Lock()
        self.store_ok = True
        self.last_store_ms = 0.0
        self.on_store_write: Callable[[float], None] | None = None  # seconds of each write (metrics)
        self.leading = True  # False: a standby, or a leader that stepped down; every call raises NotLeader
        self.not_leading_why = "not the leader"  # NotLeader's message (leader.py names the leader in it)
        self.on_fenced: Callable[[], None] | None = None  # called (under the lock) when a write was fenced

    def load(self) -> None:
        with self.lock:
            self.store.load(self.manager)

    def take_over(self, manager: KVManager | None = None) -> None:
        """Becomes the leader: a fresh manager (or ``manager``, empty) filled from the store, which claims the
        prefix (its new fencing token) before it reads; then serves. Raises as Store.load (and stays a
        standby)."""
        manager = KVManager() if manager is None else manager
        with self.lock:
            self.store.load(manager)
            self.manager, self.store_ok, self.leading = manager, True, True

    def step_down(self, why: str) -> None:
        """Stops leading: calls raise NotLeader(why) from now on (a call running now finishes first), and the
        state, stale from now on, is dropped."""
        self.leading, self.not_leading_why = False, why
        with self.lock:
            self._drop_state()

    def fenced(self, error: Fenced) -> NotLeader:
        """For a write that ``error`` refused, under the lock (any fenced write the service makes, the call log's
        or another's): stops leading at once, drops the stale state, tells the election loop; returns the
        NotLeader to raise instead of answering."""
        self.leading, self.not_leading_why = False, f"not the leader any more: {error}"
        self._drop_state()
        if self.on_fenced is not None:
            self.on_fenced()
        return NotLeader(self.not_leading_why)

    def _drop_state(self) -> None:
        self.manager = KVManager()
        abandon = getattr(self.store, "abandon", None)
        if abandon is not None:
            abandon()

    def _check_leading(self) -> None:
        if not self.leading:
            raise NotLeader(self.not_leading_why)

    def register_worker(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        with self.lock:
            self._check_leading()
            result = self.manager.register_worker(spec, release_requests)
            self._persist(("register", spec, release_requests))
            return result

    def step(self, ops: StepOps) -> StepResults:
        with self.lock:
            self._check_leading()
            self.manager.check(ops)  # bad input raises here: nothing applied, nothing logged
            record = ("step", ops)
            send_early = getattr(self.store, "send_early", None)
            # The call log can send this one before it is applied: Redis appends it while the manager works,
            # and the answer still waits for Redis's reply (in _persist).
            early = send_early(record) if send_early is not None else False
            results = self.manager.apply_checked(ops)
            self._persist(record, force=early)
            return results

    def mutate(self, fn, *args):
        """Runs an admin mutation ``fn(manager, *args)`` under the lock, and persists it."""
        with self.lock:
            self._check_leading()
            result = fn(self.manager, *args)
            self._persist(("admin", fn.__name__, args))
            return result

    def read(self, fn, *args):
        """Runs a read-only query ``fn(manager, *args)`` under the lock."""
        with self.lock:
            self._check_leading()
            return fn(self.manager, *args)

    def _persist(self, record: tuple, force: bool = False) -> None:
        """Writes the call if it changed state; ``force``: also when it did not (a record sent early awaits its
        reply). After a failed write ``manager.changes`` stays marked, so the next call writes (and with it what
        the store kept) even if that call changes nothing."""
        changes = self.manager.changes
        if changes.empty() and not force:
            return
        t0 = time.perf_counter()
        try:
            self.store.write(self.manager, record, reset=changes.reset)
        except Fenced as e:  # a deposed leader: its state is stale; never acknowledge, never serve again
            raise self.fenced(e) from e
        except Exception as e:  # any store failure: keep the change, answer UNAVAILABLE
            self.store_ok = False
            raise StoreUnavailable(f"the state store cannot be written ({type(e).__name__}: {e}); "
                                   f"retry the same call") from e
        self.manager.changes = Changes()
        self.store_ok = True
        elapsed_s = time.perf_counter() - t0
        self.last_store_ms = elapsed_s * 1000
        if self.on_store_write is not None:
            self.on_store_write(elapsed_s)
