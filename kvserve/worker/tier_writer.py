"""The shared KV tier's background half (kvserve/worker/tier.py is the compute thread's): the writer thread, which
sends snapshots of committed pages to the store, and the reporter thread, which tells the kvmanager what landed.
Also what they share with the compute thread: the counters (Tally) and the store's health (StoreHealth).

    compute thread ──snapshot──▶ TierWriter queue ──SET (pipelined)──▶ store ──acknowledged──▶ TierReporter
                                 (bounded in bytes)                                             │ ReportTier
    load() ──missing block hashes, counters──────────────────────────────────────────────────▶ kvmanager

A block is reported as written only once the store acknowledged its value (bytes before metadata). Neither
thread ever blocks the compute thread: a full queue, a down store or a failing kvmanager drop work and count it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
import torch

from kvserve.common.wire.tier import StoredBlock, StoreWrite, TierCounters, TierReport, store_key
from kvserve.worker.page_codec import encode_page

log = logging.getLogger("kvserve.worker.tier")
WRITE_CHUNK = 32  # pages per pipelined SET: bounds the encoded values held at once
REPORT_TRIES = 3
FIRST_RETRY_S = 0.05
MAX_RETRY_S = 1.0
MAX_REPORT_BLOCKS = 4096  # written entries per report (a bounded message)
COUNTERS_EVERY_S = 5.0  # counters alone (loads, drops) are reported at most this long after they changed
STORE_ERRORS = (redis.RedisError, OSError)


class Tally:
    """Cumulative counters (stats) and the part not yet reported (deltas for the next report). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = TierCounters()
        self._unreported = TierCounters()

    def add(self, counters: TierCounters) -> None:
        with self._lock:
            self._total += counters
            self._unreported += counters

    def total(self) -> TierCounters:
        return self._total

    def take(self) -> TierCounters:
        with self._lock:
            taken, self._unreported = self._unreported, TierCounters()
            return taken

    def give_back(self, counters: TierCounters) -> None:
        """Counters of a report that could not be sent: they go in a later one."""
        with self._lock:
            self._unreported += counters

    def unreported(self) -> TierCounters:
        return self._unreported


class StoreHealth:
    """Whether the store is marked down: for ``backoff_s`` after an error, loads fail and writes drop without a
    network call. ``clock``: seconds, monotonic (injected in tests)."""

    def __init__(self, backoff_s: float, clock: Callable[[], float]):
        self.backoff_s = backoff_s
        self.clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None

    def is_down(self) -> bool:
        until = self._down_until
        return until is not None and self.clock() < until

    def mark_down(self, error: BaseException, doing: str) -> None:
        with self._lock:
            was_down, self._down_until = self.is_down(), self.clock() + self.backoff_s
        if not was_down:
            log.warning("kv store: %s failed (%s: %s); for %.1fs writes are dropped and loads fail", doing,
                        type(error).__name__, error, self.backoff_s)

    def mark_up(self) -> None:
        if self._down_until is not None:
            with self._lock:
                self._down_until = None
            log.info("kv store answers again")


@dataclass(slots=True)
class Snapshot:
    """The bytes of a step's store writes, copied before the step computed."""

    writes: Sequence[StoreWrite]
    kv: torch.Tensor  # [num_layers, 2, len(writes), page_size, num_kv_heads, head_dim], host memory
    scales: torch.Tensor | None  # [num_layers, 2, len(writes), page_size, num_kv_heads] or None
    ready: torch.cuda.Event | None  # CUDA: recorded after the copies to host; None: they are done
    num_bytes: int


