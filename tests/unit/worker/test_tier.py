"""The worker's shared KV tier (kvserve/worker/tier.py, kvserve/worker/tier_writer.py) against a real embedded
redis-server, over small random pools (no model): pages written by one pool load byte for byte into another; a block is
reported written only once the store acknowledged it; a full queue, a down store and a missing reporter drop writes and
count them; an absent or damaged value fails its request alone and is reported missing; a down store fails
loads without a network call until its backoff passes; a failing kvmanager costs the report, not the counters."""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash
from prometheus_client import generate_latest

from kvserve.common.convert.tier import tier_report_from_proto, tier_report_to_proto
from kvserve.common.convert.worker import batch_from_proto, batch_to_proto, output_from_proto, output_to_proto
from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.metrics import WorkerMetrics
from kvserve.common.wire.tier import StoredBlock, StoreLoad, StoreWrite, TierCounters, TierReport, store_key
from kvserve.common.wire.worker import StepBatch, StepItem, StepOutput
from kvserve.worker.page_codec import HEADER, encode_page
from kvserve.worker.tier import KVTier, store_client

LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 2, 40, 4, 2, 8
NS = xxhash.xxh3_128_digest(b"tenant-a model-x")
FLUSH_S = 10.0
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


def block_hash(i: int) -> bytes:
    return xxhash.xxh3_128_digest(NS + i.to_bytes(4, "little"))


def make_pool(kind: str, seed: int = 0, random: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pool (and its scales) in kv_pool.py's layout: float32, or int8 with per-(token, kv head) scales."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    if kind == "float32":
        return (torch.randn(shape, generator=g) if random else torch.zeros(shape)), None
    pool = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8) if random else torch.zeros(shape,
                                                                                                     dtype=torch.int8)
    scales = torch.rand(shape[:-1], generator=g) if random else torch.ones(shape[:-1])
    return pool, scales


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Reports(list):
    """The kvmanager's end of ReportTier: every report, in order."""

    def __call__(self, report) -> None:
        self.append(report)

    def written(self) -> list[StoredBlock]:
        return [b for r in self for b in r.written]

    def missing(self) -> list[bytes]:
        return [h for r in self for h in r.missing]

    def counters(self) -> TierCounters:
        return sum((r.counters for r in self), TierCounters())


class GatedClient:
    """The store's client, whose pipelines wait for ``gate``: the writer thread holds its snapshot until the
    test opens it."""

    def __init__(self, client):
        self.client = client
        self.gate = threading.Event()

    def pipeline(self, **kw):
        self.gate.wait()
        return self.client.pipeline(**kw)

    def __getattr__(self, name):
        return getattr(self.client, name)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server(tmp_path):
    with EmbeddedRedis(tmp_path / "store") as s:
        yield s


@pytest.fixture
def tiers():
    made: list[KVTier] = []
    yield made
    for tier in made:
        if isinstance(tier.client, GatedClient):
            tier.client.gate.set()  # a failed test may leave its writer at the gate
        tier.close()


def make_tier(tiers, server, pool, scales, report=None, client=None, **kw) -> KVTier:
    tier = KVTier(client or store_client(server.url), pool, scales, report, "w0", lambda: 7, **kw)
    tiers.append(tier)
    return tier


