"""The gRPC link between workers for page transfers (kvserve/worker/transfer.py's PageReader): ReadPages on the source,
one channel per source address kept for later pulls, TLS as for the worker's other client calls.

Transport glue, like membership.py: the verify-and-fill logic stays in transfer.py, so that another link (RDMA)
can replace this one behind the same ``read``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import grpc

from kvserve.common.convert.transfer import read_order_to_proto
from kvserve.common.grpc_server import MAX_MESSAGE_BYTES
from kvserve.common.tls import Tls, open_channel
from kvserve.common.wire.transfer import FRAME_BYTES, ReadOrder
from kvserve.v1 import worker_pb2_grpc
from kvserve.worker.transfer import TransferFailed


class GrpcPageReader:
    """Reads pages from source workers over gRPC. ``tls``: the worker's own TLS files (its certificate is its
    client certificate, its CA verifies the source); None for plaintext. ``value_bytes``: one page value of this
    worker's pool, so that a frame of one big page still fits the receive limit."""

    def __init__(self, tls: Tls | None, value_bytes: int, server_name: str | None = None):
        # --tls-server-name names the kvmanager's certificate: a peer is verified against --peer-tls-server-name,
        # else its own host
        self.tls = dataclasses.replace(tls, server_name=server_name or None) if tls is not None else None
        limit = max(MAX_MESSAGE_BYTES, value_bytes + FRAME_BYTES + (1 << 20))
        self.options = (("grpc.max_receive_message_length", limit),)
        self._stubs: dict[str, tuple[grpc.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._lock = threading.Lock()

    def read(self, address: str, order: ReadOrder, timeout_s: float, traceparent: str = "") -> Iterator[list[bytes]]:
        """ReadPages on ``address`` with a deadline of ``timeout_s``; raises TransferFailed while iterating on any
        gRPC error (the source's refusal included, with its status and message)."""
        metadata = (("traceparent", traceparent),) if traceparent else None
        try:
            call = self._stub(address).ReadPages(read_order_to_proto(order), timeout=timeout_s, metadata=metadata)
        except (grpc.RpcError, ValueError) as e:  # ValueError: an address gRPC cannot parse
            raise TransferFailed(f"could not call ReadPages: {e}") from None
        return _frames(call)

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        with self._lock:
            if address not in self._stubs:
                channel = open_channel(address, self.tls, self.options)
                self._stubs[address] = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
            return self._stubs[address][1]

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            channel.close()


def _frames(call) -> Iterator[list[bytes]]:
    """The call's frames as lists of values; a stream left early (the receiver stopped reading) is cancelled."""
    try:
        for frame in call:
            yield list(frame.values)
    except grpc.RpcError as e:
        raise TransferFailed(f"{e.code().name}: {e.details()}") from None
    finally:
        call.cancel()
