"""Pages that move between workers (kvserve/kvmanager/transfers.py), on tiny real pools: peer hits and the holds on
their source pages, every way a hold ends, the pull-or-recompute choice, moved_from (a prefill handed to its decode
worker), placement with pulls, and holds through snapshots and the call log. check_invariants after every step."""

from __future__ import annotations

import pytest
from step_ids import step_id_for
from test_kvmanager_call_log import exact, reload

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.errors import InvalidRequest
from kvserve.common.redis_client import connect
from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageFree, PoolSpec, StepOps
from kvserve.common.wire.transfer import DEFAULT_LEASE_MS, UNCOMMITTED_BLOCK, PeerLoad, TransferDone
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshots
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import UnknownWorker
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService

from kvmanager_soak import snapshot as full_state  # isort: skip

PS = 4
P = tuple(range(100, 113))  # 13 tokens: 3 full pages can hit (the last token is always computed), 4 pages
T0 = 1_000_000  # the calls' wall clock (ms)


class Caller:
    """One gateway scheduler (one per worker): its own step_id sequence (step_ids.py)."""


def spec(worker, epoch=1, num_pages=8, kv_dtype="float32", role="both", fingerprint="fp", kv_scales=""):
    return PoolSpec(worker, epoch, num_pages, PS, fingerprint, kv_dtype, 100, kv_scales, role=role)


def manager(*specs, lease_ms=DEFAULT_LEASE_MS) -> KVManager:
    m = KVManager(lease_ms=lease_ms)
    m.set_time(T0)
    for s in specs or (spec("w0"), spec("w1")):
        m.register_worker(s)
    return m


def step(m, caller=None, step=None, **ops):
    """One checked step call, then the invariants."""
    out = m.step(StepOps(step_id_for(caller or m, step), **ops))
    check_invariants(m)
    return out


def alloc(m, req_id, tokens, worker, tenant="t", caller=None, step_id=None, **fields):
    op = PageAllocation(req_id, tenant, tuple(tokens), worker, **fields)
    return step(m, caller, step_id, allocations=(op,)).allocations[0]


def commit(m, req_id, start, tokens, computed=None, caller=None):
    op = PageCommit(req_id, start, tuple(tokens), computed if computed is not None else start + len(tokens))
    return step(m, caller, commits=(op,)).commits[0]


def free(m, req_id, caller=None):
    return step(m, caller, frees=(PageFree(req_id),)).frees[0]


def done(m, req_id, ok=True, num_bytes=4096, seconds=0.5, caller=None, step_id=None):
    return step(m, caller, step_id, transfers=(TransferDone(req_id, ok, num_bytes, seconds),))


def prefilled(m, req_id="a", worker="w0", tokens=P, caller=None):
    """A request that computed its prompt on ``worker`` and committed its full pages (still running)."""
    alloc(m, req_id, tokens, worker, caller=caller)
    full = len(tokens) // PS * PS
    commit(m, req_id, 0, tokens[:full], len(tokens), caller=caller)


def held(m) -> dict[str, list[int]]:
    return {r: q.transfer.page_ids for r, q in m.requests.items() if q.transfer is not None}


# -- peer hits ----------------------------------------------------------------------------------------------
def test_a_peer_hit_takes_fresh_pages_to_fill_from_the_source_and_holds_the_source_pages():
    m = manager()
    prefilled(m, "a", "w0")  # w0: pages 0-2 hold P's 3 full pages, page 3 its tail
    prefilled(m, "c", "w1", P[:5])  # w1 holds P's first page itself (page 0)
    b = alloc(m, "b", P, "w1", pull_peers=True)
    seed = m.pools["w1"].seed_for("t")
    hashes = chain_hashes(seed, P[:12], PS)
    assert b.status == OpStatus.OK and b.page_table == [0, 2, 3, 4]  # its own hit, then fresh pages
    assert b.peer_loads == [PeerLoad(2, 1, hashes[1], seed), PeerLoad(3, 2, hashes[2], seed)]
    assert seed == m.pools["w0"].seed_for("t")  # the namespace is the tenant's, the same on both pools
    assert (b.peer_worker_id, b.peer_epoch, b.lease_expires_ms) == ("w0", 1, T0 + DEFAULT_LEASE_MS)
    assert b.num_cached_tokens == 12 and b.num_committed_tokens == 4  # the pulled pages are not its own yet
    assert m.pools["w0"].ref_cnt[:4] == [1, 2, 2, 1]  # a's, plus the pull's hold on pages 1 and 2
    assert held(m) == {"b": [1, 2]} and m.num_holds == 1
    assert (m.transfers.num_pulls, m.transfers.num_pages) == (1, 2)
    assert m.tenants["t"].prefix_cache_hits == 12  # b's: the pulled pages count as cached


