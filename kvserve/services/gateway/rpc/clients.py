"""The gateway's backends over gRPC (backends.py's protocols): dataclasses in, dataclasses out, and the typed
errors of errors.py out of a failed call, so that no status code reaches the core. The kvmanager call is
retried on UNAVAILABLE with the same step_id, which makes the retry idempotent."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import replace

import grpc

from kvserve.common.channels import kvmanager_channel
from kvserve.common.convert import membership as member_convert
from kvserve.common.convert import pages as kv_convert
from kvserve.common.convert import transfer as transfer_convert
from kvserve.common.convert import worker as worker_convert
from kvserve.common.grpc_server import CHANNEL_OPTIONS, REQ_ID_METADATA
from kvserve.common.telemetry import NO_TRACES
from kvserve.common.tls import Tls, open_channel
from kvserve.common.wire.membership import WorkerMember
from kvserve.common.wire.pages import PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.common.wire.transfer import PullOrder, PullResult
from kvserve.common.wire.worker import StepBatch, StepOutput, WorkerInfo
from kvserve.services.gateway.errors import (
    KVManagerFailed,
    KVManagerUnavailable,
    WorkerRejected,
    WorkerRestarted,
    WorkerUnavailable,
)
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvserve.gateway")
MAX_BACKOFF_S = 2.0
RETRY_STEP = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # the worker went away mid-step
# A step that ended with one of these reached no answer from the worker (gone, or no answer in time): the worker
# may be lost. Any other status is the worker's own answer (it is alive), a rejection of that step.
STEP_UNANSWERED = (*RETRY_STEP, grpc.StatusCode.DEADLINE_EXCEEDED)
KV_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # Redis down; kvmanager restarting
LIST_WORKERS_TIMEOUT_S = 2.0  # a poll of the membership: the next poll comes soon, so never wait long


def call_with_retries(call, *, retry_on, retry_for_s: float, first_backoff_s: float, stopping: threading.Event,
                      on_retry, max_backoff_s: float = MAX_BACKOFF_S):
    """``call()``, again while it fails with a status in ``retry_on`` and the next try starts within
    retry_for_s of the first failure, waiting first_backoff_s (doubling, at most max_backoff_s) between tries;
    never once ``stopping`` is set. ``on_retry(error, backoff_s)`` says why before each wait."""
    deadline, backoff_s = None, first_backoff_s
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if deadline is None:
                deadline = time.monotonic() + retry_for_s
            if e.code() not in retry_on or time.monotonic() + backoff_s > deadline or stopping.is_set():
                raise
            on_retry(e, backoff_s)
            if stopping.wait(backoff_s):
                raise
            backoff_s = min(backoff_s * 2, max_backoff_s)


class _ServiceClient:
    """A channel to one service, a stub on it, and the retry settings of its calls."""

    def __init__(self, address: str, stub_type, timeout_s: float, retry_for_s: float, channel: grpc.Channel):
        self.address = address
        self.channel = channel
        self.stub = stub_type(self.channel)
        self.timeout_s, self.retry_for_s = timeout_s, retry_for_s
        self.stopping = threading.Event()  # set by interrupt()

    def interrupt(self) -> None:
        """From now on, a call fails instead of waiting for the service or retrying."""
        self.stopping.set()

    def close(self) -> None:
        self.channel.close()


def _reason(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


class KVManagerClient(_ServiceClient):
    """Retries UNAVAILABLE (Redis briefly down, a leader stepping down) and DEADLINE_EXCEEDED (a call that waited
    timeout_s for a restarting kvmanager, or for a standby to take over) with capped backoff, for up to
    retry_for_s. Every call is safe to repeat: StepPages is idempotent per step_id (a new leader answers a call
    its predecessor logged from the log) and RegisterWorker per epoch. Place is tried once (see place).
    ``address``: a --kvmanager value, one address or a list (kvserve/common/channels.py finds the leader); ``tls``: dial
    it with TLS (kvserve/common/tls.py), else plaintext."""

    def __init__(self, address: str, timeout_s: float = 10.0, retry_for_s: float = 60.0,
                 place_timeout_s: float = 2.0, tls: Tls | None = None):
        super().__init__(address, kvmanager_pb2_grpc.KVManagerServiceStub, timeout_s, retry_for_s,
                         channel=kvmanager_channel(address, tls=tls))
        self.place_timeout_s = place_timeout_s

    def register(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        """``release_requests``: this gateway has just started, so any request held on the worker is an orphan
        of one that died; the kvmanager frees them (PoolSpec.release_requests)."""
        return self._call(self.stub.RegisterWorker, kv_convert.spec_to_proto(spec, release_requests),
                          kv_convert.register_from_proto)

    def step_pages(self, ops: StepOps, traceparents: Mapping[str, str] = NO_TRACES) -> StepResults:
        return self._call(self.stub.StepPages, kv_convert.step_to_request_proto(ops, traceparents),
                          kv_convert.step_results_from_proto)

    def place(self, tenant: str, token_ids: list[int], num_queued: dict[str, int]) -> str:
        """The worker_id cache-aware placement chooses for a new request (no side effect). One try, within
        place_timeout_s and without waiting for a kvmanager that is down: placement is a hint the caller can do
        without, and it is asked while new requests queue behind it."""
        try:
            reply = self.stub.Place(kv_convert.place_to_proto(tenant, token_ids, num_queued),
                                    timeout=self.place_timeout_s, wait_for_ready=False)
        except grpc.RpcError as e:
            raise self._failure("placement", e) from e
        return reply.worker_id

    def place_among(self, tenant: str, token_ids: list[int], num_queued: dict[str, int], worker_ids,
                    pull_peers: bool) -> tuple[str, int]:
        """As place, among ``worker_ids``, counting peer hits with ``pull_peers``: (worker_id, cached tokens)."""
        try:
            reply = self.stub.Place(kv_convert.place_to_proto(tenant, token_ids, num_queued, tuple(worker_ids),
                                                              pull_peers),
                                    timeout=self.place_timeout_s, wait_for_ready=False)
        except grpc.RpcError as e:
            raise self._failure("placement", e) from e
        return reply.worker_id, reply.num_cached_tokens

    def list_workers(self) -> list[WorkerMember]:
        """The kvmanager's live members (ListWorkers), by worker_id. One try within LIST_WORKERS_TIMEOUT_S, no
        waiting for a kvmanager that is down (the caller polls again): raises KVManagerUnavailable then."""
        try:
            reply = self.stub.ListWorkers(kvmanager_pb2.ListWorkersRequest(), timeout=LIST_WORKERS_TIMEOUT_S,
                                          wait_for_ready=False)
        except grpc.RpcError as e:
            raise self._failure("membership poll", e) from e
        return member_convert.workers_from_proto(reply)

    def leave_worker(self, worker_id: str, epoch: int) -> tuple[str, ...]:
        """(worker_id, epoch) leaves the membership (LeaveWorker), for a worker this gateway declared dead: its
        pool and member are dropped; the live req_ids dropped with it. A no-op when that epoch is not the
        worker's current one. Retried as step_pages (the call is idempotent)."""
        request = kvmanager_pb2.LeaveWorkerRequest(worker_id=worker_id, epoch=epoch)
        return self._call(self.stub.LeaveWorker, request, lambda r: tuple(r.dropped_req_ids))

    def _call(self, method, request, convert):
        def on_retry(e, backoff_s):
            log.warning("kvmanager unavailable (%s: %s); retrying in %.2fs", e.code().name, e.details(), backoff_s)

        # While serving, a call waits for a kvmanager that is restarting; once stopping, it fails at once.
        try:
            reply = call_with_retries(lambda: method(request, timeout=self.timeout_s,
                                                     wait_for_ready=not self.stopping.is_set()),
                                      retry_on=KV_RETRY, retry_for_s=self.retry_for_s,
                                      first_backoff_s=0.05, stopping=self.stopping, on_retry=on_retry)
        except grpc.RpcError as e:
            raise self._failure("call", e) from e
        return convert(reply)

    def _failure(self, what: str, e: grpc.RpcError) -> KVManagerFailed:
        """A refusal names the one request it is about, when it is about one (kvserve/common/grpc_server.abort)."""
        if e.code() in KV_RETRY:
            return KVManagerUnavailable(f"kvmanager {what} failed: {_reason(e)}")
        req_id = dict(e.trailing_metadata() or ()).get(REQ_ID_METADATA)
        return KVManagerFailed(f"kvmanager {what} failed: {_reason(e)}", req_id=req_id)


