"""Counts HTTP requests by endpoint and status, and times them, as an ASGI middleware around the front-end.

The endpoint label is the route's path (``/v1/chat/completions``), or ``other`` for a path no route serves, so
that a scan of random URLs cannot grow the label set. A stream counts with the status it started with (200),
and its time runs to its last byte."""

from __future__ import annotations

import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.common.metrics import GatewayMetrics


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, paths: Sequence[str]):
        self.app, self.metrics = app, metrics
        self.paths = {p for p in paths if "{" not in p}
        self.templates = {p.split("{", 1)[0]: p for p in paths if "{" in p}  # the fixed part -> the route

    def endpoint(self, path: str) -> str:
        if path in self.paths:
            return path
        return next((route for prefix, route in self.templates.items() if path.startswith(prefix)), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 500  # a response that never started counts as 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            endpoint = self.endpoint(scope["path"])
            self.metrics.http_requests.labels(endpoint, str(status)).inc()
            self.metrics.http_latency.labels(endpoint).observe(time.monotonic() - start)