def test_no_peer_hit_without_pull_peers_or_from_an_incompatible_pool():
    m = manager(spec("w0"), spec("w1"), spec("w2", kv_dtype="bfloat16"))
    prefilled(m, "a", "w0")
    b = alloc(m, "b", P, "w1")  # pull_peers False: recompute
    assert b.peer_loads == [] and b.num_cached_tokens == 0 and b.page_table == [0, 1, 2, 3]
    c = alloc(m, "c", P, "w2", pull_peers=True)  # another KV dtype: another namespace, nothing to pull
    assert c.peer_loads == [] and c.num_cached_tokens == 0
    assert m.num_holds == 0 and m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 1]


def test_held_source_pages_survive_eviction_pressure_on_their_pool():
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)  # holds w0's pages 0-2
    free(m, "a")  # only the hold keeps them now; page 3 is free
    w0 = m.pools["w0"]
    assert w0.ref_cnt[:4] == [1, 1, 1, 0] and w0.num_evictable == 0
    assert alloc(m, "big", range(5000, 5020), "w0").status == OpStatus.OK  # 5 pages: all those not held
    short = alloc(m, "more", range(6000, 6005), "w0")
    assert short.status == OpStatus.OUT_OF_PAGES and short.num_pages_short == 2
    hashes = chain_hashes(w0.seed_for("t"), P[:12], PS)
    assert [w0.index[h].page_id for h in hashes] == [0, 1, 2]  # still cached where the pull reads them
    done(m, "b")
    assert w0.ref_cnt[:3] == [0, 0, 0] and w0.num_evictable == 3  # evictable again once the pull ended


# -- every way a hold ends ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ok", [True, False], ids=["ok", "failed"])
def test_a_reported_pull_ends_its_hold_and_is_counted_once_even_when_the_call_is_retried(ok):
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)
    ops = StepOps(step_id_for(m), transfers=(TransferDone("b", ok, 8192, 0.25),))
    m.step(ops)
    check_invariants(m)
    m.step(ops)  # the same call again: its hold is gone, nothing counted twice
    check_invariants(m)
    t = m.transfers
    assert (t.num_ok, t.num_failed, t.num_bytes, t.seconds) == ((1, 0) if ok else (0, 1)) + (8192, 0.25)
    assert m.num_holds == 0 and m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 1] and "b" in m.requests
    assert t.mb_per_s == pytest.approx(8192 / 0.25 / 1e6)


@pytest.mark.parametrize("end", ["commit", "free"])
def test_the_receivers_commit_or_free_ends_the_hold(end):
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)
    if end == "commit":  # its first commit follows a pull that succeeded: the pulled pages are its own now
        commit(m, "b", 0, P[:12], 13)
        assert m.pools["w1"].index.keys() >= set(chain_hashes(m.pools["w1"].seed_for("t"), P[:12], PS))
    else:
        free(m, "b")
    assert m.num_holds == 0 and m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 1]
    assert (m.transfers.num_ok, m.transfers.num_failed, m.transfers.num_expired) == (0, 0, 0)


def test_a_hold_whose_lease_passes_is_released_and_counted_as_expired():
    m = manager(lease_ms=5000)
    prefilled(m, "a", "w0")
    b = alloc(m, "b", P, "w1", pull_peers=True)
    assert b.lease_expires_ms == T0 + 5000
    m.set_time(T0 + 4999)
    check_invariants(m)
    assert held(m) == {"b": [0, 1, 2]}
    m.set_time(T0 + 5000)
    check_invariants(m)
    assert held(m) == {} and m.transfers.num_expired == 1 and m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 1]
    done(m, "b", ok=True)  # reported after its lease: not counted (its pages may have been reused)
    assert (m.transfers.num_ok, m.transfers.num_expired) == (0, 1)


def test_a_new_epoch_of_the_source_voids_the_hold_and_keeps_the_request():
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)
    m.register_worker(spec("w0", epoch=2))
    check_invariants(m)
    assert m.num_holds == 0 and "b" in m.requests and m.requests["b"].transfer is None and "a" in m.stale
    done(m, "b", ok=False)  # the pull failed with its source: the request recomputes, nothing is held
    assert m.transfers.num_failed == 0 and m.pools["w0"].ref_cnt == [0] * 8


def test_a_dropped_receiver_releases_the_source_pages():
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)
    m.register_worker(spec("w1", epoch=2))
    check_invariants(m)
    assert "b" in m.stale and m.num_holds == 0 and m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 1]
    m.forget_pool("w0")  # forgetting the other pool too: nothing of either is left held
    check_invariants(m)
    assert m.num_holds == 0 and "a" not in m.requests


def test_an_admin_reset_with_force_drops_the_holds_and_the_totals():
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)
    admin.reset(m, force=True)
    check_invariants(m)
    assert m.num_holds == 0 and m.transfers.num_pulls == 0


# -- pull or recompute --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pull_s,prefill_s,pulls", [
    (1.0, 0.01, False),  # a page pulls in 1 s, recomputes in 4 x 10 ms: recompute
    (0.01, 0.01, True),  # 10 ms against 40 ms: pull
    (0.0, 0.01, True),  # not measured yet: pull, and so measure it
])
def test_a_pull_is_taken_only_when_it_beats_the_measured_prefill(pull_s, prefill_s, pulls):
    m = manager()
    prefilled(m, "a", "w0")
    b = alloc(m, "b", P, "w1", pull_peers=True, pull_s_per_page=pull_s, prefill_s_per_token=prefill_s)
    assert len(b.peer_loads) == (3 if pulls else 0) and b.num_cached_tokens == (12 if pulls else 0)


def test_a_moved_request_pulls_however_slow_the_pull():
    m = manager()
    prefilled(m, "r", "w0", caller=Caller())
    b = alloc(m, "r", P, "w1", caller=Caller(), pull_peers=True, pull_s_per_page=1.0, prefill_s_per_token=0.01,
              moved_from="w0")
    assert len(b.peer_loads) == 3 and b.num_cached_tokens == 12


# -- moved_from: a prefill handed to its decode worker --------------------------------------------------------
def test_moved_from_takes_over_the_prefill_under_another_callers_step_ids():
    m, prefill, decode = manager(), Caller(), Caller()
    alloc(m, "r", P, "w0", caller=prefill, step_id=50)
    commit(m, "r", 0, P[:12], 13, caller=prefill)  # step 51
    queries = m.tenants["t"].prefix_cache_queries
    move = PageAllocation("r", "t", P, "w1", pull_peers=True, moved_from="w0")
    ops = StepOps(step_id_for(decode, 1), allocations=(move,))
    r = m.step(ops).allocations[0]  # the decode worker's scheduler counts its own steps: 1 < 51
    check_invariants(m)
    assert r.status == OpStatus.OK and (r.worker_id, r.page_table) == ("w1", [0, 1, 2, 3])
    assert [(x.page_id, x.src_page_id) for x in r.peer_loads] == [(0, 0), (1, 1), (2, 2)]
    assert m.requests["r"].worker_id == "w1" and m.pools["w0"].num_requests == 0
    assert m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 0]  # the prefill's pages: held for the pull alone
    assert m.tenants["t"].prefix_cache_queries == queries and m.transfers.num_moved == 1
    assert m.step(ops).allocations[0] == r and m.transfers.num_moved == 1  # a retry: the same answer
    check_invariants(m)
    done(m, "r", caller=decode)
    commit(m, "r", 0, P[:12], 13, caller=decode)
    assert m.pools["w0"].ref_cnt[:4] == [0, 0, 0, 0] and m.transfers.num_ok == 1


