"""The costs an engine measures on its worker, for the kvmanager's per-request choice between loading a prefix
from the shared KV tier and recomputing it (placement.worth_loading): seconds to load one page, seconds to
prefill one token, each an exponential moving average of the worker's own steps. While either is unmeasured
the kvmanager loads, which measures it. After a step in which loads failed (the store down, a value damaged),
allocations skip the store for BACKOFF_S, so that a store that is down costs one failed load, not one per
request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

ALPHA = 0.2  # weight of the newest measurement
BACKOFF_S = 5.0
MIN_PREFILL_TOKENS = 64  # a step measures the prefill rate only if it computed this many prompt tokens...
MIN_PREFILL_SHARE = 0.9  # ... and they were nearly all its tokens (decode tokens cost more each)


@dataclass(slots=True)
class TierRates:
    load_s_per_page: float = 0.0
    pull_s_per_page: float = 0.0  # from another worker's pool (transfers)
    prefill_s_per_token: float = 0.0
    skip_until: float = 0.0
    clock: object = field(default=time.monotonic, repr=False)

    def loaded(self, num_pages: int, load_ms: float) -> None:
        if num_pages > 0:
            self.load_s_per_page = _average(self.load_s_per_page, load_ms / 1000 / num_pages)

    def pulled(self, num_pages: int, seconds: float) -> None:
        if num_pages > 0:
            self.pull_s_per_page = _average(self.pull_s_per_page, seconds / num_pages)

    def computed(self, num_prefill_tokens: int, num_tokens: int, compute_ms: float) -> None:
        """A step's forward pass (its loads left out): prefill tokens among its tokens."""
        if num_prefill_tokens >= MIN_PREFILL_TOKENS and num_prefill_tokens >= MIN_PREFILL_SHARE * num_tokens:
            self.prefill_s_per_token = _average(self.prefill_s_per_token, compute_ms / 1000 / num_tokens)

    def load_failed(self) -> None:
        self.skip_until = self.clock() + BACKOFF_S

    @property
    def skip_store(self) -> bool:
        return self.clock() < self.skip_until


def _average(old: float, new: float) -> float:
    return new if old <= 0 else (1 - ALPHA) * old + ALPHA * new
