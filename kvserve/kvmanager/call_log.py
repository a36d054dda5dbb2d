"""The kvmanager's persistence, the call log: each call that changed state (the manager's or the member
table's) is appended to a Redis list, and every ``snapshot_every`` records (or ``snapshot_bytes`` of them,
whichever comes first) the whole state is written as a new generation and the log it covers deleted
(snapshot.py: its format, its one writer, the forked child that runs it off the call path).

Why a log of calls: a call is one small append, whatever it did, where its effect would be one record per
block it touched (thousands when a step admits or frees long prompts). Recovery decodes the snapshot and
replays the logged calls through the same KVManager and membership code, which is deterministic: same state
and same calls give the same pages, hits and answers (the restart tests check exactly that).

    <prefix>:log:<g>   the records after snapshot g, oldest first: a JSON header {"k": kind, ...}, then, for a
                       step, its token ids as little-endian uint16 or uint32 (see encode). Kinds:
                       step      a StepPages call (its window releases in the header)
                       register  a RegisterWorker call (its whole PoolSpec, page groups included)
                       admin     an admin mutation (evict_tenant, pin, unpin, forget_worker; a reset is a snapshot)
                       join      a worker joined: its pool registered, its member record (address) set
                       drain     a member's draining flag changed
                       leave     a member left or was declared dead: it and its pool of that epoch are dropped
                       tier      a worker's ReportTier (blocks the store acknowledged, values found missing)
                       policy    the eviction policy changed (a restart or take-over with another tenants file
                                 or --cache-policy): the calls after it replay under it

Each record's header also holds the call's time ("now", Unix ms): a replay sets it before applying the call, so
the soft pins that lapsed before it lapse again at the same point (pins.py).

A step is appended as soon as it is validated, while the manager applies it (send_early); other calls only
when they changed state. Retried calls (same step_id) replay their answers, so a record logged twice (its
first write failed) changes nothing the second time.

With replicas (``wait_replicas`` > 0, kvserve/common/redis_client.py says what that guarantees) each append, each inline
snapshot and each new generation number is followed by a WAIT on the same connection, and fewer
acknowledgements than asked fail the write. A failed write then leaves the log owing a resync: the next write
is an inline snapshot of the whole state (stalling that call, as an admin reset does), so that what the
replicas, or a replica promoted since, hold is exactly the state in memory again.

Every write is fenced by this log's claim on the prefix (fencing.py): once another kvmanager has claimed it (a
standby that took over), each write fails with Fenced and nothing of it is applied.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from dataclasses import asdict

import numpy as np
import redis

from kvserve.common.redis_client import ReplicaWait, close_client, fresh_client
from kvserve.common.tokens import UINT32, le_uint32, unpack_uint32
from kvserve.common.wire.pages import (
    PageAllocation,
    PageCommit,
    PageExtension,
    PageFree,
    PageRelease,
    PinPoint,
    PoolSpec,
    StepOps,
)
from kvserve.common.wire.tier import StoredBlock, TierCounters, TierReport
from kvserve.common.wire.transfer import TransferDone
from kvserve.kvmanager import admin, membership, snapshot
from kvserve.kvmanager.fencing import FENCED_CALL, as_fenced, read_fenced_reply, rpush_command
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.membership import MemberTable
from kvserve.kvmanager.snapshot import Child, GenerationKeys, claim
from kvserve.kvmanager.state import Changes
from kvserve.kvmanager.tenants import policy_from_dict, policy_to_dict

log = logging.getLogger(__name__)
ADMIN_MUTATIONS = {f.__name__: f for f in (admin.evict_tenant, admin.pin, admin.unpin, admin.reset,
                                            admin.forget_worker)}
DEFAULT_SNAPSHOT_EVERY = 2000
# ... or sooner, once the log holds this many bytes: records of big calls (64 prompts of 2000 tokens: 256 KB)
# would otherwise pile up ~0.5 GB in Redis before a snapshot, and a restart would replay them all.
DEFAULT_SNAPSHOT_BYTES = 64 << 20
# A log this many times over either bound is snapshotted inline, whatever a forked child is doing: children that
# keep failing (a crash, the cgroup's OOM killer) or never finish (SCHED_IDLE on a CPU that is never idle) must
# not let the log, and a restart's replay, grow without bound.
OVERDUE = 4


def encode(record: tuple, now_ms: int = 0) -> bytes:
    """``now_ms``: the call's time, in the header as "now" (a replay sets it first, so pins lapse as they did)."""
    return with_time(encode_call(record), now_ms)