def test_moved_from_under_the_step_id_of_the_prefills_own_allocation_is_no_retry():
    """The decode caller's step_id may equal the one that allocated the prefill's incarnation: that answer is
    the other caller's, never replayed as this call's."""
    m, prefill = manager(), Caller()
    alloc(m, "r", P, "w0", caller=prefill, step_id=7)
    commit(m, "r", 0, P[:12], 13, caller=prefill)
    r = alloc(m, "r", P, "w1", caller=Caller(), step_id=7, pull_peers=True, moved_from="w0")
    assert (r.worker_id, len(r.peer_loads)) == ("w1", 3) and m.requests["r"].worker_id == "w1"


def test_a_move_short_of_pages_leaves_the_prefill_in_place_and_is_answered_again_on_retry():
    m = manager(spec("w0"), spec("w1", num_pages=4))
    alloc(m, "x", range(5), "w1")  # 2 of w1's 4 pages: the move needs 4
    prefilled(m, "r", "w0", caller=Caller())  # its allocation was the prefill caller's step 1
    ops = StepOps(3, allocations=(PageAllocation("r", "t", P, "w1", pull_peers=True, moved_from="w0"),))
    first = m.step(ops).allocations[0]
    check_invariants(m)
    assert first.status == OpStatus.OUT_OF_PAGES and first.num_pages_short == 2
    assert m.requests["r"].worker_id == "w0" and m.num_holds == 0 and m.transfers.num_moved == 0
    assert m.requests["r"].last_ops["allocate"][0] == 1  # the prefill's own answers are untouched
    assert m.step(ops).allocations[0] == first


@pytest.mark.parametrize("moved_from,tenant,message", [
    ("w2", "t", "moved_from 'w2', but the request is on worker 'w0'"),
    ("w0", "u", "holds this req_id for another tenant"),
])
def test_a_bad_moved_from_is_refused_with_nothing_applied(moved_from, tenant, message):
    m = manager(spec("w0"), spec("w1"), spec("w2"))
    prefilled(m, "r", "w0", caller=Caller())
    before = full_state(m)
    with pytest.raises(InvalidRequest, match=message) as err:
        m.step(StepOps(1, allocations=(PageAllocation("r", tenant, P, "w1", pull_peers=True,
                                                      moved_from=moved_from),)))
    assert err.value.req_id == "r" and full_state(m) == before and m.transfers.num_moved == 0


def test_a_move_from_a_dropped_prefill_worker_recomputes():
    m, prefill = manager(), Caller()
    prefilled(m, "r", "w0", caller=prefill)
    step(m, prefill, 40)  # the prefill caller is far ahead of the decode caller
    m.register_worker(spec("w0", epoch=2))  # the prefill worker restarted: its pages are gone
    assert "r" in m.stale
    r = alloc(m, "r", P, "w1", caller=Caller(), step_id=1, pull_peers=True, moved_from="w0")
    assert r.status == OpStatus.OK and r.peer_loads == [] and r.num_cached_tokens == 0
    assert "r" not in m.stale and m.requests["r"].worker_id == "w1" and m.num_holds == 0


# -- placement ------------------------------------------------------------------------------------------------
LONG = tuple(range(200, 225))  # 25 tokens: 6 pages can hit


def test_place_sends_a_busy_workers_prefix_to_an_idle_worker_that_pulls_it():
    m = manager(spec("w0", num_pages=12), spec("w1", num_pages=12))
    prefilled(m, "a", "w0", LONG)  # running on w0: load 1, so w0 scores 6 - 4 = 2
    assert m.place("t", LONG, {}).worker_id == "w0"  # without pulls w1 scores 0
    p = m.place("t", LONG, {}, pull_peers=True)  # w1 pulls: 6 / 2 = 3 > 2
    assert (p.worker_id, p.num_cached_tokens) == ("w1", 24)
    free(m, "a")  # w0 idle: 6 > 3, the pool's own hit wins again
    assert m.place("t", LONG, {}, pull_peers=True).worker_id == "w0"
    assert m.place("t", LONG, {"w0": 1}, pull_peers=True).worker_id == "w1"  # queued requests count as load
    check_invariants(m)


