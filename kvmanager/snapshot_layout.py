"""A snapshot of the kvmanager's whole state in Redis: its key layout, the encoding of its values, the write
and the load (recovery.rebuild). snapshots.py stores one per generation of the call log, under
``<redis prefix>:s<g>``: that is the ``<prefix>`` below.

Key layout (variable segments percent-encoded, so ':' and glob characters in names never split or match keys)::

    <prefix>:pool:<worker_id>                        PoolSpec fields
    <prefix>:counters                                clock, per-tenant prefix query/hit tokens, per-pool num_evicted
                                                     and num_window_released
    <prefix>:tenants                                 set of tenant names
    <prefix>:t:<tenant>:req:<req_id>                 a live request: pages, hash chain, last_ops for retried calls
    <prefix>:t:<tenant>:stale:<req_id>               a request whose pool epoch was replaced (answers STALE_EPOCH)
    <prefix>:t:<tenant>:blk:<worker_id>:<hash hex>   a cached block: parent, page_id, block_index, last_used, ...

Values are compact JSON strings. Everything a tenant owns lies under ``<prefix>:t:<tenant>:`` (one SCAN MATCH
lists it). Ref_cnts, the free list and the LRU are not stored in this layout: recovery.py derives them on load
(snapshots.py stores the free lists' and LRUs' exact order next to it, for the replay of the log).
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from dataclasses import asdict, fields
from urllib.parse import quote

import redis

from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocationResult,
    PageCommitResult,
    PageExtensionResult,
    PageFreeResult,
    PageReleaseResult,
    PoolSpec,
)
from kvserve.kvmanager.fencing import fenced_call, fenced_pipeline
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import Block
from kvserve.kvmanager.recovery import StoredBlock, StoredState, rebuild
from kvserve.kvmanager.state import RequestPages, TenantCounters

RESULT_TYPES = {"allocate": PageAllocationResult, "extend": PageExtensionResult, "commit": PageCommitResult,
                "free": PageFreeResult, "release": PageReleaseResult}
BATCH = 1000  # keys per SCAN step and per MGET and MSET command


def key_segment(name: str) -> str:
    return quote(name, safe="")


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class Keys:
    """The key layout above, for one prefix."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.counters = f"{prefix}:counters"
        self.tenants = f"{prefix}:tenants"
        self._segments: dict[str, str] = {}  # tenant and worker names (few, reused by every block key)

    def _segment(self, name: str) -> str:
        seg = self._segments.get(name)
        if seg is None:
            seg = self._segments[name] = key_segment(name)
        return seg

    def pool(self, worker_id: str) -> str:
        return f"{self.prefix}:pool:{self._segment(worker_id)}"

    def tenant(self, tenant: str) -> str:
        """The prefix of every key of one tenant."""
        return f"{self.prefix}:t:{self._segment(tenant)}:"

    def request(self, tenant: str, req_id: str) -> str:
        return f"{self.tenant(tenant)}req:{key_segment(req_id)}"

    def stale(self, tenant: str, req_id: str) -> str:
        return f"{self.tenant(tenant)}stale:{key_segment(req_id)}"

    def block(self, tenant: str, worker_id: str, block_hash: bytes) -> str:
        return f"{self.tenant(tenant)}blk:{self._segment(worker_id)}:{block_hash.hex()}"

    def all_pattern(self) -> str:
        return glob_escape(self.prefix) + ":*"

    def tenant_pattern(self, tenant: str) -> str:
        return glob_escape(self.tenant(tenant)) + "*"

    def kind(self, key: str) -> str:
        """"pool", "counters", "tenants", "req", "stale", "blk", or "" for a key this layout does not know."""
        parts = key[len(self.prefix) + 1:].split(":")
        if parts[0] in ("pool", "counters", "tenants"):
            return parts[0]
        if parts[0] == "t" and len(parts) >= 4 and parts[2] in ("req", "stale", "blk"):
            return parts[2]
        return ""