def with_time(encoded: bytes, now_ms: int) -> bytes:
    """A record encode_call made, with the call's time added to its header."""
    if not now_ms:
        return encoded
    end = encoded.index(b"\n") - 1  # the header's closing brace
    return b"%s,\"now\":%d%s" % (encoded[:end], now_ms, encoded[end:])


def encode_call(record: tuple) -> bytes:
    """One log record: a compact JSON header, a newline, then the token ids of the step's allocations and
    commits in header order (the header holds their counts). Binary because a call admitting 64 prompts of
    2000 tokens carries 512 KB of token ids, which as JSON text would be slow to encode and send. When every
    id of the record fits in 16 bits (any vocabulary up to 65536, SmolLM2's 49152 included) they are stored
    as one little-endian uint16 array ("w": 2): half the bytes for Redis to take in and append to its AOF."""
    kind, blobs = record[0], []

    def tokens(token_ids) -> int:
        blobs.append(le_uint32(token_ids))
        return len(token_ids)

    if kind == "step":
        ops: StepOps = record[1]
        body = {"s": ops.step_id,
                "a": [[a.req_id, a.tenant, a.worker_id, a.skip_prefix_cache, tokens(a.token_ids),
                       *_allocation_tail(a)] for a in ops.allocations],
                "e": [[e.req_id, e.num_tokens] for e in ops.extensions],
                "c": [[c.req_id, c.start_pos, tokens(c.token_ids), c.num_computed_tokens] for c in ops.commits],
                "f": [f.req_id for f in ops.frees]}
        if ops.releases:  # absent from the steps without any: most of them
            body["r"] = [[r.req_id, list(r.page_indices)] for r in ops.releases]
        if ops.transfers:
            body["x"] = [[t.req_id, t.ok, t.num_bytes, t.seconds] for t in ops.transfers]
    elif kind in ("register", "join"):
        body = {"spec": asdict(record[1]), "arg": record[2]}  # release_requests, or the member's address
    elif kind == "admin":
        body = {"fn": record[1], "args": list(record[2])}
    elif kind == "policy":
        body = {"policy": policy_to_dict(record[1])}
    elif kind == "tier":
        r: TierReport = record[1]
        body = {"w": r.worker_id, "e": r.epoch, "b": b"".join(b.block_hash for b in r.written).hex(),
                "t": [b.tenant for b in r.written], "n": [b.num_bytes for b in r.written],
                "m": b"".join(r.missing).hex(), "c": list(r.counters.as_tuple())}
    else:  # drain (worker_id, epoch, draining), leave (worker_id, epoch)
        body = {"args": list(record[1:])}
    narrow = _narrow(blobs)
    if narrow is not None:
        body["w"] = 2
    header = json.dumps({"k": kind, **body}, separators=(",", ":")).encode()  # no raw newline: JSON escapes it
    if narrow is not None:
        return header + b"\n" + narrow
    return b"\n".join((header, *blobs)) if blobs else header + b"\n"


def _allocation_tail(a: PageAllocation) -> list:
    """An allocation's fields after its tokens, as far as one is not the default (most allocations: none)."""
    tail = [a.chunk_tokens, a.skip_store, a.load_s_per_page, a.prefill_s_per_token,
            [[p.num_tokens, p.ttl_s] for p in a.pins], a.pull_peers, a.pull_s_per_page, a.moved_from]
    while tail and not tail[-1]:
        tail.pop()
    return tail


