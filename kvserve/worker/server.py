"""Wires the worker's gRPC server: its servicer on the shared plumbing (kvserve/common/grpc_server.py), with the page
transfers' link to other workers (kvserve/worker/peer_client.py)."""

from __future__ import annotations

from kvserve.common.grpc_server import GrpcServer, start_grpc_server
from kvserve.common.metrics import WorkerMetrics
from kvserve.common.tls import Tls
from kvserve.v1 import worker_pb2, worker_pb2_grpc
from kvserve.worker.page_codec import value_size
from kvserve.worker.peer_client import GrpcPageReader
from kvserve.worker.runner import ModelRunner
from kvserve.worker.servicer import WorkerServicer
from kvserve.worker.transfer import PageReader, PeerTransfers

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
# Steps, Info, health watches, reads served to other workers and pulls (at most transfer.MAX_PULLS) share the
# threads. A pull holds its thread while it reads from a peer that may be pulling from this worker at the same
# time: with pulls bounded well below the threads, a read is never left waiting behind pulls.
MAX_THREADS = 32


def start_worker_server(runner: ModelRunner, host: str = "127.0.0.1", port: int = 0,
                        max_threads: int = MAX_THREADS, metrics: WorkerMetrics | None = None,
                        tls: Tls | None = None, reader: PageReader | None = None,
                        peer_server_name: str | None = None) -> GrpcServer:
    """Starts serving ``runner`` on host:port (0 = a free port), with ``tls`` if given (mutual with a CA);
    returns once the port is bound. Pulls read from other workers with ``reader`` (default: gRPC, with ``tls``'s
    files as the worker's client credentials, verifying peers against ``peer_server_name``, else their host)."""
    value_bytes = value_size(runner.kv_cache, runner.kv_scales)
    transfers = PeerTransfers(runner.kv_cache, runner.kv_scales, lambda: runner.epoch,
                              reader or GrpcPageReader(tls, value_bytes, peer_server_name),
                              written_on=runner.cuda.stream if runner.cuda is not None else None,
                              unavailable=runner.transfers_off)
    servicer = WorkerServicer(runner, metrics, transfers)
    return start_grpc_server(
        host, port, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s),
        (SERVICE_NAME,), max_threads=max_threads, tls=tls)
