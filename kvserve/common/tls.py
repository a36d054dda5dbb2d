"""TLS between kvserve's services and for their clients: the files the ``--tls-*`` flags name, read and checked
once at start-up, and the gRPC credentials (and uvicorn settings) made from them.

    server  --tls-cert + --tls-key            TLS: clients verify the server against their CA
            ... + --tls-ca                    mutual TLS: a client must present a certificate that CA signed
    client  --tls-ca                          verify the server against this CA (else the system's roots)
            ... + --tls-cert + --tls-key      present this certificate (for a server that wants mutual TLS)

A process that is a server and a client (the gateway, a worker) uses the same three files both ways: its
certificate is its client certificate, and its CA verifies the services it dials. Without any of the flags,
everything is plaintext (the local default); a plaintext server on a non-loopback address says so at start-up
(``warn_if_plaintext``).

Host names: a channel verifies the server's certificate against the host of its target (an IP address
against an IP SAN). A target that is a list of addresses (``ipv4:a:p,b:p``, what ``--kvmanager a:p,b:p`` becomes)
has no single host, so one name is verified for all: ``server_name`` (``--tls-server-name``) if given, else the
host of the first address as written (kvserve/common/channels.py).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("kvserve.tls")
FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca"}


class TlsError(ValueError):
    """A TLS flag whose file is missing, unreadable or not what it should be, or flags that do not go together."""


@dataclass(frozen=True, slots=True)
class Tls:
    """The PEM bytes of the TLS files (each None when not given) and the paths they came from."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None
    cert_path: Path | None = None
    key_path: Path | None = None
    ca_path: Path | None = None
    server_name: str | None = None  # the name a client verifies the server's certificate against, if not its host
    client_auth: bool = True  # on a server with a CA: require client certificates (False: the CA only dials)

    @property
    def mutual(self) -> bool:
        """On a server: client certificates are required and verified against the CA."""
        return self.ca is not None and self.client_auth

    def describe(self) -> str:
        return "mutual TLS" if self.mutual else "TLS"


def load_tls(cert: str | Path | None, key: str | Path | None, ca: str | Path | None, *, server: bool,
             server_name: str | None = None) -> Tls | None:
    """The TLS files the flags name, read and checked; None when none is given (plaintext).

    ``server``: for a process that serves (it needs a certificate and key once any flag is given); a pure client
    may give the CA alone. Raises TlsError naming the flag and the path: a file missing or unreadable, a
    certificate without its key (or the other way round), a key that is not the certificate's, a CA that holds no
    certificate, and on a server a CA without a certificate of its own."""
    paths = {name: Path(value).expanduser() if value else None for name, value in
             (("cert", cert), ("key", key), ("ca", ca))}
    if not any(paths.values()):
        if server_name:
            raise TlsError("--tls-server-name needs TLS: give --tls-ca (or --tls-cert and --tls-key)")
        return None
    if (paths["cert"] is None) != (paths["key"] is None):
        given, missing = ("cert", "key") if paths["key"] is None else ("key", "cert")
        raise TlsError(f"{FLAGS[given]} {paths[given]} needs {FLAGS[missing]} too (a certificate and its private "
                       "key go together)")
    if server and paths["cert"] is None:
        raise TlsError(f"--tls-ca {paths['ca']} on a server needs --tls-cert and --tls-key: the server's own "
                       "certificate (the CA alone only verifies the clients')")
    data = {name: _read(name, path) for name, path in paths.items()}
    _check(paths, data)
    return Tls(cert=data["cert"], key=data["key"], ca=data["ca"], cert_path=paths["cert"], key_path=paths["key"],
               ca_path=paths["ca"], server_name=server_name or None)


def _read(name: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TlsError(f"{FLAGS[name]} {path}: cannot read it: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{FLAGS[name]} {path}: not a PEM file (no -----BEGIN line)")
    return data


def _check(paths: dict[str, Path | None], data: dict[str, bytes | None]) -> None:
    """What gRPC would only report as a failed handshake, said at start-up: the key is the certificate's, the
    CA parses (OpenSSL through the ssl module; both are PEM files already read once)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if paths["cert"] is not None:
        try:
            context.load_cert_chain(paths["cert"], paths["key"], password=_no_password)
        except (ssl.SSLError, OSError) as e:
            raise TlsError(f"--tls-cert {paths['cert']} with --tls-key {paths['key']}: not a certificate and its "
                           f"private key ({e})") from None
    if data["ca"] is not None:
        try:
            context.load_verify_locations(cadata=data["ca"].decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise TlsError(f"--tls-ca {paths['ca']}: holds no CA certificate ({e})") from None


def _no_password() -> bytes:
    """An encrypted key fails to load (gRPC cannot take a passphrase) rather than prompting on the terminal."""
    return b""


def server_credentials(tls: Tls) -> grpc.ServerCredentials:
    """A server's credentials: its certificate, and with a CA client certificates required and verified."""
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca if tls.mutual else None,
                                       require_client_auth=tls.mutual)


def channel_credentials(tls: Tls) -> grpc.ChannelCredentials:
    """A client's credentials: the CA that verifies the server (None: the system's roots), and its certificate
    for a server that wants mutual TLS."""
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def channel_options(tls: Tls | None, target: str) -> tuple[tuple[str, str], ...]:
    """The channel options a TLS channel to ``target`` needs: the name to verify the server's certificate
    against when it is not the target's own host (module docstring)."""
    if tls is None:
        return ()
    name = tls.server_name
    if name is None and target.startswith(("ipv4:", "ipv6:")):
        name = address_host(target.partition(":")[2].split(",")[0])
    return (("grpc.ssl_target_name_override", name),) if name else ()


def address_host(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    return address.rpartition(":")[0].removeprefix("[").removesuffix("]")


def open_channel(target: str, tls: Tls | None, options: tuple = ()) -> grpc.Channel:
    """A channel to ``target``: plaintext without ``tls``, else TLS with ``tls``'s files."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, channel_credentials(tls), options=(*options, *channel_options(tls, target)))


def uvicorn_ssl(tls: Tls | None) -> dict:
    """uvicorn.Config's keyword arguments for an HTTPS server with ``tls`` (mutual with a CA); {} for none."""
    if tls is None:
        return {}
    settings = {"ssl_certfile": str(tls.cert_path), "ssl_keyfile": str(tls.key_path)}
    if tls.mutual:
        settings |= {"ssl_ca_certs": str(tls.ca_path), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return settings


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) is loopback only; "", 0.0.0.0 and :: are every interface."""
    host = host.removeprefix("[").removesuffix("]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def warn_if_plaintext(what: str, host: str, port: int) -> bool:
    """Logs one warning when ``what`` serves plaintext on a non-loopback address (anyone who reaches it may call
    it, and reads what it sends); True when it did."""
    if is_loopback(host):
        return False
    shown = f"[{host}]" if ":" in host else host
    log.warning("%s serves plaintext on %s:%d, a non-loopback address: give --tls-cert and --tls-key (and "
                "--tls-ca for mutual TLS), or KVSERVE_TLS_CERT/KVSERVE_TLS_KEY/KVSERVE_TLS_CA", what, shown, port)
    return True
