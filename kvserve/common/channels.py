"""Client channels to kvserve's services.

``kvmanager_channel`` takes what ``--kvmanager`` holds: one ``host:port``, a ``dns:///name:port`` (a Kubernetes
headless Service resolves to every kvmanager pod), or several ``host:port`` separated by commas (a leader and
its standbys). Every client of the kvmanager (the gateway's, the workers' membership client, the admin CLI)
opens its channel here, so that all of them find the leader the same way.

How the leader is found: gRPC's own client-side health checking. The channel balances round robin over every
address of the target, but only over those whose gRPC health reports kvserve.v1.KVManagerService SERVING,
which is the leader alone (a standby reports NOT_SERVING, kvserve/kvmanager/server.py). The health is a Watch stream
the server pushes on, so a new leader is used as soon as it flips to SERVING; a call made while none serves
waits for one with wait_for_ready (the gateway's page ops do), or fails UNAVAILABLE at once without it. A call
that reaches a kvmanager just as it steps down is answered UNAVAILABLE ("not the leader"), and the clients'
retries (same step_id) carry it to the new leader, which answers a call it already logged from memory.

Why this rather than only a Kubernetes Service that routes to the ready leader (the k8s manifests do that as
well, with a readiness probe on the same health): it needs no Kubernetes (``kvserve up --kvmanager-replicas 2``
uses it on one machine), and a takeover is not delayed by a probe's period and failure threshold nor by the
endpoints' propagation to kube-proxy, which take seconds; here the delay is the lease's lapse plus one health
push. A Service address given as the single target still works: it is one backend that is the leader.

Several ``host:port`` entries are resolved once, when the channel is made (gRPC's ``ipv4:``/``ipv6:`` address
list targets take IP literals); names whose addresses change (pods) belong in one ``dns:///`` target, which gRPC
resolves again whenever a connection fails.
"""

from __future__ import annotations

import json
import socket
from dataclasses import replace

import grpc

from kvserve.common.grpc_server import CHANNEL_OPTIONS
from kvserve.common.tls import Tls, address_host, open_channel

KVMANAGER_SERVICE = "kvserve.v1.KVManagerService"
# Round robin over the healthy backends only (gRPC's client-side health checking needs a balancer other than
# pick_first); a backend without the health service counts as healthy, as gRPC specifies.
KVMANAGER_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                                       "healthCheckConfig": {"serviceName": KVMANAGER_SERVICE}})


def kvmanager_addresses(spec: str) -> list[str]:
    """The host:port entries of a --kvmanager value; raises ValueError for an empty one."""
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"--kvmanager {spec!r}: no host:port in it")
    return addresses


def kvmanager_target(spec: str) -> str:
    """The gRPC target for ``spec``: a single entry as given (gRPC resolves it, all its addresses), a list as one
    ``ipv4:``/``ipv6:`` address list. Raises ValueError for an entry that is not host:port or does not resolve,
    and for a list mixing IPv4 and IPv6."""
    addresses = kvmanager_addresses(spec)
    if len(addresses) == 1:
        return addresses[0]
    resolved = [_resolve(a) for a in addresses]
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"--kvmanager {spec!r}: IPv4 and IPv6 addresses mixed in one list")
    scheme = "ipv4" if families == {socket.AF_INET} else "ipv6"
    return f"{scheme}:{','.join(address for _, address in resolved)}"


def _resolve(address: str) -> tuple[int, str]:
    """(address family, "ip:port" or "[ip]:port") of a host:port entry; IPv4 preferred."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in address:
        raise ValueError(f"--kvmanager: {address!r} is not host:port (a list takes host:port entries; a "
                         "dns:///name:port target goes alone)")
    host = host.removeprefix("[").removesuffix("]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--kvmanager: cannot resolve {host!r}: {e}") from e
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, ip = infos[0][0], infos[0][4][0]
    return family, (f"{ip}:{port}" if family == socket.AF_INET else f"[{ip}]:{port}")


def kvmanager_channel(spec: str, options: tuple = CHANNEL_OPTIONS, tls: Tls | None = None) -> grpc.Channel:
    """A channel to the kvmanager leader among those ``spec`` names (see the module docstring); with ``tls``, a
    TLS one (a list of addresses verifies every kvmanager's certificate against one name: kvserve/common/tls.py)."""
    addresses = kvmanager_addresses(spec)
    if tls is not None and tls.server_name is None and len(addresses) > 1:  # the first host as written, not its IP
        tls = replace(tls, server_name=address_host(addresses[0]))
    return open_channel(kvmanager_target(spec), tls,
                        options=(*options, ("grpc.service_config", KVMANAGER_SERVICE_CONFIG)))
