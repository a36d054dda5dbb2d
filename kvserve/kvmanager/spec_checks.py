"""What RegisterWorker accepts: a pool's sizes, its window, its page groups, and its role beside the other
workers'. Each refusal is an InvalidRequest naming the field and the reason."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.transfer import ROLES

if TYPE_CHECKING:
    from kvserve.kvmanager.pool import PagePool

MAX_POOL_PAGES = 1 << 24  # ~0.9 GB of bookkeeping here; an H200 of SmolLM2 K/V holds ~0.4M pages of 16 tokens
MAX_PAGE_SIZE = 1 << 16


def check_spec(spec: PoolSpec) -> None:
    if not spec.worker_id:
        raise InvalidRequest("worker_id must not be empty")
    for name in ("epoch", "num_pages", "page_size", "bytes_per_token"):
        if getattr(spec, name) <= 0:
            raise InvalidRequest(f"{name} must be > 0, got {getattr(spec, name)}")
    if spec.num_pages > MAX_POOL_PAGES or spec.page_size > MAX_PAGE_SIZE:
        raise InvalidRequest(f"a pool of {spec.num_pages} pages of {spec.page_size} tokens is past what the "
                             f"kvmanager tracks ({MAX_POOL_PAGES} pages of at most {MAX_PAGE_SIZE} tokens)")
    if spec.bytes_per_token * spec.page_size * spec.num_pages >= 1 << 63:
        raise InvalidRequest(f"the pool's size in bytes ({spec.bytes_per_token} bytes per token) does not fit "
                             "in an int64")
    if not spec.model_fingerprint or not spec.kv_dtype:
        raise InvalidRequest("model_fingerprint and kv_dtype must not be empty")
    spec.attention_window()  # raises InvalidRequest for bad window or sinks settings
    if spec.role not in ROLES:
        raise InvalidRequest(f"worker {spec.worker_id!r}: role {spec.role!r} is not one of {', '.join(ROLES)}")
    _check_groups(spec)


GROUP_FIELDS = ("sliding_group_pages", "sliding_group_window", "sliding_group_bytes_per_token")


def _check_groups(spec: PoolSpec) -> None:
    """Page groups: a grouped spec's sliding group must be a valid windowed pool, and its full layers' fields
    dense; the features grouped pools do not support yet are refused. A pool without groups has none of it."""
    if spec.sliding_group_pages < 0:
        raise InvalidRequest(f"sliding_group_pages must be >= 0 (0 = one group), got {spec.sliding_group_pages}")
    if not spec.grouped:
        for name in GROUP_FIELDS[1:]:
            if getattr(spec, name):
                raise InvalidRequest(f"{name} must be 0 without page groups (sliding_group_pages 0), got "
                                     f"{getattr(spec, name)}")
        return
    if spec.sliding_group_pages > MAX_POOL_PAGES:
        raise InvalidRequest(f"sliding_group_pages {spec.sliding_group_pages} is past what the kvmanager tracks "
                             f"({MAX_POOL_PAGES} pages)")
    if spec.sliding_group_window < spec.page_size:
        raise InvalidRequest(f"sliding_group_window must be >= page_size {spec.page_size} with page groups (the "
                             f"sliding layers' pages are released whole), got {spec.sliding_group_window}")
    if spec.sliding_group_bytes_per_token <= 0:
        raise InvalidRequest(f"sliding_group_bytes_per_token must be > 0 with page groups, got "
                             f"{spec.sliding_group_bytes_per_token}")
    if spec.sliding_group_bytes_per_token * spec.page_size * spec.sliding_group_pages >= 1 << 63:
        raise InvalidRequest("the sliding group's size in bytes does not fit in an int64")
    if spec.sliding_window or spec.attention_sinks:
        raise InvalidRequest(f"with page groups sliding_window and attention_sinks must be 0 (they describe the "
                             f"full layers' pool; the sliding layers' window is sliding_group_window), got "
                             f"{spec.sliding_window} and {spec.attention_sinks}")
    if spec.kv_store:
        raise InvalidRequest("page groups do not work with the shared KV tier yet: kv_store must be false")
    if spec.role != "both":
        raise InvalidRequest(f"page groups do not work with prefill and decode workers yet: role must be "
                             f"\"both\", got {spec.role!r}")


# What a prefill worker and a decode worker must share: the decode worker reads the pages the prefill wrote.
SHARED_BY_ROLES = ("model_fingerprint", "kv_dtype", "kv_scales", "page_size", "sliding_window", "attention_sinks",
                   "bytes_per_token")


def check_roles(pools: dict[str, PagePool], spec: PoolSpec) -> None:
    """A prefill or decode worker's pool must be of the same format as every other prefill or decode worker's
    (a "both" worker is not constrained: its requests' pages never move). Raises InvalidRequest naming both
    workers and what differs."""
    if spec.role == "both":
        return
    for worker_id in sorted(pools):
        other = pools[worker_id].spec
        if worker_id == spec.worker_id or other.role == "both":
            continue
        differ = [f"{name} {getattr(spec, name)!r} on {spec.worker_id!r}, {getattr(other, name)!r} on {worker_id!r}"
                  for name in SHARED_BY_ROLES if getattr(spec, name) != getattr(other, name)]
        if differ:
            raise InvalidRequest(f"prefill and decode workers must share {', '.join(SHARED_BY_ROLES)}: worker "
                                 f"{spec.worker_id!r} ({spec.role}) is not compatible with the registered worker "
                                 f"{worker_id!r} ({other.role}): {'; '.join(differ)}")

