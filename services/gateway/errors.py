"""The gateway's typed errors; servicer.py maps each to one gRPC status."""

from __future__ import annotations

from kvserve.services.gateway.auth import Unauthenticated
from kvserve.worker.batch import InvalidRequest


class ShuttingDown(Exception):
    """The gateway stopped admitting requests (graceful shutdown)."""


class OutOfCapacity(Exception):
    """A request fits no worker pool even with nothing else running (pinned blocks hold the pages)."""


class BackendFailure(Exception):
    """A worker or the kvmanager failed the request's step; its pages were freed."""


__all__ = ["BackendFailure", "InvalidRequest", "OutOfCapacity", "ShuttingDown", "Unauthenticated"]
