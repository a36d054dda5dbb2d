"""Waiting for a condition in tests: polled under a deadline, never slept on as synchronisation."""

from __future__ import annotations

import time

INTERVAL_S = 0.05


def wait_for(condition, what: str = "the condition", timeout_s: float = 30.0):
    """condition()'s first truthy value, polled every INTERVAL_S until ``timeout_s`` passes; AssertionError
    naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(INTERVAL_S)  # polling a condition under a deadline
    return value
