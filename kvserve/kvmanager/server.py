"""Wires the kvmanager's gRPC server: both servicers and the admin-token check, on the shared plumbing
(kvserve/common/grpc_server.py: health, reflection, graceful stop).

Admin authentication: every KVAdminService call must carry the metadata ``authorization: Bearer <token>``.
Missing (or not a bearer token) is UNAUTHENTICATED, a wrong token PERMISSION_DENIED (constant-time compare).
KVManagerService and health need no token.

Leadership (leader.py): while the KVService is not leading (a standby), every KVManagerService and KVAdminService
call answers UNAVAILABLE with a message naming the leader (LeaderGate), and gRPC health reports both services
NOT_SERVING, so that clients' health-checked channels (kvserve/common/channels.py) route to the leader alone.
"""

from __future__ import annotations

import gc
import hmac

import grpc

from kvserve.common.credentials import bearer_token
from kvserve.common.grpc_server import GrpcServer, set_serving, start_grpc_server
from kvserve.common.tls import Tls
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.servicer import KVAdminServicer, KVManagerServicer, TextEncoder
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

MANAGER_SERVICE = kvmanager_pb2.DESCRIPTOR.services_by_name["KVManagerService"].full_name
ADMIN_SERVICE = kvmanager_pb2.DESCRIPTOR.services_by_name["KVAdminService"].full_name


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
        token = bearer_token(value)
        if token is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "the authorization metadata must be 'Bearer <admin token>'")
        if not hmac.compare_digest(token.encode(), self._token):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return continuation(handler_call_details)


class LeaderGate(grpc.ServerInterceptor):
    """Refuses KVManagerService and KVAdminService calls with UNAVAILABLE while ``service`` is not leading (the
    service checks again under its lock: a call that passes here as leadership is lost is refused there)."""

    def __init__(self, service: KVService):
        self.service = service
        self._prefixes = (f"/{MANAGER_SERVICE}/", f"/{ADMIN_SERVICE}/")

    def intercept_service(self, continuation, handler_call_details):
        if self.service.leading or not handler_call_details.method.startswith(self._prefixes):
            return continuation(handler_call_details)
        return _deny(grpc.StatusCode.UNAVAILABLE, self.service.not_leading_why)


def report_leadership(server: GrpcServer, leading: bool) -> None:
    """gRPC health of both kvmanager services: SERVING on the leader, NOT_SERVING on a standby."""
    set_serving(server.health, (MANAGER_SERVICE, ADMIN_SERVICE), leading)


# Collector thresholds for a serving kvmanager process (CPython's default is 700, 10, 10). A call that commits
# or admits long prompts creates thousands of container objects (a Block per page), and the state they join is
# long-lived: at the default, such a call runs several young collections and part of a middle one, and every
# few calls a full one over the whole state, which shows in those calls' latency. Garbage in this process is
# almost never cyclic (reference counting frees it), so rarer collections cost little memory.
SERVING_GC_THRESHOLDS = (100_000, 50, 100)


def tune_gc_for_serving() -> None:
    """For the process that serves the kvmanager, once its state is loaded: collect, freeze what is live now
    (out of every later collection), and collect the young generation far less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


def start_kvmanager_server(service: KVService, host: str = "127.0.0.1", port: int = 0, *, admin_token: str,
                           tokenizer: TextEncoder | None = None, max_threads: int = 8,
                           interceptors: tuple[grpc.ServerInterceptor, ...] = (), tls: Tls | None = None) -> GrpcServer:
    """Serves ``service`` on host:port (0 = a free port); returns once the port is bound and serving, as the
    leader if ``service.leading`` (else as a standby: report_leadership flips it later). ``tls``: TLS (mutual
    with a CA: only clients with a certificate it signed get in), else plaintext.

    ``tokenizer`` (optional) turns the admin calls' text input into token ids. Raises OSError when the port
    cannot be bound, ValueError for an empty admin token.
    """
    def add_servicers(server: grpc.Server) -> None:
        kvmanager_pb2_grpc.add_KVManagerServiceServicer_to_server(KVManagerServicer(service), server)
        kvmanager_pb2_grpc.add_KVAdminServiceServicer_to_server(KVAdminServicer(service, tokenizer), server)

    return start_grpc_server(host, port, add_servicers, (MANAGER_SERVICE, ADMIN_SERVICE),
                             interceptors=[*interceptors, AdminAuthInterceptor(admin_token), LeaderGate(service)],
                             max_threads=max_threads, serving=service.leading, tls=tls)
