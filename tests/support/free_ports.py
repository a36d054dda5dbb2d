"""Free TCP ports on 127.0.0.1 for servers that a test starts later, each handed out once per test process.

A port is free when it is picked, but closing the probe socket frees it for the kernel to pick again, so several
picks made before any server binds can return one port twice, and then two servers race for it ("Address already
in use"). Remembering every port handed out rules that out."""

from __future__ import annotations

import socket

_given: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
