"""Pages that move between workers (issue 40; docs/features/transfers.md): a worker serves its committed pages to
a peer of a compatible pool, and fills pages of its own from a peer, each page one self-checking value
(page_codec.py: namespace, block hash, layout, checksum).

    receiver: pull(PullOrder)                              source: read(ReadOrder)
      check: its epoch, the loads ──reader.read(address, ReadOrder)──▶ check: its epoch, the lease, the pages
                                                                      frames of ~FRAME_BYTES (at least a page),
      each value verified, then copied into ◀──────────────────────── the epoch and lease checked before each
      loads[i].page_id; PullResult (error set: the request recomputes)

The kvmanager holds the source's pages (ref_cnt) until ``lease_expires_ms``; the source sends nothing once less
than LEASE_MARGIN_MS of it is left, since a page past its lease may be reused. The receiver's pages belong to the
request alone until the gateway schedules it, so a pull that fails halfway leaves partly filled pages that nobody
reads: the request recomputes them. No page of a failed pull is ever served.

Transport-free: a ``PageReader`` carries the frames (kvserve/worker/peer_client.py over gRPC; an RDMA reader could
replace it). Both sides run on gRPC threads beside the compute thread: the pages they touch are committed pages
(never written while the kvmanager holds them) and pages of a request not yet scheduled, and on the CPU the bytes
move through numpy (page_codec.py), so no OpenMP team is started beside the compute thread's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.common.errors import FailedPrecondition, InvalidRequest, StaleEpoch
from kvserve.common.wire.transfer import FRAME_BYTES, LEASE_MARGIN_MS, PeerLoad, PullOrder, PullResult, ReadOrder
from kvserve.worker.page_codec import PageMismatch, decode_page, encode_page, value_size

MAX_PULL_S = 60.0  # a pull's deadline: the lease's time left, at most this
MAX_PULLS = 8  # pulls at once on one worker; one more is refused (the request recomputes), never queued
DIGEST_BYTES = 16


class TransferFailed(Exception):
    """What a PageReader raises when the source or the link fails (the message says which and how)."""


class LeaseOver(FailedPrecondition):
    """A read whose lease has less than LEASE_MARGIN_MS left: its pages may be reused, and are not sent."""


class PageReader(Protocol):
    """The link to a source worker."""

    def read(self, address: str, order: ReadOrder, timeout_s: float, traceparent: str = ""
             ) -> Iterable[Sequence[bytes]]:
        """The frames the source at ``address`` answers ``order`` with: page values in the order asked for.
        Raises TransferFailed, while iterating, when the source refuses, fails or is not there, or
        ``timeout_s`` passes."""
        ...


@dataclass(slots=True)
class TransferCounters:
    """A worker's transfers since it started: pulls it made, reads it served (for metrics and logs)."""

    num_pulls_ok: int = 0
    num_pulls_failed: int = 0  # the source failed, refused or sent a page that did not verify: recomputed
    num_pulled_pages: int = 0  # verified and filled (a failed pull's first pages included)
    num_pulled_bytes: int = 0  # of those pages' values
    pull_s: float = 0.0  # wall time of every pull
    num_served_pages: int = 0
    num_served_bytes: int = 0
    num_refused_reads: int = 0  # another epoch, a lease (nearly) over, malformed pages

    def __add__(self, other: TransferCounters) -> TransferCounters:
        return TransferCounters(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                                         strict=True)))


