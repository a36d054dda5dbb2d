"""Restart determinism, property-based. KVManagerMachine's random calls (test_kvmanager_properties.py) go
through a KVService over the real call log (kvserve/kvmanager/call_log.py) and a real Redis. Rules add snapshots at
random points, retries of earlier calls after others, an operator's pin and unpin, and workers that join,
drain and leave. After every step a reload (the snapshot, then the logged calls replayed) must equal the live
manager: page tables, blocks, counters, the clock, the remembered answers, the free lists and LRUs in their
exact order (which later allocations depend on), the shared tier's index (its entries in LRU order, their
tenants and bytes, its totals and per-tenant hits), and the member table. The service hands the values whose
entries a call removed to its janitor once the call is durable (never a deposed leader's); a restart hands over
again those handed over since the snapshot it starts from, but the blocks recorded since (deleting twice is
harmless, never deleting leaks, deleting a recorded value loses it).

Every kind of record the call log writes is made here: step, register, admin (pin, unpin, evict_tenant,
forget_worker; a reset is an inline snapshot, in LeaderChangeMachine), join, drain, leave and tier.

LeaderChangeMachine adds leader changes and fenced late writes of the deposed leader (see there)."""

from __future__ import annotations

import copy
import itertools

import pytest
import test_kvmanager_properties as props
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_kvmanager_properties import KVManagerMachine, snapshot

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import connect
from kvserve.common.wire.pages import StepOps
from kvserve.common.wire.tier import StoredBlock, TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import NotLeader, StaleStep, UnknownRequest
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.snapshot import SWITCHED
from kvserve.kvmanager.tenants import CachePolicy

REDIS: dict[str, str] = {}
PREFIXES = (f"replay-{i}" for i in itertools.count())


@pytest.fixture(scope="module", autouse=True)
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        REDIS["url"] = server.url
        yield


class LoggedManager(KVManager):
    """A KVManager whose calls go through a KVService to the call log, as the servicer's do."""

    def __init__(self, store: CallLog):
        super().__init__(store_capacity_bytes=props.STORE_BYTES, policy=CachePolicy("lru"))  # the oracle's order
        self.service = KVService(self, store)
        self.replaying = False  # while its store loads it: the logged calls apply directly

    def step(self, ops):
        if self.replaying:
            return super().step(ops)
        return self.service.step(ops)  # which calls check and apply_checked, not step

    def register_worker(self, spec, release_requests=False):
        result = super().register_worker(spec, release_requests)  # KVService.register_worker would call back here
        if not self.replaying:
            self.service._persist(("register", spec, release_requests))
        return result


