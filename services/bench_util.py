"""Helpers shared by the benchmarks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from kvserve.v1 import worker_pb2_grpc
from kvserve.worker.runner import ModelRunner
from kvserve.worker.server import start_worker_server


@contextmanager
def loopback_worker(runner: ModelRunner) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A real worker gRPC server on a free loopback port, and a stub talking to it."""
    ws = start_worker_server(runner, "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ws.port}") as channel:
            yield worker_pb2_grpc.WorkerServiceStub(channel)
    finally:
        ws.stop(1.0)