class SnapshotLayout:
    """The whole state of a manager as the keys above, under one prefix: written (items, write) and loaded."""

    def __init__(self, client: redis.Redis, prefix: str):
        self.client = client
        self.keys = Keys(prefix)

    def items(self, mgr: KVManager) -> tuple[dict[str, str], set[str]]:
        """The full state as (key -> value, tenant names), for a writer that sends it in chunks of its own
        (snapshots.write_state, into a key space nobody reads yet)."""
        upserts = {self.keys.counters: dumps(_counters(mgr))}
        tenants = set(mgr.tenants)
        for worker_id, pool in mgr.pools.items():
            upserts[self.keys.pool(worker_id)] = dumps(asdict(pool.spec))
            for h, block in pool.index.items():
                upserts[self.keys.block(block.tenant, worker_id, h)] = _block_json(block, pool.spec)
                tenants.add(block.tenant)
        for reqs, key_of in ((mgr.requests, self.keys.request), (mgr.stale, self.keys.stale)):
            for req_id, req in reqs.items():
                upserts[key_of(req.tenant, req_id)] = dumps(_request_dict(req))
                tenants.add(req.tenant)
        return upserts, tenants

    def write(self, mgr: KVManager, also=None, fence: tuple[str, int] | None = None) -> None:
        """The full state in one MULTI/EXEC (an inline snapshot), into a prefix that holds no keys yet (a new
        generation's: their numbers are never reused). ``also(pipe)``, if given, queues more commands into the
        same transaction (snapshots.switch_ops: the switch to this generation). The keys go out as a few MSETs
        of BATCH keys: per-command client overhead, not Redis, is what a write of thousands of keys costs.
        ``fence`` (owner key, token): the transaction commits only while the token is the latest (raises
        errors.Fenced, nothing written)."""
        upserts, tenants = self.items(mgr)
        items = list(upserts.items())
        with _transaction(self.client, fence) as pipe:
            for i in range(0, len(items), BATCH):
                pipe.mset(dict(items[i:i + BATCH]))
            if tenants:
                pipe.sadd(self.keys.tenants, *sorted(tenants))
            if also is not None:
                also(pipe)

    def load(self, mgr: KVManager, fence: tuple[str, int] | None = None) -> None:
        """Fills an empty manager with the stored state (recovery.rebuild) and deletes stored blocks of dead
        epochs. Raises redis errors when Redis is unreachable, AssertionError when the stored state is
        inconsistent (never serve from a state that could hand out a page twice)."""
        keys = [k for k in self._scan(self.keys.all_pattern()) if self.keys.kind(k) not in ("", "tenants")]
        values = []
        for i in range(0, len(keys), BATCH):
            values += self.client.mget(keys[i:i + BATCH])
        state = StoredState()
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                _decode_into(state, self.keys.kind(key), json.loads(value))
        dropped = rebuild(mgr, state)
        if dropped:
            keys = [self.keys.block(sb.block.tenant, sb.worker_id, sb.block.block_hash) for sb in dropped]
            if fence is None:
                self.client.delete(*keys)
            else:  # in chunks: a script's command takes a few thousand arguments at most
                for i in range(0, len(keys), BATCH):
                    fenced_call(self.client, *fence, "DEL", *keys[i:i + BATCH])

    def _scan(self, pattern: str) -> list[str]:
        """Keys matching ``pattern``, each once (SCAN may return a key twice; loading a request twice would
        count its pages twice)."""
        return list(dict.fromkeys(_text(k) for k in self.client.scan_iter(match=pattern, count=BATCH)))


@contextmanager
def _transaction(client: redis.Redis, fence: tuple[str, int] | None):
    """A MULTI/EXEC pipeline, fenced (fencing.fenced_pipeline) when ``fence`` is given; EXEC runs on exit."""
    if fence is not None:
        with fenced_pipeline(client, *fence) as pipe:
            yield pipe
        return
    with client.pipeline(transaction=True) as pipe:
        yield pipe
        pipe.execute()


