"""Placement affinity (OpenAI's ``prompt_cache_key``): the requests of one tenant that name one key go to the
worker the first of them was placed on, while that worker has room, so that the prefix they share (a system
prompt, a long document, a conversation) stays on one pool, where each of them hits it, instead of being
computed again on every worker that cache-aware placement's load balancing would pick for a different prompt.

    (tenant, cache_key) -> worker_id      bounded, least recently used first out

Keys are the tenant's own: the map's key holds the tenant, so one tenant's key never steers another tenant's
requests. Nothing is forgotten but by the bound: a worker that left or drains is simply not among the ones
taking new requests, and the next request of its key is placed as any other and remembered anew.

Room: the remembered worker takes new requests (it is among ``num_queued``'s workers: not draining, not
retiring) and has at most ``room_slack`` more requests queued (admitted nowhere yet, waiting for pages) than the
least queued one. Running requests are not counted: a worker batches them at iteration level, and one that
cannot admit more (out of pages or sequences) shows it as a queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

MAX_ENTRIES = 10_000
ROOM_SLACK = 2  # queued requests past the least queued worker's that the remembered one may have


def has_room(worker_id: str, num_queued: Mapping[str, int], room_slack: int = ROOM_SLACK) -> bool:
    """Whether ``worker_id`` is among the workers taking new requests (``num_queued``: their queued requests,
    by worker_id) and is queued at most ``room_slack`` deeper than the least queued of them."""
    return worker_id in num_queued and num_queued[worker_id] <= min(num_queued.values()) + room_slack


class Affinity:
    """The map of (tenant, cache_key) -> worker_id. Not thread-safe: the gateway calls it under its lock."""

    def __init__(self, max_entries: int = MAX_ENTRIES, room_slack: int = ROOM_SLACK):
        assert max_entries > 0 and room_slack >= 0
        self.max_entries, self.room_slack = max_entries, room_slack
        self._worker_ids: OrderedDict[tuple[str, str], str] = OrderedDict()  # first = least recently used

    def __len__(self) -> int:
        return len(self._worker_ids)

    def worker_for(self, tenant: str, cache_key: str, num_queued: Mapping[str, int]) -> str | None:
        """The worker remembered for the tenant's key if it has room among ``num_queued`` (the workers taking
        new requests, by worker_id, with their queued requests); None when none is remembered or it has no
        room. A key found becomes the most recently used."""
        key = (tenant, cache_key)
        worker_id = self._worker_ids.get(key)
        if worker_id is None:
            return None
        self._worker_ids.move_to_end(key)
        return worker_id if has_room(worker_id, num_queued, self.room_slack) else None

    def remember(self, tenant: str, cache_key: str, worker_id: str) -> None:
        """Remembers where the tenant's key was placed, forgetting the least recently used key past the bound."""
        key = (tenant, cache_key)
        self._worker_ids[key] = worker_id
        self._worker_ids.move_to_end(key)
        if len(self._worker_ids) > self.max_entries:
            self._worker_ids.popitem(last=False)
