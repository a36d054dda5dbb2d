"""Pins: blocks kept cached, by block hash, wherever they are (every pool holding the block, and the shared tier).

A pin lives in the kvmanager's index, not on one worker: a pinned block is not evicted from any pool that holds
it nor from the shared tier, so with the tier a pinned prefix stays servable to any worker, and a block cached
again later (a worker restarted, the prefix computed elsewhere) is pinned as it is indexed.

Two kinds:

    soft       ttl_ms > 0: asked for by a request (cache_control, prompt_cache_retention) or an admin pin with a
               TTL. It lapses by itself at expires_ms, and every hit on the block pushes that to now + ttl_ms.
               A tenant's soft pins are bounded by its pin budget (fair_share.FairShare.pin_budget): a pin over
               budget is not taken, never an error (the caller sees how many tokens were pinned).
    operator   ttl_ms = 0: an admin pin without a TTL, kept until unpinned, outside any budget.

Time is the manager's ``now_ms``, an input of each call (logged with it, so a replay expires the same pins).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(slots=True)
class Pin:
    tenant: str
    ttl_ms: int  # 0: an operator's pin
    expires_ms: int  # 0 for an operator's pin


class PinTable:
    def __init__(self):
        self.pins: dict[bytes, Pin] = {}
        self.num_soft: dict[str, int] = {}  # tenant -> blocks under its soft pins
        self._due: list[tuple[int, bytes]] = []  # (expires_ms, block_hash), stale entries skipped when popped

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.pins

    def __len__(self) -> int:
        return len(self.pins)

    def __bool__(self) -> bool:
        return bool(self.pins)

    def get(self, block_hash: bytes) -> Pin | None:
        return self.pins.get(block_hash)

    def add(self, block_hash: bytes, tenant: str, ttl_ms: int, now_ms: int) -> bool:
        """Pins a block (new: True) or extends its pin (False): an operator's pin stays one, a soft pin takes the
        longer TTL and expires no earlier than now + ttl."""
        pin = self.pins.get(block_hash)
        if pin is None:
            self.pins[block_hash] = Pin(tenant, ttl_ms, now_ms + ttl_ms if ttl_ms else 0)
            if ttl_ms:
                self.num_soft[tenant] = self.num_soft.get(tenant, 0) + 1
                heapq.heappush(self._due, (now_ms + ttl_ms, block_hash))
            return True
        if not pin.ttl_ms:
            return False
        if not ttl_ms:  # an operator takes it over: it leaves the budget
            self._uncount(pin)
            pin.ttl_ms = pin.expires_ms = 0
            return False
        pin.ttl_ms = max(pin.ttl_ms, ttl_ms)
        self.refresh(block_hash, now_ms)
        return False

    def refresh(self, block_hash: bytes, now_ms: int) -> None:
        """A hit: a soft pin lasts ttl from now."""
        pin = self.pins.get(block_hash)
        if pin is not None and pin.ttl_ms and now_ms + pin.ttl_ms > pin.expires_ms:
            pin.expires_ms = now_ms + pin.ttl_ms
            heapq.heappush(self._due, (pin.expires_ms, block_hash))

    def remove(self, block_hash: bytes) -> Pin | None:
        pin = self.pins.pop(block_hash, None)
        if pin is not None:
            self._uncount(pin)
        return pin

    def expire(self, now_ms: int) -> list[bytes]:
        """Removes the soft pins due by ``now_ms``; returns their hashes, soonest first."""
        due, out = self._due, []
        while due and due[0][0] <= now_ms:
            expires_ms, h = heapq.heappop(due)
            pin = self.pins.get(h)
            if pin is not None and pin.ttl_ms and pin.expires_ms == expires_ms:
                self.remove(h)
                out.append(h)
        if len(due) > 4 * len(self.pins) + 64:  # refreshed pins leave stale entries behind: drop them
            self._due = [(p.expires_ms, h) for h, p in self.pins.items() if p.ttl_ms]
            heapq.heapify(self._due)
        return out

    def of_tenant(self, tenant: str) -> list[bytes]:
        return [h for h, p in self.pins.items() if p.tenant == tenant]

    def clear(self) -> None:
        self.pins, self.num_soft, self._due = {}, {}, []

    def load(self, items) -> None:
        """Restores pins from (block_hash, tenant, ttl_ms, expires_ms) items (a snapshot)."""
        self.clear()
        for h, tenant, ttl_ms, expires_ms in items:
            self.pins[h] = Pin(tenant, ttl_ms, expires_ms)
            if ttl_ms:
                self.num_soft[tenant] = self.num_soft.get(tenant, 0) + 1
                self._due.append((expires_ms, h))
        heapq.heapify(self._due)

    def _uncount(self, pin: Pin) -> None:
        if pin.ttl_ms:
            self.num_soft[pin.tenant] -= 1
            if not self.num_soft[pin.tenant]:
                del self.num_soft[pin.tenant]
