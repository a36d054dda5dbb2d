"""Shared gRPC server plumbing for every kvserve service: health, reflection, message limits, graceful stop
on SIGTERM/SIGINT, the one table of domain errors to status codes, and the RPC timer. Each service's server.py
only adds its servicers (and interceptors)."""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.common.errors import (
    DomainError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvserve.common.tls import Tls, server_credentials, warn_if_plaintext

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Channels between kvserve's own services carry whole prompts' token ids: the same limits as the servers.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))


# The one table of gRPC statuses: every typed error of every service is one of these kinds (kvserve/common/errors.py).
ERROR_STATUS: dict[type[DomainError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Internal: grpc.StatusCode.INTERNAL,
}


def status_for(error: Exception) -> grpc.StatusCode:
    """The status of a typed error: that of the kind it is (INTERNAL for an error that is none: a bug)."""
    return next((code for kind, code in ERROR_STATUS.items() if isinstance(error, kind)), grpc.StatusCode.INTERNAL)


REQ_ID_METADATA = "kvserve-req-id"  # trailing metadata: the one request an error is about (DomainError.req_id)


def abort(context: grpc.ServicerContext, error: Exception):
    """Ends the call with the error's status and its message (raises, as context.abort does); an error about one
    request names it in the trailing metadata, so that the caller fails that request alone."""
    req_id = getattr(error, "req_id", None)
    if req_id:
        context.set_trailing_metadata(((REQ_ID_METADATA, req_id),))
    context.abort(status_for(error), str(error))


def aborts_on_domain_errors(method):
    """A unary servicer method whose typed errors end the call with their status and message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except DomainError as e:
            abort(context, e)

    return wrapper


class RpcTimer(grpc.ServerInterceptor):
    """Observes each unary RPC's server-side duration into ``histogram`` (labelled by method name)."""

    def __init__(self, histogram):
        self.histogram = histogram

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary

        def timed(request, context):
            t0 = time.perf_counter()
            try:
                return inner(request, context)
            finally:
                self.histogram.labels(method).observe(time.perf_counter() - t0)

        return grpc.unary_unary_rpc_method_handler(timed, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class _Undecodable:
    """What a request that is not a valid message deserializes to, so that its handler can answer for it."""

    def __init__(self, error: Exception):
        self.error = error


class UndecodableIsInvalidArgument(grpc.ServerInterceptor):
    """A request that does not parse as its message (bad wire format, a string field that is not UTF-8) is
    INVALID_ARGUMENT with protobuf's reason, where grpc answers INTERNAL "Exception deserializing request!"."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        deserialize = handler.request_deserializer

        def safe_deserialize(data: bytes):
            try:
                return deserialize(data)
            except Exception as e:  # protobuf's DecodeError, or a RuntimeError from upb
                return _Undecodable(e)

        def guarded(behaviour):
            def answer(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{details.method}: the request is not a valid message: {request.error}")
                return behaviour(request, context)
            return answer

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(guarded(handler.unary_unary), safe_deserialize,
                                                       handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(guarded(handler.unary_stream), safe_deserialize,
                                                    handler.response_serializer)


@dataclass(slots=True)
class GrpcServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace_s: float = 5.0) -> None:
        """Reports NOT_SERVING, stops admitting calls, lets in-flight calls finish for up to grace_s."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_grpc_server(host: str, port: int, add_servicers: Callable[[grpc.Server], None],
                      service_names: Sequence[str], *, interceptors: Sequence[grpc.ServerInterceptor] = (),
                      max_threads: int = 8, max_receive_bytes: int = MAX_MESSAGE_BYTES,
                      serving: bool = True, tls: Tls | None = None) -> GrpcServer:
    """Serves on host:port (0 = a free port) with health SERVING for "" and ``service_names``, and reflection;
    returns once the port is bound. ``tls``: serve TLS with its files (mutual TLS when it has a CA); None serves
    plaintext, and says so at warning level when host is not loopback. A call larger than max_receive_bytes is
    refused with RESOURCE_EXHAUSTED.
    ``serving`` False: ``service_names`` report NOT_SERVING from the start (a standby), "" SERVING (the
    process is up). Raises OSError when it cannot be bound."""
    options = [("grpc.max_receive_message_length", max_receive_bytes),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]  # gRPC's default on Linux lets a second server share a port in use
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads), options=options,
                         interceptors=[UndecodableIsInvalidArgument(), *interceptors])
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bound = _add_port(server, host, port, tls)
    except RuntimeError as e:  # how grpcio says it, for a port in use among others
        raise OSError(f"could not bind {host}:{port} (in use?): {e}") from e
    if bound == 0:
        raise OSError(f"could not bind {host}:{port} (in use?)")
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    set_serving(health_servicer, service_names, serving)
    server.start()
    if tls is None:
        warn_if_plaintext(f"gRPC ({', '.join(service_names)})", host, bound)
    return GrpcServer(server=server, port=bound, health=health_servicer)


def _add_port(server: grpc.Server, host: str, port: int, tls: Tls | None) -> int:
    """The port bound (0 when it could not be), plaintext or with ``tls``'s credentials."""
    if tls is None:
        return server.add_insecure_port(f"{host}:{port}")
    return server.add_secure_port(f"{host}:{port}", server_credentials(tls))


def set_serving(health_servicer: health.HealthServicer, service_names: Sequence[str], serving: bool) -> None:
    """Reports ``service_names`` SERVING or NOT_SERVING (clients' health checks route by it)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in service_names:
        health_servicer.set(name, status)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_stop_signals() -> threading.Event:
    """An event that the first SIGTERM or SIGINT sets; a second one terminates the process at once (the usual
    "press Ctrl-C again"). Call from the main thread, before the ready line.

    The handler restores the default actions before it touches the event: Event.set takes a lock, and a
    second signal handled while the first handler held it would deadlock the main thread (seen: a kvmanager
    that got SIGTERM twice, from its parent's death and from its parent's terminate, hung forever)."""
    done = threading.Event()

    def handler(*_) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        done.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return done


def serve_until_signal(server: GrpcServer, stop: threading.Event, name: str, grace_s: float = 5.0) -> None:
    """Blocks until ``stop`` is set (by install_stop_signals' handlers), then stops gracefully."""
    stop.wait()
    logging.getLogger(f"kvserve.{name}").info("%s stopping (grace %.1fs)", name, grace_s)
    server.stop(grace_s)