# -- encoding -------------------------------------------------------------------------------------------
def dumps(obj) -> str:
    """The compact JSON of every value a snapshot holds."""
    return json.dumps(obj, separators=(",", ":"))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _counters(mgr: KVManager) -> dict:
    return {"clock": mgr.clock,
            "tenants": {t: [c.prefix_cache_queries, c.prefix_cache_hits] for t, c in mgr.tenants.items()},
            "num_evicted": {w: p.num_evicted for w, p in mgr.pools.items()},
            "num_window_released": {w: p.num_window_released for w, p in mgr.pools.items()}}


@functools.lru_cache(maxsize=4096)
def _json_str(text: str) -> str:
    return json.dumps(text)


def _block_json(block: Block, spec: PoolSpec) -> str:
    """The hot path of a snapshot (one per cached block): formatted directly, the same JSON as dumps."""
    return (f'{{"tenant":{_json_str(block.tenant)},"worker_id":{_json_str(spec.worker_id)},"epoch":{spec.epoch},'
            f'"block_hash":"{block.block_hash.hex()}","parent_hash":"{block.parent_hash.hex()}",'
            f'"page_id":{block.page_id},"block_index":{block.block_index},"last_used":{block.last_used},'
            f'"pinned":{"true" if block.pinned else "false"}}}')


def _request_dict(req: RequestPages) -> dict:
    return {"req_id": req.req_id, "tenant": req.tenant, "worker_id": req.worker_id, "epoch": req.epoch,
            "page_table": req.page_table, "seed": req.seed.hex(), "block_hashes": [h.hex() for h in req.block_hashes],
            "num_prompt_tokens": req.num_prompt_tokens, "num_committed_tokens": req.num_committed_tokens,
            "skip_prefix_cache": req.skip_prefix_cache,
            "last_ops": {kind: [step_id, result_dict(result)] for kind, (step_id, result) in req.last_ops.items()}}


def result_dict(result) -> dict:
    """An op's result (PageAllocationResult, ...) as JSON-ready fields; result_from_dict reads it back."""
    out = {f.name: getattr(result, f.name) for f in fields(result)}
    out["status"] = result.status.value
    return out


def _decode_into(state: StoredState, kind: str, d: dict) -> None:
    if kind == "pool":
        state.specs.append(PoolSpec(**d))
    elif kind == "counters":
        state.clock = d["clock"]
        state.tenants = {t: TenantCounters(q, h) for t, (q, h) in d["tenants"].items()}
        state.num_evicted = dict(d["num_evicted"])
        state.num_window_released = dict(d.get("num_window_released", {}))  # absent before windows existed
    elif kind == "blk":
        block = Block(bytes.fromhex(d["block_hash"]), bytes.fromhex(d["parent_hash"]), d["tenant"], d["page_id"],
                      d["block_index"], d["last_used"], d["pinned"])
        state.blocks.append(StoredBlock(d["worker_id"], d["epoch"], block))
    elif kind in ("req", "stale"):
        (state.requests if kind == "req" else state.stale).append(_decode_request(d))


def result_from_dict(kind: str, d: dict):
    return RESULT_TYPES[kind](**{**d, "status": OpStatus(d["status"])})


def _decode_request(d: dict) -> RequestPages:
    last_ops = {}
    for kind, (step_id, result) in d["last_ops"].items():
        last_ops[kind] = (step_id, result_from_dict(kind, result))
    return RequestPages(d["req_id"], d["tenant"], d["worker_id"], d["epoch"], d["page_table"], bytes.fromhex(d["seed"]),
                        [bytes.fromhex(h) for h in d["block_hashes"]], d["num_prompt_tokens"],
                        d["num_committed_tokens"], d["skip_prefix_cache"], last_ops)