def test_place_among_only_some_workers_still_pulls_from_the_others():
    m = manager(spec("w0", role="prefill"), spec("w1", role="decode"), spec("w2", role="decode"))
    prefilled(m, "a", "w0", P)
    p = m.place("t", P, {"w1": 1}, only=("w1", "w2"), pull_peers=True)
    assert (p.worker_id, p.num_cached_tokens) == ("w2", 12)
    assert m.place("t", P, {}, only=("w0",)).worker_id == "w0"
    with pytest.raises(UnknownWorker, match="every worker of those asked for is draining or gone"):
        m.place("t", P, {}, only=("w9",))
    with pytest.raises(UnknownWorker, match="draining or gone"):
        m.place("t", P, {}, exclude=frozenset({"w1", "w2"}), only=("w1", "w2"))
    with pytest.raises(UnknownWorker, match="no worker is registered"):
        KVManager().place("t", P, {}, pull_peers=True)


# -- roles at registration --------------------------------------------------------------------------------------
def test_an_unknown_role_is_refused_naming_the_allowed_ones():
    m = KVManager()
    with pytest.raises(InvalidRequest, match="role 'decoder' is not one of both, prefill, decode"):
        m.register_worker(spec("w0", role="decoder"))
    assert m.pools == {}


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "other-model"), ("kv_dtype", "int8"), ("kv_scales", "token_head"), ("page_size", 8),
    ("sliding_window", 32), ("attention_sinks", 0), ("bytes_per_token", 200),
])
def test_a_decode_worker_incompatible_with_a_prefill_worker_is_refused(field, value):
    m = KVManager()
    m.register_worker(PoolSpec("p0", 1, 8, PS, "fp", "float32", 100, "", 16, 4, role="prefill"))
    m.register_worker(PoolSpec("both0", 1, 8, PS, "x", "int8", 7, role="both"))  # "both": never constrained
    fields = {"model_fingerprint": "fp", "kv_dtype": "float32", "kv_scales": "", "page_size": PS,
              "sliding_window": 16, "attention_sinks": 4, "bytes_per_token": 100, field: value}
    bad = PoolSpec("d0", 1, 8, role="decode", **fields)
    with pytest.raises(InvalidRequest, match=rf"prefill and decode workers must share .*worker 'd0' \(decode\) .* "
                                             rf"worker 'p0' \(prefill\): {field} {value!r} on 'd0'"):
        m.register_worker(bad)
    assert sorted(m.pools) == ["both0", "p0"]
    m.register_worker(PoolSpec("d0", 1, 8, PS, "fp", "float32", 100, "", 16, 4, role="decode"))
    m.register_worker(PoolSpec("d1", 1, 8, role="both", **fields))  # a "both" worker joins whatever it is
    assert sorted(m.pools) == ["both0", "d0", "d1", "p0"]


# -- persistence ----------------------------------------------------------------------------------------------
def test_a_snapshot_keeps_live_holds_and_the_totals():
    m = manager()
    prefilled(m, "a", "w0")
    alloc(m, "b", P, "w1", pull_peers=True)
    prefilled(m, "c", "w1", tuple(range(300, 309)))
    alloc(m, "d", range(300, 309), "w0", pull_peers=True)
    done(m, "d", ok=False, num_bytes=100, seconds=0.1)
    loaded = KVManager()
    snapshots.decode(snapshots.encode(m, []), loaded)
    check_invariants(loaded)
    assert full_state(loaded) == full_state(m) and held(loaded) == {"b": [0, 1, 2]}
    assert loaded.num_holds == 1 and loaded.transfers == m.transfers and loaded.transfers.num_failed == 1
    ops = StepOps(step_id_for(m), transfers=(TransferDone("b", True, 10, 0.1),))
    m.step(ops), loaded.step(ops)
    assert full_state(loaded) == full_state(m) and loaded.transfers == m.transfers


@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server.url