class TierReporter:
    """Batches written blocks, missing block hashes and the counters into TierReports and sends them with
    ``report`` on a thread of its own, woken by a Condition. A report that fails REPORT_TRIES times (capped
    backoff) is dropped, its counters kept for the next one. ``report`` None: nothing is ever sent."""

    def __init__(self, report: Callable[[TierReport], None] | None, worker_id: str, epoch: Callable[[], int],
                 tally: Tally):
        self.report = report
        self.worker_id, self.epoch, self.tally = worker_id, epoch, tally
        self._cond = threading.Condition()
        self._written: list[StoredBlock] = []
        self._missing: list[bytes] = []
        self._requested = self._done = 0  # flush requests, and the last one answered
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-tier-report", daemon=True)
        self._thread.start()

    def add_written(self, blocks: list[StoredBlock]) -> None:
        with self._cond:
            self._written += blocks
            self._cond.notify_all()

    def add_missing(self, block_hashes: list[bytes]) -> None:
        if self.report is None:
            return
        with self._cond:
            self._missing += block_hashes
            self._cond.notify_all()

    def flush(self, deadline: float) -> bool:
        """Sends everything pending now (counters too); True once sent or dropped, False at ``deadline``."""
        if self.report is None:
            return True
        with self._cond:
            self._requested += 1
            target = self._requested
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._done >= target, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()

    def _has_work(self) -> bool:
        return bool(self._written or self._missing or self._requested > self._done or self._stopping.is_set())

    def _run(self) -> None:
        while True:
            with self._cond:
                woke = self._cond.wait_for(self._has_work, COUNTERS_EVERY_S)
                if self._stopping.is_set():
                    return
                if self.report is None or (not woke and self.tally.unreported().empty()):
                    continue
                written, self._written = self._written[:MAX_REPORT_BLOCKS], self._written[MAX_REPORT_BLOCKS:]
                missing, self._missing = self._missing, []
                target = self._requested if not self._written else self._done
            report = TierReport(self.worker_id, self.epoch(), tuple(written), tuple(missing), self.tally.take())
            if not report.empty() and not self._send(report):
                self.tally.give_back(report.counters)
            with self._cond:
                self._done = max(self._done, target)
                self._cond.notify_all()

    def _send(self, report: TierReport) -> bool:
        backoff_s = FIRST_RETRY_S
        for attempt in range(REPORT_TRIES):
            try:
                self.report(report)
                return True
            except Exception as e:  # any failure of the kvmanager's call: retried, then dropped
                error = e
            if attempt + 1 < REPORT_TRIES and self._stopping.wait(backoff_s):
                break
            backoff_s = min(2 * backoff_s, MAX_RETRY_S)
        log.warning("kv store: could not report %d written and %d missing blocks to the kvmanager (%s: %s); "
                    "dropped (the values stay in the store unrecorded)", len(report.written), len(report.missing),
                    type(error).__name__, error)
        return False


class TierWriter:
    """Writes snapshots to the store on a thread of its own, in order; a store error drops the snapshot
    (counted) and marks the store down. At most ``max_pending_bytes`` of snapshots wait."""

    def __init__(self, client: redis.Redis, health: StoreHealth, tally: Tally, reporter: TierReporter,
                 max_pending_bytes: int):
        self.client, self.health, self.tally, self.reporter = client, health, tally, reporter
        self.max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._queue: deque[Snapshot] = deque()
        self._pending_bytes = 0  # reserved: queued, or being written
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvserve-tier-write", daemon=True)
        self._thread.start()

    def reserve(self, num_bytes: int) -> bool:
        """Room for a snapshot of ``num_bytes`` (then put() it), or False: the queue is full."""
        with self._cond:
            if self._pending_bytes + num_bytes > self.max_pending_bytes:
                return False
            self._pending_bytes += num_bytes
            return True

    def put(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._queue.append(snapshot)
            self._cond.notify_all()

    def wait_idle(self, deadline: float) -> bool:
        """True once every snapshot put so far is written (or dropped); False at ``deadline``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_bytes == 0, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stops after the snapshot being written; those still queued are dropped (counted)."""
        with self._cond:
            self._stopping = True
            dropped = sum(len(s.writes) for s in self._queue)
            self._pending_bytes -= sum(s.num_bytes for s in self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self.tally.add(TierCounters(num_dropped_writes=dropped))
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                snapshot = self._queue.popleft()
            try:
                self._write(snapshot)
            finally:
                with self._cond:
                    self._pending_bytes -= snapshot.num_bytes
                    self._cond.notify_all()

    def _write(self, s: Snapshot) -> None:
        if s.ready is not None:
            s.ready.synchronize()
        for start in range(0, len(s.writes), WRITE_CHUNK):
            if self.health.is_down():
                self.tally.add(TierCounters(num_dropped_writes=len(s.writes) - start))
                return
            chunk = s.writes[start:start + WRITE_CHUNK]
            values = [encode_page(w.namespace, w.block_hash, s.kv, s.scales, start + i) for i, w in enumerate(chunk)]
            try:
                pipe = self.client.pipeline(transaction=False)
                for w, value in zip(chunk, values, strict=True):
                    pipe.set(store_key(w.block_hash), value)
                pipe.execute()
            except STORE_ERRORS as e:
                self.health.mark_down(e, "writing")
                self.tally.add(TierCounters(num_dropped_writes=len(s.writes) - start))
                return
            self.health.mark_up()
            blocks = [StoredBlock(w.block_hash, w.tenant, len(v)) for w, v in zip(chunk, values, strict=True)]
            self.tally.add(TierCounters(num_written_pages=len(blocks), num_written_bytes=sum(map(len, values))))
            self.reporter.add_written(blocks)
