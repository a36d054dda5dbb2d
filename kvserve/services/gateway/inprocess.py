"""The gateway core's backends (backends.py) in this process, with no gRPC: the real kvmanager domain and a real
ModelRunner, called directly. ``kvserve generate --local`` (llm.py) runs on them; the tests build their fakes
on the kvmanager one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvserve.common.errors import StaleEpoch
from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.pages import PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.common.wire.transfer import PullOrder, PullResult
from kvserve.common.wire.worker import StepBatch, StepOutput, WorkerInfo
from kvserve.kvmanager.manager import KVManager
from kvserve.services.gateway.errors import WorkerRestarted


class InProcessKVManager:
    """A KVManager of this process as the core's kvmanager: pages, prefix index and placement, no persistence."""

    def __init__(self, mgr: KVManager | None = None):
        self.mgr = mgr or KVManager()

    def register(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        return self.mgr.register_worker(spec, release_requests)

    def step_pages(self, ops: StepOps, traceparents: Mapping[str, str] = NO_TRACES) -> StepResults:
        return self.mgr.step(ops)

    def place(self, tenant: str, token_ids: Sequence[int], num_queued: dict[str, int]) -> str:
        return self.mgr.place(tenant, tuple(token_ids), num_queued).worker_id

    def place_among(self, tenant: str, token_ids: Sequence[int], num_queued: dict[str, int],
                    worker_ids: Sequence[str], pull_peers: bool) -> tuple[str, int]:
        placed = self.mgr.place(tenant, tuple(token_ids), num_queued, only=tuple(worker_ids), pull_peers=pull_peers)
        return placed.worker_id, placed.num_cached_tokens

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


class InProcessWorker:
    """A ModelRunner of this process as the core's worker (``runner``: anything with ``info`` and
    ``step(batch)``, as kvserve/worker/runner.py's)."""

    address = "in-process"

    def __init__(self, runner):
        self.runner = runner

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        return self.runner.info

    def step(self, batch: StepBatch, traceparents: Mapping[str, str] = NO_TRACES) -> StepOutput:
        try:
            return self.runner.step(batch)
        except StaleEpoch as e:
            raise WorkerRestarted(str(e)) from e

    def pull(self, order: PullOrder) -> PullResult:
        """An in-process worker has no peers to pull from: the request recomputes."""
        return PullResult(error="an in-process worker does not pull pages from other workers")

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass
