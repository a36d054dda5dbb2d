"""Wires the kvmanager's gRPC server: both servicers, admin-token check, health, reflection, graceful stop.

Admin authentication: every KVAdminService call must carry the metadata ``authorization: Bearer <token>``.
Missing (or not a bearer token) is UNAUTHENTICATED, a wrong token PERMISSION_DENIED (constant-time compare).
KVManagerService and health need no token.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.servicer import KVAdminServicer, KVManagerServicer, TextEncoder
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

log = logging.getLogger("kvserve.kvmanager")
MANAGER_SERVICE = kvmanager_pb2.DESCRIPTOR.services_by_name["KVManagerService"].full_name
ADMIN_SERVICE = kvmanager_pb2.DESCRIPTOR.services_by_name["KVAdminService"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class AdminAuthInterceptor(grpc.ServerInterceptor):
    """Refuses KVAdminService calls without the right bearer token; passes every other call through."""

    def __init__(self, admin_token: str):
        if not admin_token:
            raise ValueError("the admin token must not be empty")
        self._token = admin_token.encode()
        self._prefix = f"/{ADMIN_SERVICE}/"

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(self._prefix):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        value = metadata.get("authorization")
        if value is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "admin calls need the metadata 'authorization: Bearer "
                         "<admin token>' (kvserve admin: --admin-token or KVSERVE_ADMIN_TOKEN)")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "the authorization metadata must be 'Bearer <admin token>'")
        if not hmac.compare_digest(token.strip().encode(), self._token):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return continuation(handler_call_details)


@dataclass(slots=True)
class KVManagerServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service: KVService

    def stop(self, grace_s: float = 5.0) -> None:
        """Reports NOT_SERVING, stops admitting calls, lets in-flight calls finish for up to grace_s."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_kvmanager_server(service: KVService, host: str = "127.0.0.1", port: int = 0, *, admin_token: str,
                           tokenizer: TextEncoder | None = None, max_threads: int = 8) -> KVManagerServer:
    """Serves ``service`` on host:port (0 = a free port); returns once the port is bound and serving.

    ``tokenizer`` (optional) turns the admin calls' text input into token ids. Raises OSError when the port
    cannot be bound, ValueError for an empty admin token.
    """
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads), options=options,
                         interceptors=[AdminAuthInterceptor(admin_token)])
    kvmanager_pb2_grpc.add_KVManagerServiceServicer_to_server(KVManagerServicer(service), server)
    kvmanager_pb2_grpc.add_KVAdminServiceServicer_to_server(KVAdminServicer(service, tokenizer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (MANAGER_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    for name in ("", MANAGER_SERVICE, ADMIN_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return KVManagerServer(server=server, port=bound, health=health_servicer, service=service)


def install_stop_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set from now on. Call from the main thread."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    return done


def serve_until_signal(server: KVManagerServer, stop: threading.Event, grace_s: float = 5.0) -> None:
    """Blocks until ``stop`` is set (by install_stop_signals' handlers), then stops gracefully."""
    stop.wait()
    log.info("kvmanager stopping (grace %.1fs)", grace_s)
    server.stop(grace_s)
