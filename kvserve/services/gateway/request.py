"""One request as the gateway sees it: its tokens, how far it is computed, its copy of the page table.

Token layout of a running request (page_size = 4):

    all_token_ids   [ p0 p1 p2 p3 | p4 p5 o0 o1 | o2 ]        p = prompt, o = generated
    computed          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^              num_computed_tokens = 8 (o2 not fed yet)
    committed         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^              full pages in the prefix index (a multiple of 4)
    page_table      [      7      |      2      |  9 ]
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.common.wire.pages import PinPoint
from kvserve.common.wire.worker import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages
    RUNNING = "running"  # holds pages on its worker
    FINISHED = "finished"  # done; its pages are freed by the next page-ops call


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"  # client cancel, deadline, or shutdown: nothing more is streamed
    ERROR = "error"  # the request could not be served (see Request.error)


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What the client asked for, after validation."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False


@dataclass(slots=True)
class Request:
    req_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: RequestParams
    arrival_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    # On a worker with page groups: its sliding layers' page table (HOLE where released); empty elsewhere
    group_page_table: list[int] = field(default_factory=list)
    epoch: int = 0
    num_computed_tokens: int = 0
    num_committed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix hit of the first admission computed: what usage reports
    admitted_ahead: bool = False  # allocated by a call made while the worker computed; its first chunk is next
    # Pages its first chunk fills from the shared KV tier (StoreLoad), until that chunk computed: their tokens
    # count as computed, not committed, so nothing of them is committed before the load is known to have worked.
    store_loads: tuple = ()
    skip_store: bool = False  # a load from the store failed for it: its next admissions take pool hits only
    # Pages its first chunk needs from another worker's pool (an allocation's peer_loads), with where they are:
    # while ``pulling``, its worker pulls them and it is not scheduled; committed like store_loads.
    peer_loads: tuple = ()
    peer_source: tuple = ()  # (worker_id, epoch, lease_expires_ms) of the pages it pulls
    pulling: bool = False
    pull_seq: int = 0  # which of its pulls is the current one (a pull of an earlier incarnation is ignored)
    skip_peers: bool = False  # a pull failed for it: its next admissions take no peer hits
    # Disaggregated serving: on a prefill worker it computes its prompt (``prefill_until`` tokens) and samples
    # its first token there; once its full pages (``prefill_committed_until`` tokens) are committed it moves to a
    # decode worker, which pulls its pages (the last, partial one too); ``moved_from`` names the prefill worker
    # until its decode worker allocated it. 0 / "": neither.
    prefill_until: int = 0
    prefill_committed_until: int = 0
    moved_from: str = ""
    pins: tuple[PinPoint, ...] = ()  # soft pins of its prompt's prefixes it asks the kvmanager for
    num_pinned_tokens: int = 0  # leading prompt tokens under a pin it took or refreshed (the kvmanager's answer)
    cache_key: str = ""  # placement affinity within the tenant (OpenAI's prompt_cache_key); "" = none
    num_preemptions: int = 0
    # Steps with it in them that failed in a row without an answer for it (the worker refused the step as a whole,
    # restarted or was lost in it). While > 0 it is under suspicion: at most one such request computes per step
    # (scheduler.py); at 2 it fails (engine.py); an answered step resets it.
    num_failed_steps: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # finish_reason ERROR: why (gateway/errors.py)
    span: object | None = None  # its OpenTelemetry span while tracing is on (gateway/observe.py)
    traceparent: str = ""  # W3C traceparent of that span, sent with its page ops and step items

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Positions [start, end) of all_token_ids, without building the whole list (a decode step needs one
        token of a long sequence)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return tuple(self.prompt_token_ids[start:end])
        if start >= n:
            return tuple(self.output_token_ids[start - n:end - n])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[:end - n])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens not fed to the model yet: the prompt (or what is left of it, chunk by chunk), all
        tokens of a preempted request on readmission, or 1 (the last sampled token) when decoding; on a prefill
        worker, what is left of its first prefill_until tokens."""
        return (self.prefill_until or self.num_tokens) - self.num_computed_tokens

    @property
    def sliding_table(self) -> list[int]:
        """The page table whose pages fall out of a window: its sliding layers' on a grouped worker."""
        return self.group_page_table if self.group_page_table else self.page_table

    @property
    def num_covered_pages(self) -> int:
        """Leading pages every one of its page tables has (a grouped admission's sliding table covers its first
        chunk only, its full one the whole prompt)."""
        if self.group_page_table:
            return min(len(self.page_table), len(self.group_page_table))
        return len(self.page_table)

    def extend_pages(self, result) -> None:
        """Appends a PageExtensionResult's pages to its tables."""
        self.page_table.extend(result.new_page_ids)
        self.group_page_table.extend(result.group_new_page_ids)

    @property
    def prefilled(self) -> bool:
        """On a prefill worker: its prompt is computed (its first token sampled) and its full pages committed,
        ready for its decode worker to pull."""
        return 0 < self.prefill_until <= self.num_computed_tokens and \
            self.num_committed_tokens >= self.prefill_committed_until

    def reset_for_recompute(self) -> None:
        """Preempted: forget the pages; everything known so far is a prompt to recompute on readmission."""
        self.status = RequestStatus.WAITING
        self.page_table = []
        self.group_page_table = []
        self.epoch = 0
        self.num_computed_tokens = 0
        self.num_committed_tokens = 0
        self.admitted_ahead = False
        self.store_loads = self.peer_loads = self.peer_source = ()
        self.pulling = False
        self.num_preemptions += 1

    def reset_for_decode(self, prefill_worker_id: str) -> None:
        """Its prefill is done on ``prefill_worker_id``: it waits for a decode worker, which allocates it with
        moved_from (taking its pages there as peer hits) and computes from there. Not a preemption."""
        self.reset_for_recompute()
        self.num_preemptions -= 1
        self.prefill_until = self.prefill_committed_until = 0
        self.moved_from = prefill_worker_id
