"""API key -> tenant, server-side. A client never names its own cache namespace: the tenant is whatever its
key maps to. Without keys (dev mode) every call is the default tenant."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.common.credentials import bearer_token
from kvserve.common.errors import Unauthenticated

DEV_TENANT = "default"


@dataclass(frozen=True, slots=True)
class ApiKeys:
    keys: tuple[tuple[str, str], ...] = ()  # (api key, tenant); empty = dev mode

    @property
    def dev_mode(self) -> bool:
        return not self.keys

    def tenant_for(self, metadata: dict[str, str]) -> str:
        """The tenant of a call's ``authorization: Bearer <key>`` metadata, or else of its ``x-api-key`` (how
        Anthropic's clients send the key). Raises Unauthenticated."""
        if self.dev_mode:
            return DEV_TENANT
        key = bearer_token(metadata.get("authorization", "")) or metadata.get("x-api-key", "").strip() or None
        if key is None:
            raise Unauthenticated("missing API key: send metadata 'authorization: Bearer <api key>' or "
                                  "'x-api-key: <api key>'")
        for known, tenant in self.keys:
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise Unauthenticated("unknown API key")


def parse_keys(text: str) -> ApiKeys:
    """Keys from a JSON object {"key": "tenant", ...} or from lines / commas of ``key=tenant``."""
    text = text.strip()
    if not text:
        return ApiKeys()
    if text.startswith("{"):
        pairs = list(json.loads(text).items())
    else:
        entries = [e.strip() for line in text.splitlines() for e in line.split(",")]
        pairs = [tuple(p.strip() for p in e.split("=", 1)) for e in entries if e and not e.startswith("#")]
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
            raise ValueError(f"bad API key entry {pair!r}: expected key=tenant with both non-empty")
    return ApiKeys(tuple(pairs))


def load_keys(path: Path | None, env_value: str | None) -> ApiKeys:
    """--api-keys-file wins over KVSERVE_API_KEYS; neither = dev mode."""
    if path is not None:
        return parse_keys(Path(path).read_text())
    return parse_keys(env_value or "")
