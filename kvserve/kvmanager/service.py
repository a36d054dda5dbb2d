"""The kvmanager service core: the in-memory manager plus its persistence in a store, serialised by one lock.

Every call that changes state is made durable in the store (call_log.py: appended to the call log) before it is
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

from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.membership import HeartbeatResult, JoinResult, WorkerMember
from kvserve.common.wire.pages import PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.common.wire.tier import TierReport
from kvserve.kvmanager.errors import Fenced, NotLeader, StoreUnavailable
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.membership import DEFAULT_WORKER_TIMEOUT_S, DeadMember, Member, MemberTable, join, leave
from kvserve.kvmanager.placement import Placement
from kvserve.kvmanager.state import Changes


class Store(Protocol):
    """Persistence of the manager's state and the member table (call_log.py's CallLog, or NullStore)."""

    def send_early(self, record: tuple, now_ms: int = 0) -> bool:
        """Called with a validated step before it is applied (``now_ms``: the call's time, logged with it): True
        means the record is on its way and the next write() completes it (it is then called even if the call
        changed nothing)."""
        ...

    def write(self, mgr: KVManager, members: MemberTable, record: tuple, reset: bool = False) -> None:
        """Makes a call durable, atomically: ``record`` is the call itself (("step", StepOps), ("register",
        PoolSpec, release_requests), ("admin", name, args), ("join", PoolSpec, address), ("drain", worker_id,
        epoch, draining), ("leave", worker_id, epoch), ("tier", TierReport) or ("policy", CachePolicy)); ``reset``:
        the calls since the last write dropped everything (an admin reset), so the store writes the state whole.
        Raises on failure."""
        ...

    def load(self, mgr: KVManager, members: MemberTable) -> None:
        """Fills an empty manager and member table with the stored state (each member with a fresh lease)."""
        ...

    def abandon(self) -> None:
        """Forgets what was not written yet: the service stepped down."""
        ...

    def close(self) -> None:
        """A graceful stop: lets writes under way finish."""
        ...


class NullStore:
    """No persistence (tests of the domain, --no-persistence)."""

    def send_early(self, record: tuple, now_ms: int = 0) -> bool:
        return False

    def write(self, mgr: KVManager, members: MemberTable, record: tuple, reset: bool = False) -> None:
        pass

    def load(self, mgr: KVManager, members: MemberTable) -> None:
        pass

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


class KVService:
    """Thread-safe entry point used by the servicers. ``last_store_ms`` is the latest store write's time.

    Membership (the methods from join_worker on): workers hold leases of ``worker_timeout_s`` on ``clock``
    (membership.py); the store persists the member table with the manager (join, drain and leave records)."""

    def __init__(self, manager: KVManager | None = None, store: Store | None = None,
                 worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 make_manager: Callable[[], KVManager] = KVManager,
                 wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000):
        self.make_manager = make_manager  # an empty manager as configured (a take-over, a step down)
        self.wall_ms = wall_ms  # each mutating call's time (pins' TTLs, tenants' activity), logged with it
        self.manager = manager or make_manager()
        # The shared tier's values to delete (entries the calls removed), handed over once the call is durable
        # (tier_janitor.py); None: dropped (no store to delete from).
        self.on_tier_deleted: Callable[[list[bytes]], None] | None = None
        self.store = store or NullStore()
        self.lock = threading.Lock()
        self.store_ok = True
        self.last_store_ms = 0.0
        self.on_store_write: Callable[[float], None] | None = None  # seconds of each write (metrics)
        self.members = MemberTable(worker_timeout_s, clock)
        self.leading = True  # False: a standby, or a leader that stepped down; every call raises NotLeader
        self.not_leading_why = "not the leader"  # NotLeader's message (leader.py names the leader in it)
        self.on_fenced: Callable[[], None] | None = None  # called (under the lock) when a write was fenced

    def load(self) -> None:
        """Loads the state and the members, each with a fresh lease (a new leader must not declare dead the
        workers that could not heartbeat while it took over)."""
        with self.lock:
            configured = self.manager.fair.policy
            self.store.load(self.manager, self.members)
            self._hand_over_deleted(recovered=True)
            self._configure(configured)

    def take_over(self, manager: KVManager | None = None) -> None:
        """Becomes the leader: a fresh manager (or ``manager``, empty) filled from the store, which claims the
        prefix (its new fencing token) before it reads; then serves. Raises as Store.load (and stays a
        standby)."""
        manager = self.make_manager() if manager is None else manager
        members = MemberTable(self.members.lease_s, self.members.clock)
        with self.lock:
            configured = manager.fair.policy
            self.store.load(manager, members)
            self.manager, self.members = manager, members
            self.store_ok, self.leading = True, True
            self._hand_over_deleted(recovered=True)
            self._configure(configured)

    def _configure(self, policy) -> None:
        """After a load: the state was made under its stored policy (the log replayed under it); this process's
        configured one applies from here on, logged as a call so that a later replay switches at this point (and
        logged once in a state that records none yet: a log's first calls replay under it)."""
        if not self.manager.policy_logged or self.manager.fair.policy != policy:
            self.manager.set_policy(policy)
            self._persist(("policy", policy), force=True)

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
        self.manager = self.make_manager()
        self.members = MemberTable(self.members.lease_s, self.members.clock)
        self.store.abandon()

    def _check_leading(self) -> None:
        if not self.leading:
            raise NotLeader(self.not_leading_why)

    def register_worker(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        with self.lock:
            self._check_leading()
            self.manager.set_time(self.wall_ms())
            result = self.manager.register_worker(spec, release_requests)
            self._persist(("register", spec, release_requests))
            return result

    def step(self, ops: StepOps) -> StepResults:
        with self.lock:
            self._check_leading()
            self.manager.check(ops)  # bad input raises here: nothing applied, nothing logged
            self.manager.set_time(self.wall_ms())
            record = ("step", ops)
            # The call log can send this one before it is applied: Redis appends it while the manager works,
            # and the answer still waits for Redis's reply (in _persist).
            early = self.store.send_early(record, self.manager.now_ms)
            results = self.manager.apply_checked(ops)
            self._persist(record, force=early)
            return results

    def report_tier(self, report: TierReport) -> tuple[int, int]:
        """KVManager.report_tier, logged. Raises StoreUnavailable, NotLeader."""
        with self.lock:
            self._check_leading()
            self.manager.set_time(self.wall_ms())
            result = self.manager.report_tier(report)
            self._persist(("tier", report))
            return result

    def mutate(self, fn, *args):
        """Runs an admin mutation ``fn(manager, *args)`` under the lock, and persists it."""
        with self.lock:
            self._check_leading()
            return self._mutate_locked(fn, *args)

    def _mutate_locked(self, fn, *args):
        self.manager.set_time(self.wall_ms())
        result = fn(self.manager, *args)
        self._persist(("admin", fn.__name__, args))
        return result

    def read(self, fn, *args):
        """Runs a read-only query ``fn(manager, *args)`` under the lock."""
        with self.lock:
            self._check_leading()
            return fn(self.manager, *args)

    def place(self, tenant: str, token_ids: tuple[int, ...], num_queued: dict[str, int],
              only: tuple[str, ...] = (), pull_peers: bool = False) -> Placement:
        """KVManager.place over the pools of the workers that are not draining (of ``only``, when given). Raises
        as it does."""
        with self.lock:
            draining = frozenset(m.worker_id for m in self.members.sorted() if m.draining)
            return self.manager.place(tenant, token_ids, num_queued, draining, only, pull_peers)

    def _persist(self, record: tuple, force: bool = False) -> None:
        """Writes the call if it changed state; ``force``: also when it did not (a record sent early awaits its
        reply, or the member table changed). After a failed write ``manager.changes`` stays marked, so the next
        call writes (and with it what the store kept) even if that call changes nothing."""
        changes = self.manager.changes
        if changes.empty() and not force:
            return
        t0 = time.perf_counter()
        try:
            self.store.write(self.manager, self.members, record, reset=changes.reset)
        except Fenced as e:  # a deposed leader: its state is stale; never acknowledge, never serve again
            raise self.fenced(e) from e
        except Exception as e:  # any store failure: keep the change, answer UNAVAILABLE
            self.store_ok, changes.changed = False, True
            raise StoreUnavailable(f"the state store cannot be written ({type(e).__name__}: {e}); "
                                   f"retry the same call") from e
        self.manager.changes = Changes()
        self.store_ok = True
        self._hand_over_deleted()
        elapsed_s = time.perf_counter() - t0
        self.last_store_ms = elapsed_s * 1000
        if self.on_store_write is not None:
            self.on_store_write(elapsed_s)

    def _hand_over_deleted(self, recovered: bool = False) -> None:
        """The store's values whose entries durable calls removed go to the janitor. ``recovered``: after a
        load, the deletions its replay queued (some may have been done before the restart: deleting again is
        harmless), less the blocks recorded again since."""
        tier = self.manager.tier
        deleted = tier.take_deleted()
        if recovered:
            deleted = [h for h in deleted if h not in tier]
        if deleted and self.on_tier_deleted is not None:
            self.on_tier_deleted(deleted)

    # -- membership (membership.py) -------------------------------------------------------------------------
    def join_worker(self, spec: PoolSpec, address: str) -> JoinResult:
        """Registers the pool (register_worker's rules, release_requests false) and starts or renews the lease
        of (worker_id, epoch) at ``address``, logged as one "join" record. A new epoch replaces the pool and the
        member. Raises InvalidRequest (bad pool, empty address), StaleEpoch, StoreUnavailable."""
        if not address:
            raise InvalidRequest("address must not be empty: it is the host:port the gateway dials")
        with self.lock:
            self._check_leading()
            registered, changed = join(self.manager, self.members, spec, address)
            self._persist(("join", spec, address), force=changed)
            return JoinResult(registered, self.members.lease_ms)

    def heartbeat(self, worker_id: str, epoch: int, draining: bool = False) -> HeartbeatResult:
        """Renews the lease of (worker_id, epoch) and sets its draining flag (stored only when it changes).
        known=false when no lease is held for it; a lease that lapsed before this call is declared dead here
        (its pool dropped) and answered so too. Raises InvalidRequest, StoreUnavailable."""
        _check_member(worker_id, epoch)
        with self.lock:
            self._check_leading()
            member = self.members.get(worker_id, epoch)
            if member is not None and self._is_dead(member, self.members.clock()):
                self._drop(worker_id, epoch)
                member = None
            if member is None:
                return HeartbeatResult(False, 0, self.members.lease_ms)
            changed = self.members.renew(member, draining)  # else it writes only what a failed call left
            self._persist(("drain", worker_id, epoch, draining), force=changed)
            return HeartbeatResult(True, self.manager.pools[worker_id].num_requests, self.members.lease_ms)

    def leave_worker(self, worker_id: str, epoch: int) -> tuple[str, ...]:
        """(worker_id, epoch) leaves (LeaveWorker: the worker after draining, or the gateway for a worker it
        declared dead): forgets the member and its pool of this epoch (membership.leave, logged as a "leave"
        record); the live req_ids dropped with it. A no-op for an epoch neither holds (a retried call,
        or a worker that rejoined under a new epoch). Raises InvalidRequest, StoreUnavailable."""
        _check_member(worker_id, epoch)
        with self.lock:
            self._check_leading()
            return self._drop(worker_id, epoch)

    def list_workers(self) -> list[WorkerMember]:
        """The live members (lease held, pool of their epoch registered), by worker_id."""
        with self.lock:
            self._check_leading()
            now = self.members.clock()
            return [WorkerMember(m.worker_id, m.epoch, m.address, m.draining,
                                 self.manager.pools[m.worker_id].num_requests)
                    for m in self.members.sorted() if not self._is_dead(m, now)]

    def expire_members(self, now: float) -> list[DeadMember]:
        """Declares dead every member whose lease lapsed before ``now`` (on the member clock) or whose pool is
        gone (forgotten by an operator): drops its pool as leave_worker does. Returns them, by worker_id.
        Raises StoreUnavailable (the members dropped so far stay dropped, and are written later)."""
        with self.lock:
            if not self.leading:  # a standby's table is not the members'
                return []
            dead = []
            for m in self.members.sorted():
                if self._is_dead(m, now):
                    reason = "its lease lapsed" if self.members.lapsed(m, now) else "its pool is gone"
                    dropped = self._drop(m.worker_id, m.epoch)
                    dead.append(DeadMember(m.worker_id, m.epoch, m.address, dropped, reason))
            return dead

    def _pool_epoch(self, worker_id: str) -> int:
        pool = self.manager.pools.get(worker_id)
        return pool.spec.epoch if pool is not None else 0

    def _is_dead(self, member: Member, now: float) -> bool:
        return self.members.lapsed(member, now) or self._pool_epoch(member.worker_id) != member.epoch

    def _drop(self, worker_id: str, epoch: int) -> tuple[str, ...]:
        """Removes the member and forgets the pool, each if it is of this epoch, logged as one "leave" record.
        Under the lock."""
        dropped, changed = leave(self.manager, self.members, worker_id, epoch)
        self._persist(("leave", worker_id, epoch), force=changed)
        return dropped


def _check_member(worker_id: str, epoch: int) -> None:
    if not worker_id:
        raise InvalidRequest("worker_id must not be empty")
    if epoch <= 0:
        raise InvalidRequest(f"epoch must be > 0, got {epoch}")
