"""The clients' retry policy, kept pure: capped exponential backoff with full jitter, bounded by a deadline.

Only UNAVAILABLE is retried (the gateway is unreachable or shutting down, so the request never started); every
other status is the request's answer. Deadlines are ``time.monotonic()`` values.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to wait before calling again after UNAVAILABLE.

    Attributes:
        max_attempts: most calls in all, the first included (1 disables retries).
        initial_backoff_s: backoff ceiling after the first failed attempt.
        max_backoff_s: backoff ceiling never exceeded.
        multiplier: growth of the ceiling per failed attempt.

    Raises:
        ValueError: on construction, for max_attempts < 1, a negative backoff, max_backoff_s < initial_backoff_s
            or multiplier < 1.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0.0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s, got "
                             f"{self.initial_backoff_s} and {self.max_backoff_s}")
        if self.multiplier < 1.0:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def ceiling_s(self, attempt: int) -> float:
        """The backoff ceiling after failed attempt number ``attempt`` (1-based), before jitter."""
        try:
            return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(attempt - 1, 0))
        except OverflowError:  # a huge attempt number: the ceiling is long capped
            return self.max_backoff_s

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after failed attempt number ``attempt`` (1-based): uniform in [0, ceiling_s(attempt)].

        Args:
            attempt: how many attempts have failed so far.
            rng: the randomness (tests inject a seeded one); None uses the ``random`` module's.

        Returns:
            Seconds to wait before the next attempt.
        """
        draw = rng.random() if rng is not None else random.random()
        return draw * self.ceiling_s(attempt)


def is_retryable(code: grpc.StatusCode) -> bool:
    """Whether a call that failed with ``code`` may be sent again: only UNAVAILABLE."""
    return code == grpc.StatusCode.UNAVAILABLE


def fits_before(deadline: float, wait_s: float, now: float | None = None) -> bool:
    """Whether a wait of ``wait_s`` starting at ``now`` (default ``time.monotonic()``) ends before ``deadline``."""
    start = time.monotonic() if now is None else now
    return start + wait_s < deadline


def retry_wait_s(policy: RetryPolicy, attempt: int, code: grpc.StatusCode, deadline: float,
                 rng: random.Random | None = None, now: float | None = None) -> float | None:
    """How long to wait before retrying, or None when the failure must be raised.

    Args:
        policy: the retry policy.
        attempt: how many attempts have failed so far (1-based).
        code: the status code of the last failure.
        deadline: the call's deadline (``time.monotonic()`` based).
        rng: the randomness for the jitter.
        now: the current ``time.monotonic()`` value (tests inject it).

    Returns:
        Seconds to wait, when the code is retryable, attempts remain, and the wait ends before the deadline;
        None otherwise.
    """
    if not is_retryable(code) or attempt >= policy.max_attempts:
        return None
    wait_s = policy.backoff_s(attempt, rng)
    return wait_s if fits_before(deadline, wait_s, now) else None
