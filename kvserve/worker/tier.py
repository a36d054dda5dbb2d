"""The worker's shared KV tier (issue 38; design: docs/design/kv-tier.md): it copies committed pages to a Redis
store that every worker reads, and fills a request's pages from it instead of recomputing them.

The kvmanager decides which blocks to write and which pages to fill; the worker only moves bytes, each page as
one self-checking value (page_codec.py) under ``store_key(block_hash)``. On the compute thread, before a
step's forward pass:

    snapshot_writes(batch.store_writes)   one gather of the pages (a later step may reuse them), queued for the
                                          writer thread (tier_writer.py): never blocks, drops when full or down
    load({req_id: item.store_loads})      MGETs, each value verified into its pool page; the req_ids whose
                                          loads did not all succeed are not computed (the gateway recomputes)

A store error marks the store down for ``down_backoff_s``: loads then fail and writes drop with no network
call, so a dead store costs one timeout, not one per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.common.redis_client import connect, fresh_client
from kvserve.common.wire.tier import StoreLoad, StoreWrite, TierCounters, TierReport, store_key
from kvserve.worker.page_codec import PageMismatch, decode_page
from kvserve.worker.tier_writer import STORE_ERRORS, Snapshot, StoreHealth, Tally, TierReporter, TierWriter

log = logging.getLogger("kvserve.worker.tier")
STORE_TIMEOUT_S = 1.0  # a load runs on the compute thread: a hung store stalls one step this long (twice at most)
MGET_CHUNK = 32  # keys per MGET: bounds the values held at once
DEFAULT_MAX_PENDING_WRITE_BYTES = 256 << 20
DEFAULT_DOWN_BACKOFF_S = 5.0


def store_client(url: str, timeout_s: float = STORE_TIMEOUT_S) -> redis.Redis:
    """A client of the store at ``url`` (any URL kvserve/common/redis_client.py takes) whose replies are bytes, retrying
    a dropped connection once. Connects lazily: a store that is down now is only marked down when used."""
    return fresh_client(connect(url, timeout_s), decode_responses=False, retry=Retry(NoBackoff(), 1))


@dataclass(slots=True)
class _Loaded:
    """One load() call's tally."""

    num_pages: int = 0
    num_bytes: int = 0
    num_verify_failures: int = 0
    missing: list[bytes] = field(default_factory=list)


