"""Pages that move between workers, as the kvmanager directs them (docs/features/transfers.md).

An allocation that finds, past its own pool's hit, a run of the prompt's blocks in another compatible pool (one
whose hash chains match: same tenant namespace, so same model, KV format, page size and window) takes them as
**peer hits**: fresh pages of its own pool that its worker fills from the source before the first chunk. The
source's pages are held for the pull (one more ref_cnt each, a ``TransferHold`` on the receiving request), so
nothing can evict or reuse them while their bytes travel; the hold ends when the first of these happens:

    the gateway reports the pull (StepOps.transfers: done or failed)
    the receiving request commits (its first commit follows a pull that succeeded) or is freed
    the lease passes (set_time: a receiver that never reports cannot hold a source's pages for ever)
    either pool is dropped (a new epoch, a lost worker)

The source serves a read only while the lease has time left (LEASE_MARGIN_MS), so a page whose hold lapsed is
never sent. ``TransferTotals`` counts what happened, for admin stats and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TransferHold:
    """The source pages a request's pull reads: held until the pull ends or ``expires_ms``."""

    worker_id: str
    epoch: int
    page_ids: list[int] = field(default_factory=list)
    expires_ms: int = 0


@dataclass(slots=True)
class TransferTotals:
    """Pulls since the kvmanager's state began (persisted with it)."""

    num_pulls: int = 0  # allocations that ordered a pull
    num_pages: int = 0  # pages those pulls were to move
    num_ok: int = 0  # reported done: every page verified
    num_failed: int = 0  # reported failed: the request recomputes them
    num_expired: int = 0  # holds that ended unreported: the lease passed, or the source pool was dropped
    num_bytes: int = 0  # received, as reported
    seconds: float = 0.0  # wall time of the reported pulls
    num_moved: int = 0  # requests whose prefill ran on another worker (moved_from)

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
