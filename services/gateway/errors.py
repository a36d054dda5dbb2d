"""The gateway's typed errors; servicer.py maps each to one gRPC status."""

from __future__ import annotations

from kvserve.common.errors import InvalidRequest
from kvserve.services.gateway.auth import Unauthenticated


class ShuttingDown(Exception):
    """The gateway stopped admitting requests (graceful shutdown)."""


class OutOfCapacity(Exception):
    """A request fits no worker pool even with nothing else running (pinned blocks hold the pages)."""


class BackendFailure(Exception):
    """A worker or the kvmanager failed the request's step; its pages were freed."""


__all__ = ["BackendFailure", "InvalidRequest", "OutOfCapacity", "ShuttingDown", "Unauthenticated"]
