"""The call log (kvserve/kvmanager/call_log.py): calls appended, snapshots every N records, reload = snapshot + replay,
and a failed write kept in memory, answered UNAVAILABLE, and logged once by the retry."""

from __future__ import annotations

import json
import signal

import pytest
import redis
from free_ports import free_port
from kvmanager_histories import alloc, build_history, spec

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.errors import InvalidRequest
from kvserve.common.redis_client import connect, fresh_client
from kvserve.common.wire.pages import OpStatus, PageCommit, PageExtension, PageFree, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import StoreUnavailable
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService

from kvmanager_soak import snapshot  # isort: skip


def raw_records(client, key: str) -> list[bytes]:
    """The records of a log, as bytes (the store's client decodes replies as text)."""
    return fresh_client(client, decode_responses=False).lrange(key, 0, -1)


@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server.url


def reload(url: str, prefix="kvserve") -> tuple[KVManager, CallLog]:
    mgr, store = KVManager(), CallLog(connect(url), prefix)
    store.load(mgr)  # runs check_invariants
    return mgr, store


def exact(mgr: KVManager) -> dict:
    """Replay reproduces everything, the clock and every retried-call answer included."""
    return snapshot(mgr, clock=True, last_ops=True)


CALLS_LOGGED = 13  # the calls below that change state (build_history's, the unpin and the eviction)


def live_keys(client, store: CallLog) -> dict[str, list]:
    """The store's keys in Redis by kind: only the loaded generation's state, the logs a restart replays, and
    the generation counters may be left."""
    out: dict[str, list] = {"snap": [], "log": [], "other": []}
    for key in client.scan_iter(match="kvserve:*"):
        kind = store.keys.classify(key)
        out["other" if kind is None else kind[0]].append(kind[1] if kind else key)
    return {"snap": sorted(set(out["snap"])), "log": sorted(out["log"]), "other": sorted(out["other"])}


@pytest.mark.parametrize("background", [True, False], ids=["forked", "inline"])
@pytest.mark.parametrize("snapshot_every", [1000, 3, 1])
def test_reload_replays_the_log_on_top_of_the_last_snapshot(redis_url, snapshot_every, background):
    client = connect(redis_url)
    store = CallLog(client, snapshot_every=snapshot_every, background=background)
    svc = KVService(KVManager(), store)
    build_history(svc)  # registrations, steps, an admin pin, a re-registration with a new epoch
    svc.mutate(admin.unpin, "A", tuple(range(100, 108)), "w0")
    svc.mutate(admin.evict_tenant, "B", "", False)
    store.wait_snapshot()
    logged = sum(client.llen(store.keys.log(g)) for g in store.log_gens)
    assert logged == store.num_logged
    if snapshot_every == 1000:
        assert store.gen == 0 and logged == CALLS_LOGGED and client.exists("kvserve:snap:0") == 0  # all logged
    else:
        assert store.gen > 0 and client.exists(f"kvserve:snap:{store.gen}")
        assert logged < (snapshot_every if not background else CALLS_LOGGED)
        # the older generations are gone: one snapshot, the logs after it, and the counters
        live = live_keys(client, store)
        assert live["snap"] == [store.gen] and set(live["log"]) <= set(store.log_gens)  # an empty list is no key
        assert live["other"] == ["kvserve:gen", "kvserve:gens", "kvserve:owner"]
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


def test_a_step_is_logged_once_when_validated_and_replays_to_the_same_state(redis_url):
    client = connect(redis_url)
    svc = KVService(KVManager(), CallLog(client))
    svc.register_worker(spec("w0"))
    svc.step(StepOps(1, allocations=(alloc("a", "A", range(9)),)))
    assert client.llen("kvserve:log:0") == 2
    svc.step(StepOps(1, allocations=(alloc("a", "A", range(9)),)))  # a retried call: replayed, not logged again
    assert client.llen("kvserve:log:0") == 2
    with pytest.raises(InvalidRequest):
        svc.step(StepOps(2, extensions=(PageExtension("a", -1),)))  # refused by validation: never logged
    assert client.llen("kvserve:log:0") == 2
    # Sent before it is applied, a step is logged even when it turns out to change nothing ...
    svc.step(StepOps(3, frees=(PageFree("ghost"),)))
    assert client.llen("kvserve:log:0") == 3
    # ... and replaying it changes nothing either.
    restored = KVManager()
    CallLog(client).load(restored)
    assert {r: q.page_table for r, q in restored.requests.items()} == {"a": svc.manager.requests["a"].page_table}


