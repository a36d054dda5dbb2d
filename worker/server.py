"""Wires the worker's gRPC server: servicer, health, reflection, graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.v1 import worker_pb2, worker_pb2_grpc
from kvserve.worker.runner import ModelRunner
from kvserve.worker.servicer import WorkerServicer

log = logging.getLogger("kvserve.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class WorkerServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    runner: ModelRunner

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops admitting calls, lets in-flight steps finish for up to grace_s, then closes."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_worker_server(runner: ModelRunner, host: str = "127.0.0.1", port: int = 0,
                        max_threads: int = 8) -> WorkerServer:
    """Starts serving ``runner`` on host:port (0 = a free port); returns once the port is bound."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads), options=options)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(runner), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return WorkerServer(server=server, port=bound, health=health_servicer, runner=runner)


def install_stop_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set from now on. Call from the main thread."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    return done


def serve_until_signal(ws: WorkerServer, grace_s: float = 5.0, stop: threading.Event | None = None) -> None:
    """Blocks until SIGTERM or SIGINT (``stop``: the event of an earlier install_stop_signals), then stops."""
    done = stop if stop is not None else install_stop_signals()
    done.wait()
    log.info("worker stopping (grace %.1fs)", grace_s)
    ws.stop(grace_s)
