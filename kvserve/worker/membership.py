"""A worker's membership in the kvmanager (``kvserve worker --kvmanager ADDRS``): the lease keeper, and the
serve-then-drain life of a member process.

    start ──JoinWorker (retried with backoff until the kvmanager answers)──▶ member, lease_ms
      │ every lease_ms / 5: Heartbeat ── known=false (its lease lapsed, it was declared dead, the kvmanager
      │                                  restarted without state) ──▶ a new epoch (ModelRunner.renew_epoch),
      │                                                                JoinWorker again
    SIGTERM ──Heartbeat(draining) at once; steps are still served──▶ num_requests == 0 on two consecutive
             heartbeats at least MIN_DRAIN_S after draining began (the gateway's poll has seen it), or
             --drain-timeout ──▶ LeaveWorker ──▶ the server stops, exit 0

Server wiring, like server.py: it talks gRPC to the kvmanager (kvserve.common.channels.kvmanager_channel).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvserve.common.channels import kvmanager_channel
from kvserve.common.convert import membership as cv
from kvserve.common.convert.tier import tier_report_to_proto
from kvserve.common.grpc_server import GrpcServer
from kvserve.common.tls import Tls
from kvserve.common.wire.membership import HeartbeatResult
from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.tier import TierReport
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc
from kvserve.worker.runner import ModelRunner

log = logging.getLogger("kvserve.worker")
BEATS_PER_LEASE = 5
MIN_DRAIN_S = 1.0  # a draining worker leaves no sooner: the gateway needs a membership poll to notice
ZERO_BEATS_TO_LEAVE = 2
JOIN_TIMEOUT_S = 5.0
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
REPORT_TIER_TIMEOUT_S = 5.0


class LeaseKeeper:
    """Joins the kvmanager's membership as ``runner``'s incarnation at ``address`` and keeps the lease, on a
    thread of its own (start), until drain() or close(). ``failed`` holds why it gave up (the kvmanager refused
    the pool as malformed), else None; ``on_failed`` is called then (the CLI stops the worker). ``tls``: the
    kvmanager is dialled with TLS (the worker's certificate as its client certificate), else plaintext."""

    def __init__(self, runner: ModelRunner, kvmanager: str, address: str, clock=time.monotonic,
                 on_failed: Callable[[], None] | None = None, tls: Tls | None = None):
        self.runner = runner
        self.on_failed = on_failed
        self.address = address
        self.clock = clock
        self.channel = kvmanager_channel(kvmanager, tls=tls)
        self.stub = kvmanager_pb2_grpc.KVManagerServiceStub(self.channel)
        self.lease_ms = 0  # 0 until joined
        self.joined = threading.Event()
        self.failed: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-lease", daemon=True)

    @property
    def interval_s(self) -> float:
        return self.lease_ms / 1000 / BEATS_PER_LEASE

    @property
    def rpc_timeout_s(self) -> float:
        """A heartbeat's deadline: well within the lease, so that a hung call is retried in time."""
        return max(0.2, min(2.0, self.lease_ms / 1000 / 2))

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    # -- keeping the lease ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._join():
            self._keep()

    def _join(self) -> bool:
        """JoinWorker as the runner's current epoch, until it answers; False when stopping or refused."""
        backoff_s = FIRST_BACKOFF_S
        while not self._stopping.is_set():
            info = self.runner.info
            try:
                reply = self.stub.JoinWorker(cv.join_to_request_proto(PoolSpec.of(info), self.address),
                                             timeout=JOIN_TIMEOUT_S)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self.failed = f"the kvmanager refused to let worker {info.worker_id} join: {e.details()}"
                    log.error("%s", self.failed)
                    if self.on_failed is not None:
                        self.on_failed()
                    return False
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # an epoch the kvmanager considers stale
                    log.warning("worker %s: join refused (%s); joining as a new epoch", info.worker_id, e.details())
                    self.runner.renew_epoch()
                else:
                    log.warning("worker %s: kvmanager not reachable to join (%s: %s); retrying in %.1fs",
                                info.worker_id, e.code().name, e.details(), backoff_s)
                self._stopping.wait(backoff_s)
                backoff_s = min(2 * backoff_s, MAX_BACKOFF_S)
                continue
            self.lease_ms = cv.join_result_from_proto(reply).lease_ms
            self.joined.set()
            log.info("worker %s joined the kvmanager as epoch %d at %s (lease %d ms)", info.worker_id, info.epoch,
                     self.address, self.lease_ms)
            return True
        return False

    def _keep(self) -> None:
        """Heartbeats until stopping, or until the kvmanager no longer knows this epoch (which takes a new
        one: the caller joins again)."""
        failing = False
        while not self._stopping.wait(self.interval_s):
            try:
                beat = self.heartbeat(draining=False)
            except grpc.RpcError as e:
                if not failing:
                    log.warning("worker %s: heartbeat failed (%s: %s); retrying", self.runner.info.worker_id,
                                e.code().name, e.details())
                failing = True
                continue
            failing = False
            if not beat.known:
                old = self.runner.epoch
                self.joined.clear()
                log.warning("worker %s: the kvmanager no longer holds epoch %d's lease (it lapsed or the "
                            "worker was declared dead); rejoining as epoch %d", self.runner.info.worker_id, old,
                            self.runner.renew_epoch())
                return

    def heartbeat(self, draining: bool) -> HeartbeatResult:
        """One Heartbeat of the current epoch; raises grpc.RpcError."""
        info = self.runner.info
        reply = self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=info.worker_id, epoch=info.epoch,
                                                        draining=draining), timeout=self.rpc_timeout_s)
        result = cv.heartbeat_result_from_proto(reply)
        if result.lease_ms:
            self.lease_ms = result.lease_ms
        return result

    def report_tier(self, report: TierReport) -> None:
        """ReportTier: the shared KV tier's traffic since the last report (the worker's KVTier calls it from
        its reporter thread, and retries). Raises grpc.RpcError."""
        self.stub.ReportTier(tier_report_to_proto(report), timeout=REPORT_TIER_TIMEOUT_S)

    # -- draining and leaving -------------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Stops keeping the lease in the background and drains in the caller: heartbeats with draining set
        (the first at once) until the kvmanager reports no live request on this pool on ZERO_BEATS_TO_LEAVE
        consecutive heartbeats at least MIN_DRAIN_S after this call, or ``timeout_s`` passes; then leaves.
        The worker's server keeps serving steps all along. Returns at once when it never joined."""
        self._stop_thread()
        if not self.joined.is_set():
            return
        started = self.clock()
        deadline, zeros = started + timeout_s, 0
        worker_id = self.runner.info.worker_id
        log.info("worker %s draining (up to %.1fs)", worker_id, timeout_s)
        while True:
            try:
                beat = self.heartbeat(draining=True)
            except grpc.RpcError as e:
                log.warning("worker %s: draining heartbeat failed (%s)", worker_id, e.code().name)
                zeros = 0
            else:
                if not beat.known:  # declared dead meanwhile: there is nothing left to leave
                    log.warning("worker %s: the kvmanager dropped this epoch while it drained", worker_id)
                    return
                zeros = zeros + 1 if beat.num_requests == 0 and self.clock() >= started + MIN_DRAIN_S else 0
                if zeros >= ZERO_BEATS_TO_LEAVE:
                    break
            if self.clock() >= deadline:
                log.warning("worker %s: --drain-timeout passed with requests still on its pool; leaving",
                            worker_id)
                break
            time.sleep(min(self.interval_s, max(0.0, deadline - self.clock())))  # the heartbeat period
        self.leave()

    def leave(self) -> tuple[str, ...]:
        """LeaveWorker for the current epoch (one try: a lease that is not renewed lapses anyway)."""
        info = self.runner.info
        try:
            reply = self.stub.LeaveWorker(pb.LeaveWorkerRequest(worker_id=info.worker_id, epoch=info.epoch),
                                          timeout=JOIN_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("worker %s: could not leave (%s: %s); its lease will lapse", info.worker_id,
                        e.code().name, e.details())
            return ()
        self.joined.clear()
        log.info("worker %s epoch %d left the kvmanager", info.worker_id, info.epoch)
        return tuple(reply.dropped_req_ids)

    def _stop_thread(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        self._stop_thread()
        self.channel.close()


def serve_as_member(server: GrpcServer, keeper: LeaseKeeper, stop: threading.Event, drain_timeout_s: float,
                    grace_s: float = 5.0, on_stopped: Callable[[], None] | None = None) -> None:
    """Blocks until ``stop`` is set (SIGTERM, or the keeper gave up), drains the worker and leaves, then stops
    the server gracefully. ``on_stopped`` runs once the server stopped, before the kvmanager's channel closes
    (the KV tier's last writes and report)."""
    stop.wait()
    keeper.drain(drain_timeout_s)
    log.info("worker stopping (grace %.1fs)", grace_s)
    server.stop(grace_s)
    if on_stopped is not None:
        on_stopped()
    keeper.close()
