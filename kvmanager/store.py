"""Redis persistence of the kvmanager's state: one atomic write per RPC, and a reload after a restart.

Key layout (variable segments percent-encoded, so ':' and glob characters in names never split or match keys)::

    <prefix>:pool:<worker_id>                        PoolSpec fields
    <prefix>:counters                                clock, per-tenant prefix query/hit tokens, per-pool num_evicted
    <prefix>:tenants                                 set of tenant names
    <prefix>:t:<tenant>:req:<req_id>                 a live request: pages, hash chain, last_ops for retried calls
    <prefix>:t:<tenant>:stale:<req_id>               a request whose pool epoch was replaced (answers STALE_EPOCH)
    <prefix>:t:<tenant>:blk:<worker_id>:<hash hex>   a cached block: parent, page_id, block_index, last_used, ...
    <prefix>:lru:<worker_id>                         hash: block hash hex -> last_used, for blocks only touched
                                                     (a hit or a release rewrites one field, not the block)

Values are compact JSON strings. Everything a tenant owns lies under ``<prefix>:t:<tenant>:`` (one SCAN MATCH
lists or evicts it). Ref_cnts, the free list and the LRU are not stored: recovery.py derives them on load.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, fields
from urllib.parse import quote, unquote

import redis

from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocationResult,
    PageCommitResult,
    PageExtensionResult,
    PageFreeResult,
    PoolSpec,
)
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import Block
from kvserve.kvmanager.recovery import StoredBlock, StoredState, rebuild
from kvserve.kvmanager.state import Changes, RequestPages, TenantCounters

RESULT_TYPES = {"allocate": PageAllocationResult, "extend": PageExtensionResult, "commit": PageCommitResult,
                "free": PageFreeResult}
BATCH = 1000  # keys per SCAN step and per MGET, DEL and MSET command


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

    def lru(self, worker_id: str) -> str:
        return f"{self.prefix}:lru:{self._segment(worker_id)}"

    def all_pattern(self) -> str:
        return glob_escape(self.prefix) + ":*"

    def tenant_pattern(self, tenant: str) -> str:
        return glob_escape(self.tenant(tenant)) + "*"

    def kind(self, key: str) -> str:
        """"pool", "counters", "tenants", "lru", "req", "stale", "blk", or "" for a key this layout does not know."""
        parts = key[len(self.prefix) + 1:].split(":")
        if parts[0] in ("pool", "counters", "tenants", "lru"):
            return parts[0]
        if parts[0] == "t" and len(parts) >= 4 and parts[2] in ("req", "stale", "blk"):
            return parts[2]
        return ""


@dataclass(slots=True)
class _Batch:
    """One write's commands, gathered so they go out as a few multi-key commands."""

    upserts: dict[str, str] = field(default_factory=dict)
    deletes: list[str] = field(default_factory=list)
    lru_set: dict[str, dict[str, int]] = field(default_factory=dict)  # lru key -> {hash hex: last_used}
    lru_del: dict[str, list[str]] = field(default_factory=dict)  # lru key -> hash hexes of dropped blocks
    tenants: set[str] = field(default_factory=set)