def test_failed_append_is_kept_and_logged_once_when_the_retry_succeeds(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        store = CallLog(connect(server.url))
        svc = KVService(KVManager(), store)
        svc.register_worker(spec("w0"))
        server.stop()
        ops = StepOps(1, allocations=(alloc("a", "A", range(9)),))
        with pytest.raises(StoreUnavailable, match="retry the same call"):
            svc.step(ops)
        assert "a" in svc.manager.requests and not svc.store_ok  # applied in memory, not acknowledged
        applied = exact(svc.manager)
        with pytest.raises(StoreUnavailable):  # still down: the retry answers UNAVAILABLE again, applies nothing
            svc.step(ops)
        assert exact(svc.manager) == applied and len(store.pending) == 1
        server.start()
        store.client = connect(server.url)
        first = svc.step(ops)  # the retry replays the remembered answer and writes the kept record
        assert first.allocations[0].page_table == [0, 1, 2] and svc.store_ok and exact(svc.manager) == applied
        svc.step(StepOps(2, commits=(PageCommit("a", 0, tuple(range(8)), 9),)))
        assert store.client.llen("kvserve:log:0") == 3
        loaded, _ = reload(server.url)
        assert exact(loaded) == exact(svc.manager)
    finally:
        server.stop()


def test_a_store_on_a_closed_port_answers_unavailable_and_keeps_the_call():
    store = CallLog(connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5))  # nothing listens there
    svc = KVService(KVManager(), store)
    with pytest.raises(StoreUnavailable, match="ConnectionError"):
        svc.register_worker(spec("w0"))
    assert "w0" in svc.manager.pools and not svc.store_ok
    assert not svc.manager.changes.empty() and len(store.pending) == 1  # kept: the next call writes it


