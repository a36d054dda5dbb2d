"""The member table: which workers are alive, where they are reached, and until when their lease holds.

A worker started with ``--kvmanager`` joins (JoinWorker) and renews its lease with heartbeats. A member not
heard from for ``lease_s`` is declared dead by whoever looks next (the reaper's expire_members, or the member's
own late heartbeat). This module only keeps the table; what joining and dying do to the pools (register,
forget) is KVService's (service.py), under its lock.

Lease deadlines are times of an injectable monotonic clock, so that tests move time by hand. They are not
persisted: the call log (call_log.py) keeps each member's record (join, drain and leave records; the snapshot
holds the table), and a table loaded at start gives every member a fresh lease, so a kvmanager that takes over
does not declare the whole fleet dead, and forgets the members that do not heartbeat within it.

Not thread-safe: KVService holds its lock around every call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.common.wire.pages import PoolSpec, RegisterResult
    from kvserve.kvmanager.manager import KVManager

DEFAULT_WORKER_TIMEOUT_S = 5.0
MemberRecord = tuple[str, int, str, bool]  # worker_id, epoch, address, draining: what the call log keeps


@dataclass(slots=True)
class Member:
    """One worker incarnation holding a lease."""

    worker_id: str
    epoch: int
    address: str  # host:port the gateway dials
    draining: bool = False
    deadline_s: float = 0.0  # on the table's clock; past it the lease has lapsed

    def record(self) -> tuple[int, str, bool]:
        """What is persisted of it (the call log): everything but the deadline."""
        return self.epoch, self.address, self.draining


@dataclass(frozen=True, slots=True)
class DeadMember:
    """A member the kvmanager declared dead (KVService.expire_members), for the reaper's log."""

    worker_id: str
    epoch: int
    address: str
    dropped_req_ids: tuple[str, ...]  # live requests dropped with its pool
    reason: str  # "its lease lapsed", "its pool is gone"


class MemberTable:
    """worker_id -> Member. ``clock`` is a monotonic clock in seconds (time.monotonic by default)."""

    def __init__(self, lease_s: float = DEFAULT_WORKER_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        if not lease_s > 0:
            raise ValueError(f"the worker lease must be positive, got {lease_s}")
        self.lease_s = lease_s
        self.clock = clock
        self.members: dict[str, Member] = {}

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)

    def get(self, worker_id: str, epoch: int) -> Member | None:
        """The member holding this (worker_id, epoch), lapsed or not; None for another epoch or none."""
        member = self.members.get(worker_id)
        return member if member is not None and member.epoch == epoch else None

    def join(self, worker_id: str, epoch: int, address: str) -> bool:
        """Starts (or renews) the lease of (worker_id, epoch) at ``address``; another epoch under the same
        worker_id is replaced, draining flag and all. Returns whether the persisted record changed."""
        old = self.members.get(worker_id)
        draining = old.draining if old is not None and old.epoch == epoch else False
        member = Member(worker_id, epoch, address, draining, self.clock() + self.lease_s)
        self.members[worker_id] = member
        return old is None or old.record() != member.record()

    def lapsed(self, member: Member, now: float) -> bool:
        return now > member.deadline_s

    def renew(self, member: Member, draining: bool) -> bool:
        """A heartbeat: the lease runs lease_s from now. Returns whether the draining flag changed."""
        member.deadline_s = self.clock() + self.lease_s
        changed = member.draining != draining
        member.draining = draining
        return changed

    def remove(self, worker_id: str) -> Member | None:
        return self.members.pop(worker_id, None)

    def expired(self, now: float) -> list[Member]:
        """The members whose lease lapsed before ``now``, by worker_id."""
        return [m for _, m in sorted(self.members.items()) if self.lapsed(m, now)]

    def sorted(self) -> list[Member]:
        return [m for _, m in sorted(self.members.items())]

    def records(self) -> list[MemberRecord]:
        return [(m.worker_id, *m.record()) for m in self.sorted()]

    def load(self, records: Iterable[MemberRecord]) -> None:
        """Replaces the table with persisted members (worker_id, epoch, address, draining), each with a fresh
        lease from now."""
        deadline = self.clock() + self.lease_s
        self.members = {w: Member(w, epoch, address, draining, deadline) for w, epoch, address, draining in records}


# What joining, draining and leaving do, run by KVService for a call and by the call log's replay of its record.
def join(mgr: KVManager, members: MemberTable, spec: PoolSpec, address: str) -> tuple[RegisterResult, bool]:
    """Registers the pool (register_worker's rules, release_requests false) and starts or renews the lease of
    (worker_id, epoch) at ``address``; with whether the member's record changed."""
    registered = mgr.register_worker(spec, False)
    return registered, members.join(spec.worker_id, spec.epoch, address)


def set_draining(members: MemberTable, worker_id: str, epoch: int, draining: bool) -> None:
    member = members.get(worker_id, epoch)
    if member is not None:
        member.draining = draining


def leave(mgr: KVManager, members: MemberTable, worker_id: str, epoch: int) -> tuple[tuple[str, ...], bool]:
    """Removes the member and forgets the pool (with every request on it), each if it is of this epoch; the
    live req_ids dropped, and whether anything changed."""
    changed = members.get(worker_id, epoch) is not None
    if changed:
        members.remove(worker_id)
    pool = mgr.pools.get(worker_id)
    if pool is None or pool.spec.epoch != epoch:
        return (), changed
    return mgr.forget_pool(worker_id), True