@pytest.mark.parametrize("snapshot_every", [1000, 3])
def test_a_replayed_call_log_ends_with_the_same_holds_expiries_and_totals(redis_url, snapshot_every):
    now = [T0]
    svc = KVService(KVManager(), CallLog(connect(redis_url), snapshot_every=snapshot_every, background=False),
                    wall_ms=lambda: now[0])
    for w in ("w0", "w1", "w2"):
        svc.register_worker(spec(w))
    svc.step(StepOps(1, allocations=(PageAllocation("a", "t", P, "w0"),)))
    svc.step(StepOps(2, commits=(PageCommit("a", 0, P[:12], 13),)))
    svc.step(StepOps(3, allocations=(PageAllocation("b", "t", P, "w1", pull_peers=True),
                                     PageAllocation("c", "t", P, "w2", pull_peers=True))))
    svc.step(StepOps(4, transfers=(TransferDone("c", True, 4096, 0.5),)))
    now[0] += DEFAULT_LEASE_MS  # b's lease passes with the next call, which sets the time
    svc.step(StepOps(5, allocations=(PageAllocation("x", "t", P, "w0"),)))
    assert svc.manager.transfers.num_expired == 1
    # a's decode worker (another scheduler: step_id 1 again) takes it over
    svc.step(StepOps(1, allocations=(PageAllocation("a", "t", P, "w2", pull_peers=True, moved_from="w0"),)))
    live = svc.manager
    check_invariants(live)
    t = live.transfers
    assert (t.num_pulls, t.num_ok, t.num_expired, t.num_moved, live.num_holds) == (3, 1, 1, 1, 1)
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(live) and loaded.transfers == live.transfers and loaded.num_holds == 1
    assert loaded.now_ms == live.now_ms == T0 + DEFAULT_LEASE_MS


def test_a_join_refused_for_its_pool_leaves_no_member_and_no_pool():
    svc = KVService()
    svc.join_worker(spec("p0", role="prefill"), "p0:1")
    with pytest.raises(InvalidRequest, match="prefill and decode workers must share"):
        svc.join_worker(spec("d0", role="decode", fingerprint="other"), "d0:1")
    with pytest.raises(InvalidRequest, match="role 'Decode' is not one of"):
        svc.join_worker(spec("d0", role="Decode"), "d0:1")
    assert sorted(svc.manager.pools) == ["p0"] and sorted(svc.members.members) == ["p0"]


def test_a_move_after_the_first_token_pulls_the_prompts_partial_last_page_too():
    """The prefill computed the whole 13-token prompt and sampled a token: the move (prompt + that token) pulls
    the 3 full pages and the last, partial one (1 token, never committed), named UNCOMMITTED_BLOCK; every prompt
    token counts as computed. The partial page is held like the others, and freed (it holds no block) with the
    hold."""
    m, decode = manager(), Caller()
    prefilled(m, "r", "w0", caller=Caller())
    partial_src = m.requests["r"].page_table[3]
    r = alloc(m, "r", (*P, 7), "w1", caller=decode, pull_peers=True, moved_from="w0")
    assert r.status == OpStatus.OK and r.num_cached_tokens == 13 and r.num_committed_tokens == 0
    assert [(x.page_id, x.src_page_id) for x in r.peer_loads] == [(0, 0), (1, 1), (2, 2), (3, partial_src)]
    assert r.peer_loads[-1].block_hash == UNCOMMITTED_BLOCK
    assert m.pools["w0"].ref_cnt[:4] == [1, 1, 1, 1] and m.pools["w0"].block_of[partial_src] is None
    done(m, "r", caller=decode)
    assert m.pools["w0"].ref_cnt[:4] == [0, 0, 0, 0] and partial_src in m.pools["w0"].free
    free(m, "r", caller=decode)


@pytest.mark.parametrize("tokens", [P, (*P, 7, 8)])
def test_no_partial_page_unless_the_prefill_computed_exactly_the_prompt_and_one_token_follows(tokens):
    m = manager()
    prefilled(m, "r", "w0", caller=Caller())
    r = alloc(m, "r", tokens, "w1", caller=Caller(), pull_peers=True, moved_from="w0")
    assert UNCOMMITTED_BLOCK not in [x.block_hash for x in r.peer_loads]
    assert r.num_cached_tokens == (len(tokens) - 1) // PS * PS
