"""Client channels to kvserve's services.

``kvmanager_channel`` takes what ``--kvmanager`` holds: one ``host:port``, or several separated by commas (a
leader and its standbys). Every client of the kvmanager (the gateway's, the workers' membership client, the
admin CLI) opens its channel here, so that all of them find the leader the same way.
"""

from __future__ import annotations

import grpc

from kvserve.common.grpc_server import CHANNEL_OPTIONS


def kvmanager_addresses(spec: str) -> list[str]:
    """The host:port entries of a --kvmanager value; raises ValueError for an empty one."""
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"--kvmanager {spec!r}: no host:port in it")
    return addresses


def kvmanager_channel(spec: str, options: tuple = CHANNEL_OPTIONS) -> grpc.Channel:
    """A channel to the kvmanager named by ``spec`` (see kvmanager_addresses)."""
    addresses = kvmanager_addresses(spec)
    return grpc.insecure_channel(addresses[0], options=options)
