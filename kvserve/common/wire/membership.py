"""Worker membership through the kvmanager, as plain data: what a worker's lease keeper reads back from its
JoinWorker and Heartbeat calls, and the live members the gateway follows (ListWorkers)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.common.wire.pages import RegisterResult


@dataclass(frozen=True, slots=True)
class WorkerMember:
    """One live member: where the gateway dials it, and whether it takes new requests."""

    worker_id: str
    epoch: int  # the epoch of its pool
    address: str  # host:port
    draining: bool  # it got SIGTERM: no new requests, its running ones finish
    num_requests: int  # live requests on its pool


@dataclass(frozen=True, slots=True)
class JoinResult:
    registered: RegisterResult  # the pool's registration, as RegisterWorker answers it
    lease_ms: int  # a member not heard from for this long is declared dead; heartbeat every lease_ms / 5


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    known: bool  # False: no lease for this (worker_id, epoch) any more; take a new epoch and join again
    num_requests: int  # live requests on the pool (0 when not known)
    lease_ms: int
