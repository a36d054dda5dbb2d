"""The gateway over gRPC backends: clients of the kvmanager and of each worker, handed to the core."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.common.metrics import GatewayMetrics
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.rpc.clients import KVManagerClient, WorkerClient


def connect_gateway(kvmanager: str, workers: Sequence[str], cfg: GatewayConfig, keys: ApiKeys,
            metrics: GatewayMetrics | None = None) -> Gateway:
    """A Gateway whose backends are the kvmanager at ``kvmanager`` and the workers at ``workers`` (host:port).
    Raises as Gateway does; the clients are closed again when it fails."""
    kv = KVManagerClient(kvmanager)
    clients = [WorkerClient(address) for address in workers]
    try:
        return Gateway(cfg, keys, kv, clients, metrics)
    except BaseException:
        for client in (kv, *clients):
            client.close()
        raise
