"""Wires the worker's gRPC server: its servicer on the shared plumbing (common/grpc_server.py)."""

from __future__ import annotations

from kvserve.common.grpc_server import GrpcServer, start_grpc_server
from kvserve.common.metrics import WorkerMetrics
from kvserve.common.tls import Tls
from kvserve.v1 import worker_pb2, worker_pb2_grpc
from kvserve.worker.runner import ModelRunner
from kvserve.worker.servicer import WorkerServicer

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def start_worker_server(runner: ModelRunner, host: str = "127.0.0.1", port: int = 0,
                        max_threads: int = 8, metrics: WorkerMetrics | None = None,
                        tls: Tls | None = None) -> GrpcServer:
    """Starts serving ``runner`` on host:port (0 = a free port), with ``tls`` if given (mutual with a CA);
    returns once the port is bound."""
    servicer = WorkerServicer(runner, metrics)
    return start_grpc_server(
        host, port, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s),
        (SERVICE_NAME,), max_threads=max_threads, tls=tls)
