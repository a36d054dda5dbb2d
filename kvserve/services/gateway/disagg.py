"""Prefill/decode disaggregation: which worker a new request prefills on, and where it decodes after.

Workers take a role (``--role``): ``prefill`` workers compute prompts and never decode, ``decode`` workers take
requests whose prompt is (mostly) computed elsewhere, ``both`` (the default) do everything. With prefill workers
live, a new request whose uncached prompt is longer than ``max_local_prefill`` tokens goes to one of them with
``prefill_until`` set: it computes its whole prompt there and samples its first token (its time to first token is
the prefill worker's); once its full pages are committed there, the engine hands it to a decode worker, whose
allocation takes its pages as peer hits (moved_from: the prompt's last, partial page too) and pulls them, then
decodes from the first token on. A short prompt, or one whose prefix is cached where it would
decode, prefills there: moving it would cost more than computing it. With no decode worker live, prefill workers
decode too, and no request is sent to prefill elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.services.gateway.backends import KVManagerBackend
from kvserve.services.gateway.errors import KVManagerUnavailable
from kvserve.services.gateway.request import Request

DEFAULT_MAX_LOCAL_PREFILL = 256


@dataclass(frozen=True, slots=True)
class Roles:
    """The engines that take new requests, by what they do."""

    prefill: tuple  # role "prefill"
    decode: tuple  # role "decode" or "both"; the prefill ones when no other is live

    @classmethod
    def of(cls, engines: Sequence) -> Roles:
        prefill = tuple(e for e in engines if e.info.role == "prefill")
        decode = tuple(e for e in engines if e.info.role != "prefill")
        return cls(prefill if decode else (), decode or prefill)




def choose(kv: KVManagerBackend, req: Request, candidates: Sequence, num_queued: dict[str, int],
           pull_peers: bool) -> tuple[object, int]:
    """The engine among ``candidates`` the kvmanager's placement picks (counting what it could pull), with the
    prompt tokens it would find cached; the least queued one (and 0) while the kvmanager does not answer."""
    by_id = {e.info.worker_id: e for e in candidates}
    queued = {w: num_queued.get(w, 0) for w in by_id}
    try:
        worker_id, num_cached = kv.place_among(req.tenant, req.prompt_token_ids, queued, tuple(by_id), pull_peers)
    except KVManagerUnavailable:
        worker_id, num_cached = min(queued, key=queued.get), 0
    return by_id.get(worker_id) or by_id[min(queued, key=queued.get)], num_cached


def route(kv: KVManagerBackend, req: Request, roles: Roles, num_queued: dict[str, int], decode_engine,
          num_cached: int | None, max_local_prefill: int, pull_peers: bool):
    """Where a new request goes when prefill workers are live: ``decode_engine`` (the decode side's choice, with
    the prompt tokens placement found cached for it there, or None when it was not asked) when its uncached
    prompt there is short, else a prefill worker, with ``req.prefill_until`` set."""
    if num_cached is None:
        _, num_cached = choose(kv, req, (decode_engine,), num_queued, pull_peers)
    num_prompt = len(req.prompt_token_ids)
    if num_prompt - num_cached <= max_local_prefill:
        return decode_engine
    engine, _ = choose(kv, req, roles.prefill, num_queued, pull_peers)
    page_size = engine.info.page_size
    req.prefill_until, req.prefill_committed_until = num_prompt, num_prompt // page_size * page_size
    return engine
