"""Wires the gateway's gRPC server: its servicer on the shared plumbing (kvserve/common/grpc_server.py)."""

from __future__ import annotations

from kvserve.common.grpc_server import GrpcServer, start_grpc_server
from kvserve.common.tls import Tls
from kvserve.services.gateway.app import Gateway
from kvserve.services.gateway.rpc.servicer import GatewayServicer
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
MAX_REQUEST_BYTES = 1 << 20  # a generation request larger than 1 MiB is RESOURCE_EXHAUSTED


def start_gateway_server(gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                         max_threads: int = 256, tls: Tls | None = None) -> GrpcServer:
    """Serves ``gateway`` on host:port (0 = a free port), with ``tls`` if given (mutual with a CA). Every
    streaming call holds one thread while it runs, so max_threads bounds the calls served at once."""
    return start_grpc_server(
        host, port, lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(gateway), s),
        (SERVICE_NAME,), max_threads=max_threads, max_receive_bytes=MAX_REQUEST_BYTES, tls=tls)