class KVTier:
    """A worker's shared KV tier over the pool ``[num_layers, 2, num_pages, page_size, kv_heads, head_dim]`` and
    its ``scales`` (or None). snapshot_writes() and load() run on the compute thread; a writer thread and a
    reporter thread (tier_writer.py) do the rest.

    ``report`` sends a TierReport to the kvmanager (it may raise). Without one (a worker without a kvmanager,
    until set_report()), writes are dropped and counted: nothing could ever record them; loads still work.
    ``epoch`` gives the worker's current epoch; ``clock`` (monotonic seconds) times the down backoff.
    """

    def __init__(self, client: redis.Redis, pool: torch.Tensor, scales: torch.Tensor | None,
                 report: Callable[[TierReport], None] | None, worker_id: str, epoch: Callable[[], int], *,
                 max_pending_write_bytes: int = DEFAULT_MAX_PENDING_WRITE_BYTES,
                 down_backoff_s: float = DEFAULT_DOWN_BACKOFF_S, clock: Callable[[], float] = time.monotonic):
        self.client, self.pool, self.scales = client, pool, scales
        self.page_bytes = _page_bytes(pool) + (_page_bytes(scales) if scales is not None else 0)
        self.tally = Tally()
        self.health = StoreHealth(down_backoff_s, clock)
        self.reporter = TierReporter(report, worker_id, epoch, self.tally)
        self.writer = TierWriter(client, self.health, self.tally, self.reporter, max_pending_write_bytes)

    def set_report(self, report: Callable[[TierReport], None] | None) -> None:
        """Reports from now on with ``report`` (the worker joined a kvmanager after the tier was made)."""
        self.reporter.report = report

    def snapshot_writes(self, writes: Sequence[StoreWrite]) -> None:
        """Copies the pages of ``writes`` (one gather; on CUDA an asynchronous copy to pinned host memory, in
        the compute stream's order) and queues them for the writer. Never blocks on the store: when there is
        no reporter, the store is down, or the queue would pass its bound in bytes, they are dropped and
        counted (num_dropped_writes). Compute thread only."""
        if not writes:
            return
        num_bytes = len(writes) * self.page_bytes
        if self.reporter.report is None or self.health.is_down() or not self.writer.reserve(num_bytes):
            self.tally.add(TierCounters(num_dropped_writes=len(writes)))
            return
        idx = torch.tensor([w.page_id for w in writes], dtype=torch.int64, device=self.pool.device)
        kv = _to_host(self.pool.index_select(2, idx))
        scales = _to_host(self.scales.index_select(2, idx)) if self.scales is not None else None
        ready = None
        if self.pool.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.writer.put(Snapshot(tuple(writes), kv, scales, ready, num_bytes))

    def load(self, loads: Mapping[str, Sequence[StoreLoad]]) -> set[str]:
        """Fills each request's pages (req_id -> its StoreLoads) from the store, each value verified
        (page_codec.decode_page) before it is copied in. Returns the req_ids whose loads did not all succeed:
        a value absent or failing verification (its block hash is reported missing), or the store failing (it
        is marked down; every request not loaded yet fails, and while it is down none tries). A page of such a
        request may be partly filled: it is that request's alone, and it is recomputed. Compute thread only."""
        failed: set[str] = set()
        if not any(loads.values()):
            return failed
        t0 = time.perf_counter()
        done = _Loaded()
        for req_id, pages in loads.items():
            if not pages:
                continue
            if self.health.is_down():
                failed.add(req_id)
                continue
            try:
                if not self._load_request(pages, done):
                    failed.add(req_id)
            except STORE_ERRORS as e:
                self.health.mark_down(e, "loading")
                failed.add(req_id)
        self.tally.add(TierCounters(num_loaded_pages=done.num_pages, num_loaded_bytes=done.num_bytes,
                                    load_s=time.perf_counter() - t0, num_failed_loads=len(failed),
                                    num_verify_failures=done.num_verify_failures))
        if done.missing:
            self.reporter.add_missing(done.missing)
        return failed

    def _load_request(self, pages: Sequence[StoreLoad], done: _Loaded) -> bool:
        """Loads one request's pages; False if any failed. After a failure the rest are only checked for presence
        (nothing more is copied in: the request is recomputed), so that every absent value of the request is
        reported at once and a store that lost its data is forgotten in one failed load per request, not one per
        page. Raises the store's errors."""
        ok = True
        for start in range(0, len(pages), MGET_CHUNK):
            chunk = pages[start:start + MGET_CHUNK]
            keys = [store_key(p.block_hash) for p in chunk]
            values = self.client.mget(keys) if ok else self._presence(keys)
            self.health.mark_up()
            for p, value in zip(chunk, values, strict=True):
                if value is None:
                    done.missing.append(p.block_hash)
                    ok = False
                elif ok:
                    ok = self._fill(p, value, done)
        return ok

    def _presence(self, keys: list[bytes]) -> list[bool | None]:
        """True for each key the store holds, None for the others (EXISTS, pipelined)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [True if n else None for n in pipe.execute()]

    def _fill(self, p: StoreLoad, value: bytes, done: _Loaded) -> bool:
        try:
            decode_page(value, p.namespace, p.block_hash, self.pool, self.scales, p.page_id)
        except PageMismatch as e:
            log.warning("kv store: the value of block %s failed verification (%s); recomputing", p.block_hash.hex(), e)
            done.missing.append(p.block_hash)
            done.num_verify_failures += 1
            return False
        done.num_pages += 1
        done.num_bytes += len(value)
        return True

    def stats(self) -> TierCounters:
        """The counters since the tier was made (cumulative: for metrics)."""
        return self.tally.total()

    def flush(self, timeout_s: float) -> bool:
        """Waits until every write queued so far is written (or dropped) and reported (or dropped), with the
        counters; True when that happened within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return self.writer.wait_idle(deadline) and self.reporter.flush(deadline)

    def close(self) -> None:
        """Stops the threads (writes still queued are dropped: flush() first to keep them) and the client."""
        self.writer.close()
        self.reporter.close()
        self.client.close()


def _page_bytes(t: torch.Tensor) -> int:
    return t[:, :, 0].numel() * t.element_size()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A gathered snapshot in host memory: itself on the CPU; on CUDA a pinned copy, asynchronous."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
