"""Shared gRPC server plumbing for every kvserve service: health, reflection, message limits, graceful stop
on SIGTERM/SIGINT. Each service's server.py only adds its servicers (and interceptors)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Channels between kvserve's own services carry whole prompts' token ids: the same limits as the servers.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))


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
                      max_threads: int = 8, max_receive_bytes: int = MAX_MESSAGE_BYTES) -> GrpcServer:
    """Serves on host:port (0 = a free port) with health SERVING for "" and ``service_names``, and reflection;
    returns once the port is bound. A call larger than max_receive_bytes is refused with RESOURCE_EXHAUSTED.
    Raises OSError when it cannot be bound."""
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
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # how grpcio says it, for a port in use among others
        raise OSError(f"could not bind {host}:{port} (in use?): {e}") from e
    if bound == 0:
        raise OSError(f"could not bind {host}:{port} (in use?)")
    server.start()
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server=server, port=bound, health=health_servicer)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def bearer_token(authorization: str) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata value; None when it is not one."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()


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