def _tail(tail: list) -> list:
    if len(tail) > 4:
        tail[4] = tuple(PinPoint(*p) for p in tail[4])
    return tail


def _tier_report(d: dict) -> TierReport:
    hashes, missing = bytes.fromhex(d["b"]), bytes.fromhex(d["m"])
    written = tuple(StoredBlock(hashes[i * 16:(i + 1) * 16], t, n) for i, (t, n) in enumerate(zip(d["t"], d["n"],
                                                                                                  strict=True)))
    return TierReport(d["w"], d["e"], written, tuple(missing[i:i + 16] for i in range(0, len(missing), 16)),
                      TierCounters(*d["c"]))


def _narrow(blobs: list[bytes]) -> bytes | None:
    """The blobs (little-endian uint32 token ids) as one little-endian uint16 array, if every id fits."""
    if not blobs:
        return None
    words = np.frombuffer(b"".join(blobs), dtype="<u4")
    if words.size == 0 or words.max() > 0xFFFF:
        return None
    return words.astype("<u2").tobytes()


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class _Tokens:
    """Reads the token ids of a record in header order."""

    def __init__(self, raw: bytes, start: int, width: int):
        self.raw, self.pos, self.width = memoryview(raw), start, width
        # "w": 2 records hold one contiguous uint16 array; 4-byte records a uint32 blob per op, joined by newlines
        self.gap = 0 if width == 2 else 1

    def __call__(self, count: int) -> object:
        data = self.raw[self.pos:self.pos + self.width * count]
        self.pos += self.width * count + self.gap
        if self.width == 2:
            return array(UINT32, np.frombuffer(data, dtype="<u2").astype(np.uint32).tobytes())  # native order
        return unpack_uint32(data)


def apply(mgr: KVManager, members: MemberTable, raw: bytes) -> None:
    """Replays one logged call on ``mgr`` and ``members``."""
    newline = raw.find(b"\n")
    d = json.loads(raw if newline < 0 else raw[:newline])
    kind = d["k"]
    if "now" in d:
        mgr.set_time(d["now"])
    if kind == "step":
        tok = _Tokens(raw, newline + 1, d.get("w", 4))
        allocations = tuple(PageAllocation(r, t, tok(n), w, skip, *_tail(tail)) for r, t, w, skip, n, *tail in d["a"])
        commits = tuple(PageCommit(r, s, tok(n), c) for r, s, n, c in d["c"])
        mgr.step(StepOps(step_id=d["s"], allocations=allocations,
                         extensions=tuple(PageExtension(r, n) for r, n in d["e"]), commits=commits,
                         frees=tuple(PageFree(r) for r in d["f"]),
                         releases=tuple(PageRelease(r, tuple(i)) for r, i in d.get("r", ())),
                         transfers=tuple(TransferDone(*t) for t in d.get("x", ()))))
    elif kind == "register":
        mgr.register_worker(PoolSpec(**d["spec"]), d["arg"])
    elif kind == "join":
        membership.join(mgr, members, PoolSpec(**d["spec"]), d["arg"])
    elif kind == "drain":
        membership.set_draining(members, *d["args"])
    elif kind == "leave":
        membership.leave(mgr, members, *d["args"])
    elif kind == "tier":
        mgr.report_tier(_tier_report(d))
    elif kind == "policy":
        mgr.set_policy(policy_from_dict(d["policy"]))
    else:
        ADMIN_MUTATIONS[d["fn"]](mgr, *_tuples(d["args"]))