class _Tally:
    """TransferCounters added from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = TransferCounters()

    def add(self, counters: TransferCounters) -> None:
        with self._lock:
            self._total += counters

    def total(self) -> TransferCounters:
        return self._total


def _wall_ms() -> float:
    return time.time() * 1000


class PeerTransfers:
    """One worker's page transfers over its pool ``[num_layers, 2, num_pages, page_size, kv_heads, head_dim]`` and
    its ``scales`` (or None). ``epoch`` gives the worker's incarnation now; ``reader`` is the link to sources
    (None: pulls fail, reads are still served). ``written_on``: on CUDA, the stream the pool is written on (the
    compute thread's): a read waits for what it has queued. ``wall_ms``: the wall clock leases are judged by.
    ``unavailable``: why this worker's pages never move (a worker with page groups, whose sliding layers' pages
    are not in ``pool``): every read is refused and every pull fails with it (the request recomputes)."""

    def __init__(self, pool: torch.Tensor, scales: torch.Tensor | None, epoch: Callable[[], int],
                 reader: PageReader | None = None, *, written_on=None, frame_bytes: int = FRAME_BYTES,
                 max_pulls: int = MAX_PULLS, wall_ms: Callable[[], float] = _wall_ms, unavailable: str = ""):
        self.pool, self.scales, self.epoch, self.reader = pool, scales, epoch, reader
        self.unavailable = unavailable
        self.num_pages = pool.shape[2]
        self.value_bytes = value_size(pool, scales)
        self.pages_per_frame = max(1, frame_bytes // self.value_bytes)
        self.written_on = written_on
        self.wall_ms = wall_ms
        self.max_pulls = max_pulls
        self.tally = _Tally()
        self._slots = threading.BoundedSemaphore(max_pulls)

    def stats(self) -> TransferCounters:
        return self.tally.total()

    # -- the source ------------------------------------------------------------------------------------------
    def read(self, order: ReadOrder) -> Iterator[list[bytes]]:
        """The frames of ``order``'s pages: lists of page values, in the order asked, each list up to about
        FRAME_BYTES (at least one value). Raises StaleEpoch (another incarnation), LeaseOver (less than
        LEASE_MARGIN_MS of the lease left) or InvalidRequest (a page id out of range, a hash not 16 bytes) before
        the first frame; StaleEpoch or LeaseOver again from the iterator when either happens mid-stream."""
        try:
            if self.unavailable:
                raise FailedPrecondition(f"this worker serves no pages: {self.unavailable}")
            self._check_live(order)
            self._check_pages(order)
        except (FailedPrecondition, InvalidRequest):
            self.tally.add(TransferCounters(num_refused_reads=1))
            raise
        return self._frames(order)

    def _check_live(self, order: ReadOrder) -> None:
        if order.epoch != self.epoch():
            raise StaleEpoch(f"read of pages of epoch {order.epoch}, but this worker is epoch {self.epoch()}")
        left_ms = order.lease_expires_ms - self.wall_ms()
        if left_ms < LEASE_MARGIN_MS:
            raise LeaseOver(f"the pages' lease has {left_ms:.0f} ms left, under the {LEASE_MARGIN_MS} ms margin: "
                            "they may be reused, and are not sent")

    def _check_pages(self, order: ReadOrder) -> None:
        for i, (src_page_id, block_hash, namespace) in enumerate(order.pages):
            if not 0 <= src_page_id < self.num_pages:
                raise InvalidRequest(f"pages[{i}].src_page_id {src_page_id} is out of range [0, {self.num_pages})",
                                     param="pages")
            if len(block_hash) != DIGEST_BYTES or len(namespace) != DIGEST_BYTES:
                raise InvalidRequest(f"pages[{i}]: block_hash and namespace are {DIGEST_BYTES} bytes, got "
                                     f"{len(block_hash)} and {len(namespace)}", param="pages")

    def _frames(self, order: ReadOrder) -> Iterator[list[bytes]]:
        for start in range(0, len(order.pages), self.pages_per_frame):
            try:
                self._check_live(order)
            except FailedPrecondition:
                self.tally.add(TransferCounters(num_refused_reads=1))
                raise
            frame = self._encode(order.pages[start:start + self.pages_per_frame])
            self.tally.add(TransferCounters(num_served_pages=len(frame), num_served_bytes=sum(map(len, frame))))
            yield frame

    def _encode(self, pages: Sequence[tuple[int, bytes, bytes]]) -> list[bytes]:
        """The pages' values. On CUDA one gather of the frame's pages copied to the host (after the compute
        stream's queued work: that synchronises this thread's stream); on the CPU straight from the pool."""
        if self.pool.device.type != "cuda":
            return [encode_page(ns, bh, self.pool, self.scales, page_id) for page_id, bh, ns in pages]
        self._after_compute()
        idx = torch.tensor([p[0] for p in pages], dtype=torch.int64, device=self.pool.device)
        kv = self.pool.index_select(2, idx).cpu()
        scales = self.scales.index_select(2, idx).cpu() if self.scales is not None else None
        return [encode_page(ns, bh, kv, scales, k) for k, (_, bh, ns) in enumerate(pages)]

    def _after_compute(self) -> None:
        """On CUDA: this thread's stream runs after what the compute stream has queued (a step still writing a
        page, e.g. of a request aborted mid-prefill whose pages were handed on)."""
        if self.pool.device.type == "cuda" and self.written_on is not None:
            torch.cuda.current_stream(self.pool.device).wait_stream(self.written_on)

    # -- the receiver ----------------------------------------------------------------------------------------
    def pull(self, order: PullOrder, wanted: Callable[[], bool] = lambda: True) -> PullResult:
        """Fills ``order.loads``' pages from the source, each value verified (namespace, block hash, layout,
        checksum) before it is copied in; ``wanted`` is asked before each page (False: the caller went away, e.g.
        the request was aborted, and no more page is written).

        Raises StaleEpoch when ``order.epoch`` is not this incarnation and InvalidRequest for a malformed order
        (no loads, no source address, a page id out of range or twice, a hash not 16 bytes): nothing is read
        then. Every failure of the source or the link (refused, gone, timed out, a stream cut short or too long,
        a value that does not verify), a new epoch or ``wanted`` False mid-pull, and a pull past ``max_pulls`` at
        once, is an answer with ``error`` set: the request recomputes. Its pages may be partly filled then."""
        self._check_order(order)
        t0 = time.perf_counter()
        if self.unavailable:
            result = PullResult(error=f"this worker pulls no pages: {self.unavailable}")
        elif self.reader is None:
            result = PullResult(error="this worker has no transport to pull pages with")
        elif not self._slots.acquire(blocking=False):
            result = PullResult(error=f"{self.max_pulls} pulls are running on this worker already")
        else:
            try:
                result = self._pull(order, wanted)
            finally:
                self._slots.release()
        result = dataclasses.replace(result, seconds=time.perf_counter() - t0)
        self.tally.add(TransferCounters(num_pulls_ok=int(result.ok), num_pulls_failed=int(not result.ok),
                                        num_pulled_pages=result.num_pages, num_pulled_bytes=result.num_bytes,
                                        pull_s=result.seconds))
        return result

    def _check_order(self, order: PullOrder) -> None:
        if order.epoch != self.epoch():
            raise StaleEpoch(f"pull for epoch {order.epoch}, but this worker is epoch {self.epoch()}",
                             req_id=order.req_id)
        if not order.loads or not order.source_address:
            raise InvalidRequest(f"pull of {order.req_id!r}: no loads or no source address", param="loads",
                                 req_id=order.req_id)
        seen: set[int] = set()
        for i, load in enumerate(order.loads):
            problem = _load_problem(load, self.num_pages, seen)
            if problem:
                raise InvalidRequest(f"pull of {order.req_id!r}: loads[{i}]: {problem}", param="loads",
                                     req_id=order.req_id)
            seen.add(load.page_id)

    def _pull(self, order: PullOrder, wanted: Callable[[], bool]) -> PullResult:
        left_s = (order.lease_expires_ms - self.wall_ms()) / 1000
        if left_s <= 0:
            return PullResult(error=f"the source's lease was over {-left_s:.1f}s before the pull began")
        read = ReadOrder(order.source_epoch, order.lease_expires_ms,
                         tuple((x.src_page_id, x.block_hash, x.namespace) for x in order.loads))
        filled = _Filled()
        self._after_compute()
        frames = self.reader.read(order.source_address, read, min(MAX_PULL_S, left_s), order.traceparent)
        try:
            for frame in frames:
                for value in frame:
                    self._fill(order, value, filled, wanted)
            if filled.num_pages < len(order.loads):
                raise TransferFailed(f"the stream ended after {filled.num_pages} of {len(order.loads)} pages")
        except TransferFailed as e:
            filled.error = f"source {order.source_worker_id} ({order.source_address}): {e}"
        except PageMismatch as e:
            load = order.loads[filled.num_pages]
            filled.error = (f"source {order.source_worker_id} ({order.source_address}): the value of page "
                            f"{load.src_page_id} (block {load.block_hash.hex()}) failed verification: {e}")
        finally:
            close = getattr(frames, "close", None)
            if close is not None:  # stop the stream when we stopped reading it
                close()
            if self.pool.device.type == "cuda":
                torch.cuda.current_stream(self.pool.device).synchronize()
        return PullResult(filled.num_pages, filled.num_bytes, 0.0, filled.error)

    def _fill(self, order: PullOrder, value: bytes, filled: _Filled, wanted: Callable[[], bool]) -> None:
        """Copies the next value into its page once verified; raises TransferFailed or PageMismatch."""
        if filled.num_pages == len(order.loads):
            raise TransferFailed(f"the source sent more than the {len(order.loads)} pages asked for")
        # the pages may be someone else's now: write none of them
        if self.epoch() != order.epoch:
            raise TransferFailed(f"this worker became epoch {self.epoch()} during the pull")
        if not wanted():
            raise TransferFailed("the pull's caller went away")
        load = order.loads[filled.num_pages]
        decode_page(value, load.namespace, load.block_hash, self.pool, self.scales, load.page_id)
        filled.num_pages += 1
        filled.num_bytes += len(value)


@dataclass(slots=True)
class _Filled:
    """One pull's progress."""

    num_pages: int = 0
    num_bytes: int = 0
    error: str = ""


def _load_problem(load: PeerLoad, num_pages: int, seen: set[int]) -> str:
    """What is wrong with one load of a pull ("" when nothing)."""
    if not 0 <= load.page_id < num_pages:
        return f"page_id {load.page_id} is out of range [0, {num_pages})"
    if load.page_id in seen:
        return f"page_id {load.page_id} is filled twice"
    if load.src_page_id < 0:
        return f"src_page_id {load.src_page_id} is negative"
    if len(load.block_hash) != DIGEST_BYTES or len(load.namespace) != DIGEST_BYTES:
        return (f"block_hash and namespace are {DIGEST_BYTES} bytes, got {len(load.block_hash)} and "
                f"{len(load.namespace)}")
    return ""