def _without_server_name(tls: Tls | None) -> Tls | None:
    """The gateway's TLS settings for a worker: --tls-server-name names the kvmanager, each worker is verified
    against its own address's host."""
    return tls if tls is None or tls.server_name is None else replace(tls, server_name=None)


# A worker that went away is dialled again every 0.1-0.5 s (gRPC's default backoff grows to 120 s): a restarted
# worker is noticed within the worker timeout, and a lost one is declared dead after it.
WORKER_CHANNEL_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100),
                          ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500))
STEP_RETRY_BACKOFF_S = (0.02, 0.5)  # first and longest wait between the tries of an unanswered step


class WorkerClient(_ServiceClient):
    """A worker's Step and Info. A Step the worker did not answer (it stopped or restarted) is sent again, for up
    to retry_for_s (the gateway's worker timeout) after the first failure: a step is idempotent (same K/V into
    the same slots), and a restarted worker answers FAILED_PRECONDITION (new epoch), which the engine turns into
    re-registration and recompute. After retry_for_s the step fails with WorkerUnavailable: the gateway
    declares the worker dead and hands its requests over. A try fails at once while the worker is unreachable
    (no wait_for_ready), so that the worker timeout bounds the wait, whatever the step's own deadline.
    ``tls``: dial it with TLS (its certificate is verified against the host of ``address``), else plaintext."""

    def __init__(self, address: str, timeout_s: float = 120.0, retry_for_s: float = 5.0, tls: Tls | None = None):
        super().__init__(address, worker_pb2_grpc.WorkerServiceStub, timeout_s, retry_for_s,
                         open_channel(address, _without_server_name(tls), options=WORKER_CHANNEL_OPTIONS))
        self._lock = threading.Lock()
        self._step_call: grpc.Future | None = None  # the Step in flight

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        """The worker's Info, waiting up to wait_s for it to come up."""
        try:
            reply = self.stub.Info(worker_pb2.InfoRequest(), timeout=wait_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise WorkerUnavailable(f"worker {self.address} did not describe itself: {_reason(e)}") from e
        return worker_convert.info_from_proto(reply)

    def step(self, batch: StepBatch, traceparents: Mapping[str, str] = NO_TRACES) -> StepOutput:
        """Raises WorkerRestarted (a new epoch), WorkerUnavailable (no answer: gone, or none in time, also after
        retries) or WorkerRejected (the worker refused the step as a whole; it is alive)."""
        try:
            request = worker_convert.batch_to_proto(batch, traceparents)
        except (ValueError, TypeError) as e:  # a value the wire cannot carry: a bug, this step's alone
            raise WorkerRejected(f"the step to worker {self.address} cannot be encoded: {e}") from e
        warned: list[bool] = []

        def on_retry(e, _backoff_s):
            if not warned:
                log.warning("worker %s did not answer a step (%s); sending it again for up to %g s", self.address,
                            e.code().name, self.retry_for_s)
                warned.append(True)

        first, longest = STEP_RETRY_BACKOFF_S
        try:
            reply = call_with_retries(lambda: self._step_once(request), retry_on=RETRY_STEP,
                                      retry_for_s=self.retry_for_s, first_backoff_s=first, stopping=self.stopping,
                                      on_retry=on_retry, max_backoff_s=longest)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # a new epoch: the worker restarted
                raise WorkerRestarted(f"worker {self.address} restarted: {e.details()}") from e
            if e.code() in STEP_UNANSWERED:
                raise WorkerUnavailable(f"worker {self.address} step failed: {_reason(e)}") from e
            raise WorkerRejected(f"worker {self.address} refused the step: {_reason(e)}") from e
        return worker_convert.output_from_proto(reply)

    def pull(self, order: PullOrder) -> PullResult:
        """PullPages: the worker pulls a request's pages from another worker, within the order's lease. A pull the
        worker could not make, or that did not answer in time, is a result with its error (never raised): the
        request recomputes."""
        timeout_s = max(1.0, (order.lease_expires_ms - time.time() * 1000) / 1000)
        try:
            reply = self.stub.PullPages(transfer_convert.pull_order_to_proto(order), timeout=timeout_s,
                                        wait_for_ready=False)
        except grpc.RpcError as e:
            return PullResult(error=f"worker {self.address} did not pull: {_reason(e)}")
        return transfer_convert.pull_result_from_proto(reply)

    def _step_once(self, request: worker_pb2.StepBatch) -> worker_pb2.StepOutput:
        """One try of a Step, which ends CANCELLED once interrupt() is called: a try
        waiting for a worker that is gone would otherwise hold the gateway's stop for timeout_s."""
        call = self.stub.Step.future(request, timeout=self.timeout_s, wait_for_ready=False)
        with self._lock:
            self._step_call = call
        if self.stopping.is_set():
            call.cancel()
        try:
            return call.result()
        except grpc.FutureCancelledError:
            raise call from None  # the call is an RpcError too: CANCELLED
        finally:
            with self._lock:
                self._step_call = None

    def interrupt(self) -> None:
        """Steps fail instead of waiting from now on, and the Step in flight, if any, is cancelled."""
        self.stopping.set()
        with self._lock:
            call = self._step_call
        if call is not None:
            call.cancel()