class CallLog:
    """The Store (service.py) of a kvmanager with persistence: logs calls, snapshots state. Thread-unsafe:
    KVService holds its lock.

    A due snapshot is written by a forked child (snapshot.py) when ``background`` is true, or when it is None
    and snapshot.forking_is_safe() when the log is made; otherwise the call that makes it due writes it
    inline, as an admin reset always does. ``wait_replicas``, ``wait_timeout_ms``: the WAIT after each write
    (ReplicaWait; 0 replicas: none)."""

    def __init__(self, client: redis.Redis, prefix: str = "kvserve", snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
                 snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES, background: bool | None = None,
                 wait_replicas: int = 0, wait_timeout_ms: int = 500):
        self.client = client
        self.wait = ReplicaWait(wait_replicas, wait_timeout_ms)
        self.resync = False  # a write failed while WAITing for replicas: the next one is an inline snapshot
        self.keys = GenerationKeys(prefix)
        self.snapshot_every = snapshot_every
        self.snapshot_bytes = snapshot_bytes
        self.background = snapshot.forking_is_safe() if background is None else background
        self.stop_child_before_switch = False  # tests: the snapshot child stops itself before it switches
        self.owner: int | None = None  # this kvmanager's claim on the prefix (snapshot.claim), on first use
        self.gen = 0  # the generation a restart loads
        self.log_gens = [0]  # generations of the logs a restart replays, oldest first; calls go to the last
        self.child: Child | None = None
        self.num_logged = 0  # records (and bytes) a restart would replay
        self.num_logged_bytes = 0
        self.retry_base = (0, 0)  # (num_logged, num_logged_bytes) when the last snapshot child failed
        self.num_snapshots = {"forked": 0, "inline": 0, "failed": 0}  # metrics: written how, or failed
        self.last_snapshot_s = 0.0  # fork to reaped, or the inline write
        self.pending: list[bytes] = []  # records whose append failed, in call order
        self.last_record = b""
        self.queued_early: tuple | None = None  # the record send_early queued: write() must not queue it again
        self.in_flight: tuple | None = None  # (connection, number of records) of an RPUSH sent early

    @property
    def log_key(self) -> str:
        return self.keys.log(self.log_gens[-1])

    def send_early(self, record: tuple, now_ms: int = 0) -> bool:
        """Sends the RPUSH of a validated step (and of any records still pending) before the manager applies
        it, without waiting: Redis appends while the manager works, and write() reads the reply before the
        call is answered, so an answer is still only given once its call is durable. False (nothing sent)
        when this call will take an inline snapshot instead, or the send failed (write() then retries the
        plain way). A call logged this way may turn out to change nothing: replaying it changes nothing
        either."""
        self._queue(record, now_ms)
        self.queued_early = record
        if not self.pending or self._inline_due():
            return False
        pool = self.client.connection_pool
        try:
            self._claim()
            conn = pool.get_connection()  # connects (and may fail) when the pool has no live connection
        except Exception:  # noqa: BLE001 - any failure: fall back to write()'s own attempt, which raises
            return False
        try:
            conn.send_command(*rpush_command(self.keys.owner, self.owner, self.log_key, self.pending))
            self.wait.send(conn)
        except Exception:  # noqa: BLE001 - as above
            conn.disconnect()
            pool.release(conn)
            return False
        self.in_flight = (conn, len(self.pending))
        return True

    def write(self, mgr: KVManager, members: MemberTable, record: tuple, reset: bool = False) -> None:
        """Appends ``record`` (and any still pending) to the log, or completes the append send_early began;
        writes a snapshot inline instead on ``reset`` or when _inline_due(). Raises what the write raised."""
        try:
            self._write(mgr, members, record, reset)
        except BaseException:
            self.resync = bool(self.wait)
            raise
        self.resync = False

    def _write(self, mgr: KVManager, members: MemberTable, record: tuple, reset: bool) -> None:
        queued, self.queued_early = self.queued_early, None
        if self.in_flight is not None:
            self._finish_early()
        else:
            if record is not queued:  # a step whose early send did not go out is queued already
                self._queue(record, mgr.now_ms)
            if reset or self._inline_due():
                self.snapshot(mgr, members)
                return
            self._claim()
            if self.pending:
                self._append_pending()
                self._logged(len(self.pending))
        if self.background:
            self._background_snapshot(mgr, members)

    def _inline_due(self) -> bool:
        """This call writes a snapshot itself: one is due and this process does not fork, or the log is
        OVERDUE times over a bound (a running child is then killed), or a resync is owed."""
        if self.resync:
            return True
        if not self.background:
            return self._snapshot_due()
        records, num_bytes = self._log_size()
        return records > OVERDUE * self.snapshot_every or num_bytes > OVERDUE * self.snapshot_bytes

    def _log_size(self) -> tuple[int, int]:
        """Records and bytes a restart would replay, the pending ones included."""
        return self.num_logged + len(self.pending), self.num_logged_bytes + sum(map(len, self.pending))

    def _queue(self, record: tuple, now_ms: int = 0) -> None:
        encoded = encode_call(record)
        # A step sent again right after (same step_id) is a retry (after a failed write, or a lost answer): it
        # applies nothing, so it is logged once (pins its time lapsed lapse again before the next call replayed).
        # The other calls are cheap to log twice: those are always logged.
        if encoded == self.last_record and record[0] == "step":
            return
        self.pending.append(with_time(encoded, now_ms))
        self.last_record = encoded

    def _snapshot_due(self) -> bool:
        records, num_bytes = self._log_size()
        base_records, base_bytes = self.retry_base
        return records - base_records >= self.snapshot_every or num_bytes - base_bytes >= self.snapshot_bytes

    def _logged(self, count: int) -> None:
        """The first ``count`` pending records are in the log now."""
        self.num_logged += count
        self.num_logged_bytes += sum(map(len, self.pending[:count]))
        del self.pending[:count]

    def _finish_early(self) -> None:
        conn, count = self.in_flight
        self.in_flight = None
        pool = self.client.connection_pool
        try:
            read_fenced_reply(conn)
            self.wait.read(conn)
        except BaseException:
            conn.disconnect()  # the reply is lost with it: the records stay pending and are sent again
            raise
        finally:
            pool.release(conn)
        self._logged(count)

    def _claim(self) -> None:
        if self.owner is None:
            self.owner, self.gen, self.log_gens = claim(self.client, self.keys)

    def _new_generation(self, wait: bool = True) -> int:
        """A new generation number (a fenced INCR), with the WAIT behind it when ``wait``: replication keeps
        Redis' order, so the replicas that acknowledge it hold every write made before it too, on any
        connection."""
        def incr(c):
            return c.eval(FENCED_CALL, 1, self.keys.owner, str(self.owner), "INCR", self.keys.gens)
        try:
            return int(self.wait.run(self.client, incr) if wait else incr(self.client))
        except redis.ResponseError as e:
            raise as_fenced(e) from e

    def _append_pending(self) -> None:
        """The pending records, appended to the log behind the fence, then the WAIT (one pipeline)."""
        command = rpush_command(self.keys.owner, self.owner, self.log_key, self.pending)
        try:
            self.wait.run(self.client, lambda c: c.execute_command(*command))
        except redis.ResponseError as e:
            raise as_fenced(e) from e

    # -- snapshots ------------------------------------------------------------------------------------
    def _background_snapshot(self, mgr: KVManager, members: MemberTable) -> None:
        """Notes a finished child; forks one when a snapshot is due and none runs. Called once the call's
        record is durable; a failure here is logged, not raised (the call itself succeeded)."""
        try:
            if self.child is not None:
                self._reaped(snapshot.reap(self.child))
            if self.child is None and not self.pending and self._snapshot_due():
                gen = self._new_generation()
                pid = snapshot.fork(self.client, self.keys, mgr, members.records(), gen, self.log_gens, self.owner,
                                    self.stop_child_before_switch)
                self.child = Child(pid, gen, self.num_logged, self.num_logged_bytes, time.monotonic())
                self.log_gens = [*self.log_gens, gen]
        except Exception:  # noqa: BLE001 - see above; the next due call tries again
            log.exception("kvmanager: could not start a call-log snapshot")
            self.retry_base = (self.num_logged, self.num_logged_bytes)

    def _reaped(self, code: int | None) -> None:
        if code is None:
            return
        child, self.child = self.child, None
        if code != snapshot.SWITCHED:
            log.warning("kvmanager: call-log snapshot child %d exited with %d; the log keeps growing until "
                        "the next attempt", child.pid, code)
            self.retry_base = (self.num_logged, self.num_logged_bytes)
            self.num_snapshots["failed"] += 1
            return
        self.num_snapshots["forked"] += 1
        self.last_snapshot_s = time.monotonic() - child.started
        self.gen = child.gen
        self.log_gens = [g for g in self.log_gens if g >= child.gen]
        self.num_logged -= child.num_records
        self.num_logged_bytes -= child.num_bytes
        self.retry_base = (0, 0)

    def wait_snapshot(self) -> int | None:
        """Waits for a running snapshot child; its exit code (None when none ran). Tests and shutdown."""
        if self.child is None:
            return None
        code = snapshot.reap(self.child, block=True)
        self._reaped(code)
        return code

    def close(self) -> None:
        """A graceful stop: lets a running snapshot child finish, so a restart replays a short log (each of
        the child's Redis commands is bounded by the client's socket timeout)."""
        self.wait_snapshot()

    def abandon(self) -> None:
        """Forgets what this log had not written yet, and stops its snapshot child: its kvmanager stepped
        down (another claimed the prefix, so none of it could be written anyway)."""
        if self.child is not None:
            self._reaped(snapshot.kill(self.child))
        if self.in_flight is not None:
            self.in_flight[0].disconnect()
            self.client.connection_pool.release(self.in_flight[0])
        self.pending.clear()
        self.in_flight = self.queued_early = None
        self.last_record = b""
        self.retry_base = (0, 0)

    def snapshot(self, mgr: KVManager, members: MemberTable) -> None:
        """Writes the whole state as a new generation and empties the log, inline (snapshot.write, the child's
        writer). A running snapshot child is stopped first."""
        self._claim()
        if self.child is not None:
            self._reaped(snapshot.kill(self.child))
        t0 = time.monotonic()
        gen = self._new_generation(wait=False)
        snapshot.write(self.client, self.keys, gen, snapshot.encode(mgr, members.records()), self.log_gens,
                       self.owner)
        self.num_snapshots["inline"] += 1
        self.last_snapshot_s = time.monotonic() - t0
        self.gen, self.log_gens = gen, [gen]
        self.num_logged = self.num_logged_bytes = 0
        self.retry_base = (0, 0)
        self.pending.clear()
        if self.wait:
            self._new_generation()  # only for its WAIT, which covers the snapshot (a number skipped is harmless)

    def load(self, mgr: KVManager, members: MemberTable | None = None) -> None:
        """Claims the prefix (a new fencing token), decodes the current generation's snapshot into ``mgr`` and
        ``members`` (each member with a fresh lease), then replays its log and every newer one. Raises redis
        errors, AssertionError for an inconsistent state. A log loads again when its kvmanager takes over as
        leader once more: nothing of its earlier term is kept."""
        members = MemberTable() if members is None else members
        self.abandon()
        self.owner = None
        self._claim()
        binary = fresh_client(self.client, decode_responses=False)  # the log's client decodes replies as text
        try:
            members.load(snapshot.decode(binary.lrange(self.keys.snapshot(self.gen), 0, -1), mgr))
            self.num_logged = self.num_logged_bytes = 0
            for gen in self.log_gens:
                records = binary.lrange(self.keys.log(gen), 0, -1)
                for raw in records:
                    apply(mgr, members, raw)
                self.num_logged += len(records)
                self.num_logged_bytes += sum(map(len, records))
        finally:
            close_client(binary)
        mgr.changes = Changes()  # what the replay changed is what the log holds
        check_invariants(mgr)