def writes(page_ids, first_block: int = 0) -> list[StoreWrite]:
    return [StoreWrite(p, block_hash(first_block + i), NS, "tenant-a") for i, p in enumerate(page_ids)]


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_pages_written_by_one_pool_load_byte_for_byte_into_another(server, tiers, kind):
    pool, scales = make_pool(kind)
    reports = Reports()
    writer = make_tier(tiers, server, pool, scales, reports)
    sources = list(range(PAGES - 1, 3, -1))  # 36 pages: more than one pipeline and one MGET
    writer.snapshot_writes(writes(sources))
    assert writer.flush(FLUSH_S)
    value_bytes = HEADER.size + writer.page_bytes
    assert reports.written() == [StoredBlock(block_hash(i), "tenant-a", value_bytes) for i in range(len(sources))]
    assert {(r.worker_id, r.epoch) for r in reports} == {("w0", 7)}
    assert reports.counters() == TierCounters(num_written_pages=36, num_written_bytes=36 * value_bytes)

    other, other_scales = make_pool(kind, random=False)
    reader = make_tier(tiers, server, other, other_scales, Reports())
    targets = list(range(36))
    loads = [StoreLoad(t, block_hash(i), NS) for i, t in enumerate(targets)]
    assert reader.load({"r": loads[:30], "s": loads[30:]}) == set()
    assert torch.equal(as_bytes(other[:, :, targets]), as_bytes(pool[:, :, sources]))
    if scales is not None:
        assert torch.equal(as_bytes(other_scales[:, :, targets]), as_bytes(scales[:, :, sources]))
    stats = reader.stats()
    assert (stats.num_loaded_pages, stats.num_loaded_bytes, stats.num_failed_loads) == (36, 36 * value_bytes, 0)
    assert stats.load_s > 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_snapshot_holds_the_bytes_of_before_the_step(server, tiers, device):
    """The pages are copied at snapshot time (on CUDA, in stream order): a step that overwrites them before the
    writer runs changes nothing in the store."""
    pool = make_pool("float32")[0].to(device)
    before = pool[:, :, [2, 5]].cpu()
    client = GatedClient(store_client(server.url))
    tier = make_tier(tiers, server, pool, None, Reports(), client=client)
    tier.snapshot_writes(writes([2, 5]))
    pool[:, :, [2, 5]] = 0.0  # the step's forward pass reuses the pages
    client.gate.set()
    assert tier.flush(FLUSH_S)
    other, _ = make_pool("float32", random=False)
    assert make_tier(tiers, server, other, None).load({"r": [StoreLoad(0, block_hash(0), NS),
                                                             StoreLoad(1, block_hash(1), NS)]}) == set()
    assert torch.equal(other[:, :, [0, 1]], before)


def test_a_block_is_reported_written_only_once_the_store_acknowledged_it(server, tiers):
    pool, _ = make_pool("float32")
    reports = Reports()
    client = GatedClient(store_client(server.url))
    tier = make_tier(tiers, server, pool, None, reports, client=client)
    tier.snapshot_writes(writes([1]))
    assert not tier.flush(0.2) and reports.written() == []  # the writer holds it: not in the store yet
    client.gate.set()
    assert tier.flush(FLUSH_S) and [b.block_hash for b in reports.written()] == [block_hash(0)]

    server.kill()  # before the writer sends the next one
    tier.snapshot_writes(writes([2, 3], first_block=1))
    assert tier.flush(FLUSH_S)
    assert [b.block_hash for b in reports.written()] == [block_hash(0)]
    assert tier.stats().num_dropped_writes == 2 and tier.stats().num_written_pages == 1
    assert reports.counters().num_dropped_writes == 2  # the counters are reported all the same


def test_a_full_queue_drops_the_step_s_writes_and_counts_them(server, tiers):
    pool, _ = make_pool("float32")
    reports = Reports()
    client = GatedClient(store_client(server.url))
    page_bytes = pool[:, :, 0].nbytes
    tier = make_tier(tiers, server, pool, None, reports, client=client, max_pending_write_bytes=2 * page_bytes)
    tier.snapshot_writes(writes([0]))  # the writer takes it and waits at the gate, still holding its bytes
    tier.snapshot_writes(writes([1, 2], first_block=1))  # 3 pages would be pending: dropped, never blocks
    tier.snapshot_writes(writes([3], first_block=3))  # 2 pages: fits
    assert tier.stats().num_dropped_writes == 2
    client.gate.set()
    assert tier.flush(FLUSH_S)
    assert [b.block_hash for b in reports.written()] == [block_hash(0), block_hash(3)]
    assert reports.counters().num_dropped_writes == 2 and reports.counters().num_written_pages == 2