class ReplayMachine(KVManagerMachine):
    def __init__(self):
        super().__init__()
        self.prefix = next(PREFIXES)
        self.store = CallLog(connect(REDIS["url"]), self.prefix, snapshot_every=1 << 30, background=False)
        self.mgr = LoggedManager(self.store)
        self.mgr.service.on_tier_deleted = self.janitor
        self.handed: list[bytes] = []  # values the service handed to its janitor, not checked yet
        self.since_snapshot: list[bytes] = []  # ... since the snapshot a reload starts from
        self.settled: list[tuple[StepOps, object]] = []  # (call, its answer): calls of only frees, commits and
        # releases, retried later

    def janitor(self, block_hashes: list[bytes]) -> None:
        self.handed += block_hashes
        self.since_snapshot += block_hashes

    def send_report(self, report):
        return self.mgr.service.report_tier(report)  # logged, as the ReportTier RPC is

    def take_deletions(self) -> list[bytes]:
        assert not self.mgr.tier.deleted, "a durable call's deletions were not handed to the janitor"
        handed, self.handed = self.handed, []
        return handed

    def call(self, ops: StepOps):
        res = super().call(ops)
        if not (ops.allocations or ops.extensions):
            self.settled.append((ops, copy.deepcopy(res)))
        return res

    @rule(forked=st.booleans())
    def snapshot_now(self, forked=False):
        members = self.mgr.service.members
        self.since_snapshot = []
        if not forked:
            self.store.snapshot(self.mgr, members)
            return
        self.store.snapshot_every, self.store.background = 0, True
        self.store._background_snapshot(self.mgr, members)  # due (even with an empty log), no child runs: forks now
        self.store.snapshot_every, self.store.background = 1 << 30, False
        assert self.store.wait_snapshot() == SWITCHED

    @precondition(lambda self: self.tier.orders)
    @rule(data=st.data())
    def snapshot_the_tier(self, data):
        """Writes land, then a snapshot: the store's index comes back in its LRU order (which the entries that
        later reports and store hits move, replayed over it), with its totals and hits."""
        self.report_written(data)
        self.snapshot_now()

    @precondition(lambda self: self.settled)
    @rule(data=st.data())
    def retry_an_earlier_call(self, data):
        """An earlier call of frees, commits and releases again, after others, as a gateway retries one whose
        answer was lost, and logged again. Nothing is applied either way, and the answer is the documented one:
        refused as stale (StaleStep) when one of its requests has had an op of a newer step_id since, refused as
        unknown (UnknownRequest) when a commit's or a release's request has since been freed or forgotten
        elsewhere, else answered from memory with its first answers."""
        ops, first = data.draw(st.sampled_from(self.settled))
        refusals = self.expected_refusals(ops)
        before = snapshot(self.mgr, volatile=False)
        if not refusals:
            again = self.mgr.step(ops)
            assert (again.commits, again.frees, again.releases) == (first.commits, first.frees, first.releases)
            assert again.store_writes == [], "a retried commit orders no write"
        else:
            with pytest.raises(refusals):
                self.mgr.step(ops)
        assert snapshot(self.mgr, volatile=False) == before

    def expected_refusals(self, ops: StepOps) -> tuple[type, ...]:
        freed_here = {f.req_id for f in ops.frees}
        out = set()
        for op in (*ops.frees, *ops.commits, *ops.releases):
            if self.last_step.get(op.req_id, 0) > ops.step_id:
                out.add(StaleStep)
        for c in (*ops.commits, *ops.releases):
            if c.req_id not in self.live and c.req_id not in self.stale and c.req_id not in freed_here:
                out.add(UnknownRequest)
        return tuple(sorted(out, key=lambda kind: kind.__name__))

    @rule(data=st.data())
    def pin_then_unpin(self, data):
        """An operator pins a prefix and unpins it later (admin RPCs, logged), maybe with a snapshot between:
        the blocks come back used now, at the LRU's most recent end."""
        tenant = data.draw(st.sampled_from(props.TENANTS))
        tokens = tuple(data.draw(st.sampled_from(props.PREFIXES + tuple(self.histories[-6:]))))
        self.mgr.service.mutate(admin.pin, tenant, tokens, "")
        if data.draw(st.booleans()):
            self.snapshot_now()
        pools = [self.mgr.pools[w] for w in sorted(self.mgr.pools)]
        found = dict.fromkeys(b.block_hash for p in pools for b in admin._prefix_blocks(self.mgr, p, tenant, tokens))
        self.mgr.service.mutate(admin.unpin, tenant, tokens, "")
        for h in reversed(found):  # a pin holds the block in the store too: unpinned, it is used now there as well
            if h in self.tier.entries:
                self.tier.entries.move_to_end(h)
        self.last = None  # the last call's retry would see the LRU moved

    @rule(tenant=st.sampled_from(props.TENANTS), worker=st.sampled_from(("", "", *props.WORKERS)))
    def evict_a_tenant(self, tenant, worker=""):
        real = props.evict_tenant
        props.evict_tenant = lambda mgr, *args: mgr.service.mutate(real, *args)  # logged, as the admin RPC is
        try:
            KVManagerMachine.evict_a_tenant(self, tenant, worker)
        finally:
            props.evict_tenant = real

    def forget(self, w: str):
        return self.mgr.service.mutate(admin.forget_worker, w, True)  # logged, as the admin RPC is

    @rule(data=st.data())
    def a_worker_joins_drains_and_leaves(self, data):
        """A worker joins (JoinWorker: a "join" record) under its pool's epoch or a newer one, may drain (a
        "drain" record) and may leave (a "leave" record: its pool forgotten with its requests; it then joins
        again), maybe with a snapshot between."""
        w, svc = data.draw(st.sampled_from(props.WORKERS)), self.mgr.service
        epoch = self.epoch[w] + data.draw(st.integers(0, 1))
        num_pages = self.num_pages[w] if epoch == self.epoch[w] else data.draw(st.integers(6, 12))
        self.join(w, epoch, num_pages)
        if data.draw(st.booleans()):
            mark, was_draining = self.log_mark(), svc.members.get(w, epoch).draining
            assert svc.heartbeat(w, epoch, draining=True).known and self.logged_since(mark) != was_draining
            mark = self.log_mark()
            svc.heartbeat(w, epoch, draining=True)
            assert not self.logged_since(mark), "a heartbeat that changes nothing is not logged"
        if data.draw(st.booleans()):
            self.snapshot_now(data.draw(st.booleans()))
        if data.draw(st.booleans()):
            on_w = sorted(rid for rid, m in self.live.items() if m.worker == w)
            assert svc.leave_worker(w, epoch) == tuple(on_w)
            self.join(w, self.forgotten(w, on_w), data.draw(st.integers(6, 12)))

    def join(self, w: str, epoch: int, num_pages: int) -> None:
        if epoch != self.epoch.get(w):
            self.register(w, epoch, num_pages, f"{w}:{epoch}")
        else:  # its pool stays as it is
            assert self.register_pool(props.spec_for(w, epoch, num_pages), f"{w}:{epoch}").dropped_req_ids == ()
        assert self.mgr.service.members.get(w, epoch) is not None

    def register_pool(self, spec, address: str):
        if not address:
            return super().register_pool(spec, address)
        self.mgr.replaying = True  # the registration is logged as the join, not as a "register" record
        try:
            return self.mgr.service.join_worker(spec, address).registered
        finally:
            self.mgr.replaying = False

    def log_mark(self) -> int:
        return self.store.num_logged + len(self.store.pending)

    def logged_since(self, mark: int) -> bool:
        return self.log_mark() > mark

    @invariant()
    def a_restart_reloads_the_live_state(self):
        loaded, recovered = KVManager(self.mgr.load_penalty_pages, props.STORE_BYTES, CachePolicy("lru")), []
        restarted = KVService(loaded, CallLog(connect(REDIS["url"]), self.prefix))
        restarted.on_tier_deleted = recovered.extend
        restarted.load()
        assert snapshot(loaded, volatile=False) == snapshot(self.mgr, volatile=False)
        assert restarted.members.records() == self.mgr.service.members.records()
        assert (loaded.clock, loaded.recent) == (self.mgr.clock, self.mgr.recent)
        # the values whose removal is durable since the snapshot are deleted again, but those recorded since
        assert recovered == [h for h in self.since_snapshot if h not in loaded.tier], "the restart's deletions"
        self.claim_back()

    def claim_back(self) -> None:
        """The reload claimed the prefix, as a restart does: the live store claims it back, or its writes would
        be refused by the fencing token (kvserve/kvmanager/fencing.py)."""
        self.store.owner = None
        self.store._claim()


ReplayMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestReplayProperties = ReplayMachine.TestCase


class LeaderChangeMachine(ReplayMachine):
    """ReplayMachine's calls with leader changes (kvserve/kvmanager/leader.py, fencing.py). A standby kvmanager (a
    service and store of its own on the same prefix) takes over from Redis while the leader is paused past its
    lease; the deposed leader then wakes and attempts a late write, which the fencing token refuses. The model
    carries on over the new leader, so after every step its pools keep every invariant (check_all: no page owned
    twice, ref counts, free lists, the index), a reload equals it, and nothing of a deposed leader's write is in
    Redis. Retries of earlier calls (the inherited rules) then reach the new leader, which answers them from the
    log it loaded."""

    # One rule per kind of late write: more leader changes in each run (each run enables a random subset of the
    # rules), and every write path of the store refused by the fence.
    @rule(data=st.data())
    def leader_change_then_a_late_step(self, data):
        self.leader_change(data, "step")

    @rule(data=st.data())
    def leader_change_then_a_late_registration(self, data):
        self.leader_change(data, "registration")

    @rule(data=st.data())
    def leader_change_then_a_late_admin_call(self, data):
        self.leader_change(data, "admin call")

    @rule(data=st.data())
    def leader_change_then_a_late_inline_snapshot(self, data):
        self.leader_change(data, "inline snapshot")

    @rule(data=st.data())
    def leader_change_then_a_late_reset(self, data):
        self.leader_change(data, "reset")

    @rule(data=st.data())
    def leader_change_then_a_late_tier_report(self, data):
        self.leader_change(data, "tier report")

    def leader_change(self, data, late: str) -> None:
        old = self.mgr
        store = CallLog(connect(REDIS["url"]), self.prefix, snapshot_every=1 << 30, background=False)
        new = LoggedManager(store)
        new.load_penalty_pages = old.load_penalty_pages  # configuration, as the flag gives it
        new.service.leading, new.replaying = False, True
        recovered, late_deleted = [], []
        new.service.on_tier_deleted, old.service.on_tier_deleted = recovered.extend, late_deleted.extend
        new.service.take_over(new)  # claims the prefix (a newer fencing token), then loads
        new.replaying = False
        assert snapshot(new, volatile=False) == snapshot(old, volatile=False)
        assert (new.clock, new.recent) == (old.clock, old.recent)
        # the deletions its replay queued again, less the blocks recorded since
        assert recovered == [h for h in self.since_snapshot if h not in new.tier]
        new.service.on_tier_deleted = self.janitor
        before = redis_contents(store.client, self.prefix)
        try:
            self.late_write(old, late, data)
        except NotLeader as e:
            assert "fencing token" in str(e) and not old.service.leading
        else:  # a call that changed nothing writes nothing (an allocation short of pages, with a snapshot due
            # instead of an early send): answered from the old state, which the new leader holds too
            assert late == "inline snapshot" and old.changes.empty()
        assert redis_contents(store.client, self.prefix) == before, "a deposed leader's write was applied"
        assert late_deleted == [], "a deposed leader's janitor deleted values the new leader may still record"
        self.mgr, self.store = new, store

    def late_write(self, old: LoggedManager, kind: str, data) -> None:
        """A call that writes, of each path a write to Redis takes: a step's record sent early, a registration's,
        an admin call's and a tier report's appended, an inline snapshot's MULTI/EXEC (due now, or an admin
        reset)."""
        w = data.draw(st.sampled_from(props.WORKERS))
        if kind in ("step", "inline snapshot"):
            old.service.store.snapshot_every = 1 if kind == "inline snapshot" else 1 << 30
            old.step(StepOps(self.next_step(), allocations=(self.alloc_op(data, self.new_id()),)))
        elif kind == "registration":
            old.register_worker(props.spec_for(w, self.epoch[w] + 1, self.num_pages[w]))
        elif kind == "admin call":
            old.service.mutate(admin.forget_worker, w, True)
        elif kind == "tier report":  # values landed (evicting others, maybe), one found missing
            written = tuple(StoredBlock(o.write.block_hash, o.write.tenant, props.value_bytes(o.write.block_hash))
                            for o in self.tier.orders[-6:])
            old.service.report_tier(TierReport(w, self.epoch[w], written, tuple(self.tier.entries)[:1]))
        else:
            old.service.mutate(admin.reset, True)


def redis_contents(client, prefix: str) -> dict[str, bytes]:
    return {key: client.dump(key) for key in sorted(client.scan_iter(match=f"{prefix}:*"))}


LeaderChangeMachine.TestCase.settings = settings(
    max_examples=5, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestLeaderChangeProperties = LeaderChangeMachine.TestCase
