"""What the gateway core needs of the kvmanager and of a worker, as protocols over plain dataclasses. The gRPC
clients (rpc/clients.py) implement them for serving; tests implement them in-process. Every call is safe to
repeat: StepPages is idempotent per step_id, RegisterWorker per epoch, a Step writes the same K/V into the same
slots.

Failures are typed (errors.py): KVManagerUnavailable / KVManagerFailed, WorkerUnavailable / WorkerRestarted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.membership import WorkerMember
from kvserve.common.wire.pages import PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.common.wire.transfer import PullOrder, PullResult
from kvserve.common.wire.worker import StepBatch, StepOutput, WorkerInfo


class KVManagerBackend(Protocol):
    def register(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        """Registers a worker's pool. ``release_requests``: this gateway has just started, so every request the
        pool holds is an orphan of one that died, and is freed."""
        ...

    def step_pages(self, ops: StepOps, traceparents: Mapping[str, str] = NO_TRACES) -> StepResults:
        """One scheduler step's page ops, waited for while the kvmanager is briefly away (retried, same step_id)."""
        ...

    def place(self, tenant: str, token_ids: Sequence[int], num_queued: dict[str, int]) -> str:
        """The worker_id cache-aware placement chooses for a new request; one try, no waiting (a hint)."""
        ...

    def place_among(self, tenant: str, token_ids: Sequence[int], num_queued: dict[str, int],
                    worker_ids: Sequence[str], pull_peers: bool) -> tuple[str, int]:
        """As place, among ``worker_ids`` only, counting peer hits with ``pull_peers``: (worker_id, leading
        prompt tokens cached for it there, peer and store hits included)."""
        ...

    def list_workers(self) -> list[WorkerMember]:
        """The live members of the kvmanager's membership, by worker_id; one try, short timeout (a poll).
        Raises KVManagerUnavailable while it does not answer."""
        ...

    def leave_worker(self, worker_id: str, epoch: int) -> tuple[str, ...]:
        """A worker incarnation leaves the membership (the gateway declared it dead: its steps failed for
        --worker-timeout): its pool is dropped; the live req_ids dropped with it (empty when that epoch is not
        the current one). Retried as step_pages."""
        ...

    def interrupt(self) -> None:
        """From now on, calls fail instead of waiting or retrying (the gateway is stopping)."""
        ...

    def close(self) -> None: ...


class WorkerBackend(Protocol):
    address: str  # for logs

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        """The worker's Info, waiting up to wait_s for it to come up."""
        ...

    def step(self, batch: StepBatch, traceparents: Mapping[str, str] = NO_TRACES) -> StepOutput:
        """One step, sent again while the worker is briefly away. Raises WorkerRestarted when it answers as a new
        incarnation."""
        ...

    def pull(self, order: PullOrder) -> PullResult:
        """Has the worker pull a request's pages from another worker (PullPages). A failed pull is a result with
        its error, never an exception (the request recomputes)."""
        ...

    def interrupt(self) -> None:
        """From now on, steps fail instead of waiting; the step in flight, if any, is cancelled."""
        ...

    def close(self) -> None: ...