def test_without_a_reporter_writes_are_dropped_and_loads_still_work(server, tiers):
    pool, _ = make_pool("float32")
    tier = make_tier(tiers, server, pool, None, report=None)
    tier.snapshot_writes(writes([0, 1]))
    assert tier.flush(FLUSH_S)
    assert tier.stats().num_dropped_writes == 2 and server_keys(server) == []
    store_client(server.url).set(store_key(block_hash(9)), encode_page(NS, block_hash(9), pool, None, 0))
    assert tier.load({"r": [StoreLoad(5, block_hash(9), NS)]}) == set()
    assert torch.equal(pool[:, :, 5], pool[:, :, 0])


def server_keys(server) -> list[bytes]:
    return store_client(server.url).keys("*")


def put_values(server, pool, scales, page_ids) -> list[bytes]:
    """Stores pages of ``pool`` as blocks 0.. (as another worker would have); returns their hashes."""
    client = store_client(server.url)
    for i, p in enumerate(page_ids):
        client.set(store_key(block_hash(i)), encode_page(NS, block_hash(i), pool, scales, p))
    return [block_hash(i) for i in range(len(page_ids))]


def test_a_damaged_value_fails_its_request_alone_and_is_reported_missing(server, tiers):
    source, scales = make_pool("int8")
    h = put_values(server, source, scales, [0, 1, 2])
    client = store_client(server.url)
    value = bytearray(client.get(store_key(h[2])))
    value[-1] ^= 0xFF  # one payload byte flipped
    client.set(store_key(h[2]), bytes(value))
    pool, pool_scales = make_pool("int8", seed=1)
    before, before_scales = pool.clone(), pool_scales.clone()
    reports = Reports()
    tier = make_tier(tiers, server, pool, pool_scales, reports)
    failed = tier.load({"good": [StoreLoad(10, h[0], NS)],
                        "bad": [StoreLoad(11, h[1], NS), StoreLoad(12, h[2], NS)]})
    assert failed == {"bad"}
    assert torch.equal(pool[:, :, 10], source[:, :, 0]) and torch.equal(pool[:, :, 11], source[:, :, 1])
    assert torch.equal(pool[:, :, 12], before[:, :, 12]) and torch.equal(pool_scales[:, :, 12],
                                                                         before_scales[:, :, 12])
    stats = tier.stats()
    assert (stats.num_verify_failures, stats.num_failed_loads, stats.num_loaded_pages) == (1, 1, 2)
    assert tier.flush(FLUSH_S) and reports.missing() == [h[2]]
    assert reports.counters().num_verify_failures == 1


def test_an_absent_value_fails_its_request_and_is_reported_missing(server, tiers):
    pool, _ = make_pool("float32")
    before = pool.clone()
    reports = Reports()
    tier = make_tier(tiers, server, pool, None, reports)
    assert tier.load({"r": [StoreLoad(3, block_hash(42), NS)], "nothing to load": []}) == {"r"}
    assert torch.equal(pool, before)
    assert tier.stats().num_verify_failures == 0 and tier.stats().num_failed_loads == 1
    assert tier.flush(FLUSH_S) and reports.missing() == [block_hash(42)]


def test_a_down_store_fails_loads_fast_drops_writes_and_recovers_after_the_backoff(server, tiers):
    source, _ = make_pool("float32")
    (h,) = put_values(server, source, None, [4])
    pool, _ = make_pool("float32", random=False)
    clock, reports = Clock(), Reports()
    tier = make_tier(tiers, server, pool, None, reports, down_backoff_s=5.0, clock=clock)
    server.stop()
    assert tier.load({"a": [StoreLoad(0, h, NS)], "b": [StoreLoad(1, h, NS)]}) == {"a", "b"}
    server.start()  # back, with the value: only a call that reached it could succeed
    clock.now += 4.9
    assert tier.load({"a": [StoreLoad(0, h, NS)]}) == {"a"}  # down: no call made
    tier.snapshot_writes(writes([5]))
    assert tier.flush(FLUSH_S) and reports.written() == []
    assert not pool.any() and tier.stats().num_dropped_writes == 1 and tier.stats().num_failed_loads == 3
    assert reports.missing() == []  # a down store says nothing about the blocks

    clock.now += 0.2
    assert tier.load({"a": [StoreLoad(0, h, NS)]}) == set()
    assert torch.equal(pool[:, :, 0], source[:, :, 4])
    tier.snapshot_writes(writes([5], first_block=1))
    assert tier.flush(FLUSH_S) and [b.block_hash for b in reports.written()] == [block_hash(1)]


