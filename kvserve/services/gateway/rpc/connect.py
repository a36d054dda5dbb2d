"""The gateway over gRPC backends: clients of the kvmanager and of each worker, handed to the core."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.common.metrics import GatewayMetrics
from kvserve.common.tls import Tls
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.rpc.clients import KVManagerClient, WorkerClient


def connect_gateway(kvmanager: str, workers: Sequence[str] | None, cfg: GatewayConfig, keys: ApiKeys,
                    metrics: GatewayMetrics | None = None, tls: Tls | None = None) -> Gateway:
    """A Gateway whose backends are the kvmanager at ``kvmanager`` (host:port, or a comma-separated list of a
    leader and its standbys) and the workers at ``workers`` (host:port), or, with workers None, the live
    workers the kvmanager lists as they come and go. Raises as Gateway does; the clients are closed again when
    it fails. ``tls``: every backend is dialled with TLS (with a certificate: the gateway's client certificate for
    mutual TLS), else plaintext."""
    kv = KVManagerClient(kvmanager, tls=tls)

    def dial(address: str) -> WorkerClient:
        return WorkerClient(address, retry_for_s=cfg.worker_timeout_s, tls=tls)

    clients = None if workers is None else [dial(address) for address in workers]
    try:
        return Gateway(cfg, keys, kv, clients, metrics, connect_worker=dial)
    except BaseException:
        for client in (kv, *(clients or ())):
            client.close()
        raise
