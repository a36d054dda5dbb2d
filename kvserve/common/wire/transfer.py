"""Pages that move between workers (docs/features/transfers.md), as plain data.

The kvmanager decides what moves (an allocation's ``peer_loads``: blocks of another compatible pool that the
request's own pool lacks, held on the source under a lease); the gateway hands the order to the receiving worker
(PullPages); the receiver reads the pages from the source (ReadPages, a stream of self-checking page values)
and verifies each before its pages count as filled; the gateway tells the kvmanager how the pull went
(``StepOps.transfers``), which releases the source's hold.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("both", "prefill", "decode")
# A source serves a pull only while its lease has at least this much left (the kvmanager's clock and the
# source's may differ by less than this): a page past its lease may be reused, and is never sent.
LEASE_MARGIN_MS = 2000
DEFAULT_LEASE_MS = 30_000
FRAME_BYTES = 1 << 20  # a ReadPages frame carries page values up to about this many bytes (at least one page)
# The block hash a pull names a page with that holds no committed block: the last, partial page of a prompt
# its prefill worker computed whole (the page values' headers name it, as they name a block).
UNCOMMITTED_BLOCK = bytes(16)


def check_role(role: str) -> str:
    """The role, or ValueError naming the allowed ones."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    return role


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """Fill page ``page_id`` of the receiving request with the block held in page ``src_page_id`` of the source."""

    page_id: int
    src_page_id: int
    block_hash: bytes
    namespace: bytes


@dataclass(frozen=True, slots=True)
class PullOrder:
    """The gateway's order to a worker: read ``loads`` from the worker at ``source_address`` (its incarnation
    ``source_epoch``) into this worker's pages, before ``lease_expires_ms`` (the kvmanager's wall clock)."""

    req_id: str
    epoch: int  # the receiver's incarnation that owns the pages
    source_worker_id: str
    source_epoch: int
    source_address: str
    lease_expires_ms: int
    loads: tuple[PeerLoad, ...]
    traceparent: str = ""


@dataclass(frozen=True, slots=True)
class PullResult:
    """How a pull went: every page verified and filled (``error`` empty), or not (the request recomputes)."""

    num_pages: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class ReadOrder:
    """A receiver's request to a source: the pages (src_page_id, block_hash, namespace) of incarnation ``epoch``."""

    epoch: int
    lease_expires_ms: int
    pages: tuple[tuple[int, bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class TransferDone:
    """The gateway's report of a pull, with the next page ops: the source's hold is released, and the kvmanager
    counts it (a failed pull is recomputed)."""

    req_id: str
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