def test_a_failing_report_is_dropped_after_its_retries_and_its_counters_sent_later(server, tiers):
    pool, _ = make_pool("float32")
    calls: list = []

    def report(r):
        calls.append(r)
        if len(calls) <= 3:
            raise ConnectionError("kvmanager unavailable")

    tier = make_tier(tiers, server, pool, None, report)
    tier.snapshot_writes(writes([0]))
    assert tier.flush(FLUSH_S) and tier.flush(FLUSH_S)
    assert len(calls) == 4 and calls[0] == calls[1] == calls[2]  # the same report, tried three times
    assert [b.block_hash for b in calls[0].written] == [block_hash(0)]
    assert calls[3].written == () and calls[3].counters.num_written_pages == 1  # the counters, not the entry
    assert store_client(server.url).exists(store_key(block_hash(0)))  # the value stays, unrecorded


def test_the_tier_s_messages_cross_the_wire_unchanged():
    report = TierReport("w0", 7, (StoredBlock(block_hash(0), "t", 1080),), (block_hash(1),),
                        TierCounters(1, 2, 0.5, 3, 4, 5, 6, 7))
    assert tier_report_from_proto(tier_report_to_proto(report)) == report
    batch = StepBatch((StepItem("r", (1, 2), 8, (3, 4, 5), store_loads=(StoreLoad(3, block_hash(0), NS),)),),
                      epoch=9, store_writes=(StoreWrite(6, block_hash(1), NS, "t"),))
    assert batch_from_proto(batch_to_proto(batch)) == batch
    out = StepOutput(sampled=[], num_tokens=2, compute_ms=1.5, unloaded=["x"], num_loaded_pages=2, load_ms=0.25)
    assert output_from_proto(output_to_proto(out)) == out


def test_the_worker_s_metrics_read_the_tier_s_counters_at_scrape_time(server, tiers):
    pool, _ = make_pool("float32")
    tier = make_tier(tiers, server, pool, None, report=None)
    metrics = WorkerMetrics(tier.stats)
    tier.snapshot_writes(writes([0, 1, 2]))  # no reporter: dropped
    text = generate_latest(metrics.registry).decode()
    assert 'kvserve:kv_tier_dropped_writes_total{tier="store"} 3.0' in text
    assert 'kvserve:kv_tier_loaded_pages_total{tier="store"} 0.0' in text


def test_every_absent_value_of_a_request_is_reported_in_one_failed_load(server, tiers):
    """A store that lost its data must be forgotten in one failed load per request, not one per page; after the
    first failure nothing more is copied in (the request is recomputed)."""
    source, _ = make_pool("float32")
    present = put_values(server, source, None, [1, 2])
    pool, _ = make_pool("float32", random=False)
    reports = Reports()
    tier = make_tier(tiers, server, pool, None, reports)
    loads = [StoreLoad(0, block_hash(50), NS), StoreLoad(1, present[0], NS), StoreLoad(2, block_hash(51), NS),
             StoreLoad(3, present[1], NS)]
    assert tier.load({"r": loads}) == {"r"}
    assert not pool.any() and tier.stats().num_loaded_pages == 0
    assert tier.flush(FLUSH_S) and sorted(reports.missing()) == sorted([block_hash(50), block_hash(51)])