class RedisStore:
    """Store (service.py) on Redis. ``write`` is one MULTI/EXEC transaction: a kill -9 of the kvmanager at any
    point leaves Redis holding the state after some complete RPC, never half of one."""

    wants_block_changes = True

    def __init__(self, client: redis.Redis, prefix: str = "kvserve"):
        self.client = client
        self.keys = Keys(prefix)
        # req_id -> tenants it has keys under, as last written. A req_id reused by another tenant inside one
        # Changes (free + allocate) names only the newest tenant; this finds the older key to delete.
        self._req_tenants: dict[str, set[str]] = {}

    # -- write ----------------------------------------------------------------------------------------
    def write(self, mgr: KVManager, changes: Changes, record: tuple | None = None, also=None) -> None:
        """Writes the current values of everything ``changes`` names (absent = deleted), plus the counters.
        ``also(pipe)``, if given, queues more commands into the same transaction (oplog.py's generation switch).

        One MULTI/EXEC of a few multi-key commands (DEL, MSET, SADD): per-command client overhead, not Redis, is
        what a write of thousands of keys costs. On ``changes.reset`` every ``<prefix>:*`` key is deleted and a
        full snapshot written, in the same transaction. SCAN runs before MULTI (inside it, replies only arrive
        at EXEC, too late to name the keys for DEL); that is safe because the kvmanager is the only writer
        under its prefix and holds the service lock, so no key appears between the SCAN and the EXEC."""
        batch = _Batch()
        if changes.reset:
            batch.deletes += self._scan(self.keys.all_pattern())
            written = self._snapshot(batch, mgr)
        else:
            written = self._changed(batch, mgr, changes)
        batch.upserts[self.keys.counters] = dumps(_counters(mgr))
        pipe = self.client.pipeline(transaction=True)
        for i in range(0, len(batch.deletes), BATCH):  # deletes first: a key also upserted ends up present
            pipe.delete(*batch.deletes[i:i + BATCH])
        items = list(batch.upserts.items())
        for i in range(0, len(items), BATCH):
            pipe.mset(dict(items[i:i + BATCH]))
        for key, hexes in batch.lru_del.items():
            for i in range(0, len(hexes), BATCH):
                pipe.hdel(key, *hexes[i:i + BATCH])
        for key, mapping in batch.lru_set.items():
            items = list(mapping.items())
            for i in range(0, len(items), BATCH):
                pipe.hset(key, mapping=dict(items[i:i + BATCH]))
        if batch.tenants:
            pipe.sadd(self.keys.tenants, *sorted(batch.tenants))
        if also is not None:
            also(pipe)
        pipe.execute()
        if changes.reset:
            self._req_tenants.clear()
        for req_id, tenants in written.items():
            if tenants:
                self._req_tenants[req_id] = tenants
            else:
                self._req_tenants.pop(req_id, None)

    def snapshot_items(self, mgr: KVManager) -> tuple[dict[str, str], set[str]]:
        """The full state as (key -> value, tenant names): what a reset write stores, for a writer that sends
        it in chunks of its own (snapshots.py, into a key space nobody reads yet)."""
        batch = _Batch()
        self._snapshot(batch, mgr)
        batch.upserts[self.keys.counters] = dumps(_counters(mgr))
        return batch.upserts, batch.tenants

    def _changed(self, batch: _Batch, mgr: KVManager, changes: Changes) -> dict[str, set[str]]:
        for worker_id in changes.pools:
            pool = mgr.pools.get(worker_id)
            if pool is not None:
                batch.upserts[self.keys.pool(worker_id)] = dumps(asdict(pool.spec))
            else:
                batch.deletes.append(self.keys.pool(worker_id))
        for (worker_id, block_hash), tenant in changes.blocks.items():
            pool = mgr.pools.get(worker_id)
            block = pool.index.get(block_hash) if pool is not None else None
            if block is not None:
                batch.upserts[self.keys.block(block.tenant, worker_id, block_hash)] = _block_json(block, pool.spec)
                batch.tenants.add(block.tenant)
            if block is None or block.tenant != tenant:
                batch.deletes.append(self.keys.block(tenant, worker_id, block_hash))
            if block is None:
                batch.lru_del.setdefault(self.keys.lru(worker_id), []).append(block_hash.hex())
        for (worker_id, block_hash), _ in changes.touched.items():
            pool = mgr.pools.get(worker_id)
            block = pool.index.get(block_hash) if pool is not None else None
            if block is not None and (worker_id, block_hash) not in changes.blocks:
                batch.lru_set.setdefault(self.keys.lru(worker_id), {})[block_hash.hex()] = block.last_used
        written = {}
        for req_id, tenant in changes.requests.items():
            known = {tenant} | self._req_tenants.get(req_id, set())
            written[req_id] = self._request(batch, mgr, req_id, known)
        return written

    def _request(self, batch: _Batch, mgr: KVManager, req_id: str, known_tenants: set[str]) -> set[str]:
        """Upserts the live and the stale record of ``req_id``, deletes them where absent; returns the
        tenants it now has keys under."""
        now = set()
        for req, key_of in ((mgr.requests.get(req_id), self.keys.request), (mgr.stale.get(req_id), self.keys.stale)):
            if req is not None:
                batch.upserts[key_of(req.tenant, req_id)] = dumps(_request_dict(req))
                now.add(req.tenant)
            batch.deletes += [key_of(t, req_id) for t in known_tenants - ({req.tenant} if req is not None else set())]
        batch.tenants |= now
        return now

    def _snapshot(self, batch: _Batch, mgr: KVManager) -> dict[str, set[str]]:
        batch.tenants |= set(mgr.tenants)
        for worker_id, pool in mgr.pools.items():
            batch.upserts[self.keys.pool(worker_id)] = dumps(asdict(pool.spec))
            for h, block in pool.index.items():
                batch.upserts[self.keys.block(block.tenant, worker_id, h)] = _block_json(block, pool.spec)
                batch.tenants.add(block.tenant)
        written: dict[str, set[str]] = {}
        for reqs, key_of in ((mgr.requests, self.keys.request), (mgr.stale, self.keys.stale)):
            for req_id, req in reqs.items():
                batch.upserts[key_of(req.tenant, req_id)] = dumps(_request_dict(req))
                written.setdefault(req_id, set()).add(req.tenant)
                batch.tenants.add(req.tenant)
        return written

    # -- load -----------------------------------------------------------------------------------------
    def load(self, mgr: KVManager) -> None:
        """Fills an empty manager with the stored state (recovery.rebuild) and deletes stored blocks of dead
        epochs. Raises redis errors when Redis is unreachable, AssertionError when the stored state is
        inconsistent (never serve from a state that could hand out a page twice)."""
        all_keys = self._scan(self.keys.all_pattern())
        keys = [k for k in all_keys if self.keys.kind(k) not in ("", "tenants", "lru")]
        values = []
        for i in range(0, len(keys), BATCH):
            values += self.client.mget(keys[i:i + BATCH])
        state = StoredState()
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                _decode_into(state, self.keys.kind(key), json.loads(value))
        self._apply_lru(state, [k for k in all_keys if self.keys.kind(k) == "lru"])
        dropped = rebuild(mgr, state)
        if dropped:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(*(self.keys.block(sb.block.tenant, sb.worker_id, sb.block.block_hash) for sb in dropped))
            pipe.execute()
        self._req_tenants = {}
        for req in (*mgr.requests.values(), *mgr.stale.values()):
            self._req_tenants.setdefault(req.req_id, set()).add(req.tenant)

    def _apply_lru(self, state: StoredState, lru_keys: list[str]) -> None:
        """A block's last_used is the newer of its record's and its pool's lru field (ticks only grow)."""
        ticks: dict[tuple[str, str], int] = {}
        for key in lru_keys:
            worker_id = unquote(key[len(self.keys.prefix) + len(":lru:"):])
            for field_name, tick in self.client.hgetall(key).items():
                ticks[(worker_id, _text(field_name))] = int(tick)
        for sb in state.blocks:
            tick = ticks.get((sb.worker_id, sb.block.block_hash.hex()))
            if tick is not None and tick > sb.block.last_used:
                sb.block.last_used = tick

    def _scan(self, pattern: str) -> list[str]:
        """Keys matching ``pattern``, each once (SCAN may return a key twice; loading a request twice would
        count its pages twice)."""
        return list(dict.fromkeys(_text(k) for k in self.client.scan_iter(match=pattern, count=BATCH)))


# -- encoding -------------------------------------------------------------------------------------------
def dumps(obj) -> str:
    """The compact JSON of every value the store writes."""
    return json.dumps(obj, separators=(",", ":"))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _counters(mgr: KVManager) -> dict:
    return {"clock": mgr.clock,
            "tenants": {t: [c.prefix_cache_queries, c.prefix_cache_hits] for t, c in mgr.tenants.items()},
            "num_evicted": {w: p.num_evicted for w, p in mgr.pools.items()}}


@functools.lru_cache(maxsize=4096)
def _json_str(text: str) -> str:
    return json.dumps(text)


def _block_json(block: Block, spec: PoolSpec) -> str:
    """The hot path of a big commit (one per new block): formatted directly, the same JSON as dumps."""
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
    """An op's result (types.AllocateResult, ...) as JSON-ready fields; result_from_dict reads it back."""
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