def test_a_step_whose_early_send_fails_is_logged_once_by_the_plain_write(redis_url, monkeypatch):
    """send_early queues the record, then cannot send it; write() then sends it, once."""
    client = connect(redis_url)
    svc = KVService(KVManager(), CallLog(client))
    svc.register_worker(spec("w0"))
    pool, calls = client.connection_pool, []
    get_connection = pool.get_connection

    def fail_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise redis.ConnectionError("refused")
        return get_connection(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", fail_first)
    assert svc.step(StepOps(1, allocations=(alloc("a", "A", range(9)),))).allocations[0].status is OpStatus.OK
    assert len(calls) >= 2 and client.llen("kvserve:log:0") == 2  # the registration, and the step once
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


@pytest.mark.parametrize("fault", ["redis killed before it appended", "reply lost after the append"])
def test_a_step_whose_early_append_fails_is_unavailable_then_durable_exactly_once_applied(tmp_path, fault):
    """The early RPUSH of a step fails after it was sent: the call is UNAVAILABLE and applied in memory; the
    retry sends the kept record again. If Redis had appended it, the log now holds it twice, and replaying
    the second copy only replays the call's remembered answers: the reload is exact either way."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        store = CallLog(connect(server.url))
        svc = KVService(KVManager(), store)
        svc.register_worker(spec("w0"))
        send_early = store.send_early

        def send_then_fail(record, now_ms=0):
            if fault == "redis killed before it appended":
                server.proc.send_signal(signal.SIGSTOP)  # the RPUSH waits in the socket, unread
                sent = send_early(record, now_ms)
                server.proc.kill()
                server.proc.wait()
                server.proc = None
            else:
                sent = send_early(record, now_ms)
                while store.client.llen("kvserve:log:0") < 2:  # Redis has appended it (and replied)
                    pass
                store.in_flight[0].disconnect()  # the reply is never read
            return sent

        store.send_early = send_then_fail
        ops = StepOps(1, allocations=(alloc("a", "A", range(9)),))
        with pytest.raises(StoreUnavailable):
            svc.step(ops)
        assert "a" in svc.manager.requests and store.in_flight is None and store.pending
        del store.send_early
        if server.proc is None:
            server.start()
            store.client = connect(server.url)
        assert svc.step(ops).allocations[0].page_table == [0, 1, 2]  # the retry: remembered answer, logged
        assert not store.pending
        expected = 2 if fault == "redis killed before it appended" else 3
        assert store.client.llen("kvserve:log:0") == expected
        svc.step(StepOps(2, commits=(PageCommit("a", 0, tuple(range(8)), 9),)))
        loaded, _ = reload(server.url)
        assert exact(loaded) == exact(svc.manager)
    finally:
        server.stop()


def test_reset_is_a_snapshot_and_empties_the_log(redis_url):
    client = connect(redis_url)
    svc = KVService(KVManager(), CallLog(client))
    build_history(svc)
    store = svc.store
    svc.mutate(admin.reset, True)  # force: requests are live
    assert client.llen(store.log_key) == 0 and client.exists(f"kvserve:snap:{store.gen}")
    assert live_keys(client, store)["snap"] == [store.gen] and client.exists("kvserve:log:0") == 0
    svc.step(StepOps(20, allocations=(alloc("z", "A", range(5), "w0"),)))
    loaded, store = reload(redis_url)
    assert exact(loaded) == exact(svc.manager) and store.num_logged == 1


def test_a_forgotten_worker_stays_forgotten_after_a_replay(redis_url):
    svc = KVService(KVManager(), CallLog(connect(redis_url)))
    build_history(svc)  # w1 holds live request e and cached blocks
    assert svc.mutate(admin.forget_worker, "w1", True).num_dropped_requests == 1
    svc.step(StepOps(30, allocations=(alloc("g", "A", range(5), "w0"),)))
    loaded, store = reload(redis_url)
    assert exact(loaded) == exact(svc.manager) and "w1" not in loaded.pools
    assert not [r for r in (*loaded.requests.values(), *loaded.stale.values()) if r.worker_id == "w1"]
    assert store.num_logged > 0  # replayed from the log, not read from a snapshot


@pytest.mark.parametrize("top_id", [65535, 65536, 2**32 - 1])
def test_a_step_record_narrows_token_ids_to_16_bits_only_when_every_id_fits(redis_url, top_id):
    """Ids up to 65535 are logged as uint16 (half the bytes for Redis to append); one id above that keeps the
    whole record at uint32. Either way the reload reproduces every page, hit and block."""
    client = connect(redis_url)
    svc = KVService(KVManager(), CallLog(client))
    svc.register_worker(spec("w0"))
    prompt = [7, 300, top_id, 9] * 2 + [5]  # two full pages and one token
    svc.step(StepOps(1, allocations=(alloc("a", "A", prompt, "w0"), alloc("b", "B", range(60000, 60009), "w0"))))
    svc.step(StepOps(2, commits=(PageCommit("a", 0, tuple(prompt[:8]), 9),)))
    hit = svc.step(StepOps(3, allocations=(alloc("c", "A", prompt[:8] + [1, 2], "w0"),), frees=(PageFree("a"),)))
    assert hit.allocations[0].num_cached_tokens == 8
    raw = raw_records(client, "kvserve:log:0")  # the store's client decodes text: the raw records
    steps = [r for r in raw if r.startswith(b'{"k":"step"')]
    width = 2 if top_id <= 65535 else 4
    for record in steps:
        header, _, body = record.partition(b"\n")
        header = json.loads(header)
        num_tokens = sum(a[-1] for a in header["a"]) + sum(c[2] for c in header["c"])
        assert header.get("w", 4) == width
        # uint16: one contiguous array; uint32: one blob per op, newline-joined
        assert len(body) == width * num_tokens + (0 if width == 2 else len(header["a"]) + len(header["c"]) - 1)
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


def test_the_log_is_snapshotted_once_it_holds_snapshot_bytes_even_under_snapshot_every_records(redis_url):
    client = connect(redis_url)
    store = CallLog(client, snapshot_every=1000, snapshot_bytes=600)
    svc = KVService(KVManager(), store)
    svc.register_worker(spec("w0", num_pages=64))
    sizes = []
    for i in range(1, 6):  # records of ~300 bytes (100 token ids as uint16, and the header)
        svc.step(StepOps(i, allocations=(alloc(f"r{i}", "A", range(100 * i, 100 * i + 100), "w0"),)))
        store.wait_snapshot()
        sizes.append(sum(len(r) for g in store.log_gens for r in raw_records(client, store.keys.log(g))))
    assert all(size < 600 for size in sizes), sizes  # the log never reaches the bound: a snapshot empties it
    assert min(sizes) < max(sizes) and store.gen > 0  # it filled, then was snapshotted
    loaded, store = reload(redis_url)
    assert exact(loaded) == exact(svc.manager) and store.num_logged_bytes == sizes[-1]


def test_a_call_sent_again_is_logged_once_and_a_new_call_with_the_same_ops_again(redis_url):
    """The same call again right after (same step_id) is a retry: it applies nothing, so it is logged once. A new
    call with the same ops (a newer step_id) is applied again, so it is logged again: it must not be taken for a
    retry (nothing to append, and the call refused)."""
    client = connect(redis_url)
    svc = KVService(KVManager(), CallLog(client))
    svc.register_worker(spec("w0"))
    svc.step(StepOps(1, allocations=(alloc("a", "A", range(9), "w0"),)))
    for _ in range(2):
        assert svc.step(StepOps(2, commits=(PageCommit("a", 0, (), 9),))).commits[0].status is OpStatus.OK
    assert client.llen("kvserve:log:0") == 3
    assert svc.step(StepOps(3, commits=(PageCommit("a", 0, (), 9),))).commits[0].status is OpStatus.OK
    assert client.llen("kvserve:log:0") == 4
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


def test_a_release_on_registration_is_logged_and_replays_exactly(redis_url):
    client = connect(redis_url)
    store = CallLog(client, snapshot_every=1000)
    svc = KVService(KVManager(), store)
    build_history(svc)
    assert svc.register_worker(spec("w0"), release_requests=True).released_req_ids == ("f",)
    registers = [json.loads(r.partition(b"\n")[0]) for r in raw_records(client, store.log_key)
                 if r.startswith(b'{"k":"register"')]
    # build_history's three registrations say nothing of releases, as records written before the flag
    assert [r["arg"] for r in registers] == [False, False, False, True]
    loaded, _ = reload(redis_url)
    assert set(loaded.requests) == {"e"} and exact(loaded) == exact(svc.manager)
