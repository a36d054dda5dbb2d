"""Bearer credentials, as every transport carries them (gRPC metadata, an HTTP header)."""

from __future__ import annotations


def bearer_token(authorization: str) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value; None when it is not one."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()
