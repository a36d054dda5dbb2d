"""Closed-loop greedy load for the chaos run: N clients of the SDK, each streaming one request at a time (the
next as soon as the previous ended), cycling over a fixed set of prompts given as token ids, greedy, ignore_eos.

Every request ends as an Outcome (its token ids, or the error that ended it). The load can be paused (no new
request starts; the running ones finish) so that a phase's pages can be counted with nothing in flight, and a
phase waits for a number of ended requests instead of sleeping.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.services.client import Client

JOIN_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Outcome:
    client: int
    prompt: int  # index into the prompts
    start_s: float  # time.monotonic()
    end_s: float
    token_ids: tuple[int, ...]
    finish_reason: str | None
    error: str | None  # why the request failed; None when it ended normally
    req_id: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason == "length"


@dataclass(slots=True)
class InFlight:
    client: int
    start_s: float
    req_id: str | None = None  # known from the first delta on
    num_tokens: int = 0  # streamed so far


class ClosedLoop:
    """``num_clients`` threads over one SDK client of the gateway at ``address``. Starts paused: resume()."""

    def __init__(self, address: str, prompts: Sequence[Sequence[int]], num_clients: int, max_tokens: int,
                 request_timeout_s: float):
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.client = Client(address, timeout_s=request_timeout_s)
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, InFlight] = {}
        self._cv = threading.Condition()
        self._running = False
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"chaos-client-{i}", daemon=True)
                         for i in range(num_clients)]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        for k in itertools.count():
            with self._cv:
                while not (self._running or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
                self.in_flight[i] = InFlight(i, time.monotonic())
            outcome = self._one(i, (i + k) % len(self.prompts))
            with self._cv:
                self.outcomes.append(outcome)
                del self.in_flight[i]
                self._cv.notify_all()

    def _one(self, i: int, prompt: int) -> Outcome:
        start = self.in_flight[i].start_s
        token_ids: list[int] = []
        finish_reason = error = req_id = None
        try:
            for delta in self.client.generate(prompt_token_ids=self.prompts[prompt], max_tokens=self.max_tokens,
                                              temperature=0.0, ignore_eos=True):
                token_ids += delta.token_ids
                flight = self.in_flight[i]
                req_id = flight.req_id = delta.req_id
                flight.num_tokens = len(token_ids)
                finish_reason = delta.finish_reason or finish_reason
        except Exception as e:  # noqa: BLE001 - any failure is this request's outcome: lost
            error = f"{type(e).__name__}: {e}"
        return Outcome(i, prompt, start, time.monotonic(), tuple(token_ids), finish_reason, error, req_id)

    # -- control ------------------------------------------------------------------------------------------
    def resume(self) -> None:
        with self._cv:
            self._running = True
            self._cv.notify_all()

    def pause(self, deadline: float) -> bool:
        """No new request starts; waits until none is in flight (True) or the deadline passes (False)."""
        with self._cv:
            self._running = False
            return self._cv.wait_for(lambda: not self.in_flight, timeout=max(0.0, deadline - time.monotonic()))

    def wait_ended(self, n: int, since: float, deadline: float) -> int:
        """Waits until ``n`` requests that started at or after ``since`` have ended (or the deadline); returns how
        many have."""
        def count() -> int:
            return sum(o.start_s >= since for o in self.outcomes)

        with self._cv:
            self._cv.wait_for(lambda: count() >= n, timeout=max(0.0, deadline - time.monotonic()))
            return count()

    def wait_finished(self, flights: Sequence[InFlight], deadline: float) -> float | None:
        """Waits until the requests ``flights`` names have ended; the last one's end, or None at the deadline."""
        keys = {(f.client, f.start_s) for f in flights}

        def ends() -> list[float]:
            return [o.end_s for o in self.outcomes if (o.client, o.start_s) in keys]

        with self._cv:
            if not self._cv.wait_for(lambda: len(ends()) == len(keys), timeout=max(0.0, deadline - time.monotonic())):
                return None
            return max(ends(), default=time.monotonic())

    def snapshot_in_flight(self) -> list[InFlight]:
        with self._cv:
            return [InFlight(f.client, f.start_s, f.req_id, f.num_tokens) for f in self.in_flight.values()]

    def outcomes_between(self, start_s: float, end_s: float) -> list[Outcome]:
        """The requests that started in [start_s, end_s)."""
        with self._cv:
            return [o for o in self.outcomes if start_s <= o.start_s < end_s]

    def close(self) -> None:
        """Stops the clients: requests still running are cancelled (the channel closes)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.client.close()
        for t in self._threads:
            t.join(JOIN_TIMEOUT_S)
