"""Serves the HTTP front-end with uvicorn on a thread of the gateway process, beside the gRPC server, so that
both front-ends share one gateway core. The socket is bound before the thread starts: port 0 is known at once."""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn

from kvserve.common.tls import Tls, uvicorn_ssl, warn_if_plaintext

log = logging.getLogger("kvserve.gateway.http")
START_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    """uvicorn's server, which says when it has started (or failed to) instead of being polled."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


class HttpServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, tls: Tls | None = None):
        """Binds host:port (0 = a free port) and serves ``app`` until ``stop``: HTTPS with ``tls`` (client
        certificates required and verified with its CA, if any), else plain HTTP (a warning when host is not
        loopback). Raises OSError if it cannot."""
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                         backlog=2048)
        self.host, self.port, self.scheme = host, self.sock.getsockname()[1], "http" if tls is None else "https"
        config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=2, timeout_keep_alive=30,
                                **uvicorn_ssl(tls))
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvserve-http", daemon=True)
        self.thread.start()
        if not self.server.ready.wait(START_TIMEOUT_S) or not self.server.started:
            self.stop()
            raise OSError(f"the HTTP server on {host}:{self.port} did not start")
        if tls is None:
            warn_if_plaintext("HTTP", host, self.port)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/v1"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, lets open responses end (up to uvicorn's graceful timeout), closes the socket."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
