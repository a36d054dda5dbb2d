"""kvserve's client SDK for the gateway's public gRPC API (kvserve.v1.GatewayService).

    from kvserve.services.client import Client

    with Client("127.0.0.1:50050", api_key="...") as client:
        for delta in client.generate("Once upon a time", max_tokens=64):
            print(delta.text, end="")
        print(client.complete(messages=[{"role": "user", "content": "Hi"}]).text)

Over TLS: ``Client(address, credentials=tls_credentials(ca="ca.crt"))``, and for a gateway that requires client
certificates (mutual TLS) ``tls_credentials(ca=..., cert="client.crt", key="client.key")``.

``AsyncClient`` offers the same on asyncio. Failures raise the ``KVServeError`` subclasses; UNAVAILABLE is
retried with backoff within the call's deadline (a stream only before its first delta).
"""

from kvserve.services.client.aio import AsyncClient, AsyncGenerateStream
from kvserve.services.client.client import (
    DEFAULT_GATEWAY_ADDRESS,
    DEFAULT_TIMEOUT_S,
    Client,
    GenerateStream,
    tls_credentials,
)
from kvserve.services.client.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    KVServeError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from kvserve.services.client.retry import RetryPolicy
from kvserve.services.client.types import CachePin, Completion, Delta, Logprob, Usage, build_request

__all__ = [
    "DEFAULT_GATEWAY_ADDRESS",
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "AsyncGenerateStream",
    "CachePin",
    "Cancelled",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "Delta",
    "FailedPrecondition",
    "GenerateStream",
    "InternalError",
    "InvalidArgument",
    "KVServeError",
    "Logprob",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "build_request",
    "from_rpc_error",
    "tls_credentials",
]
