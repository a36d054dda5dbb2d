"""The shared KV tier through the model runner (a tiny random-weight Llama, and an MLA model whose pages hold one
latent plane; a real embedded redis-server): a
writes-only step sends a prompt's pages to the store; a second worker, its pool empty, fills them from the store
and samples exactly what recomputing them gives; an item whose load fails is not computed (unloaded), the
step's others are."""

from __future__ import annotations

import pytest
import xxhash
from tier_runners import CONFIG, MLA_CONFIG, tier_runners

from kvserve.common.wire.tier import StoreLoad, StoreWrite
from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

PROMPT = tuple(range(7, 20))  # 13 tokens: 3 full pages and 1 token past them
NS = xxhash.xxh3_128_digest(b"tenant model")
HASHES = [xxhash.xxh3_128_digest(NS + bytes([i])) for i in range(3)]
TOP = SamplingParams(top_logprobs=5)


@pytest.fixture
def make_runner(tmp_path):
    with tier_runners(tmp_path) as make:
        yield make


@pytest.fixture(params=["llama", "mla"])
def make_any_runner(request, tmp_path):
    with tier_runners(tmp_path, {"llama": CONFIG, "mla": MLA_CONFIG}[request.param]) as make:
        yield make


def last_token(table, loads=(), req_id="r") -> StepItem:
    """The prompt's last token, its first 12 positions cached (in the pool, or as store loads)."""
    return StepItem(req_id, PROMPT[12:], 12, table, sampling=TOP, store_loads=tuple(loads))


def test_pages_a_worker_wrote_load_into_another_and_sample_what_recomputing_gives(make_any_runner):
    make_runner = make_any_runner
    a = make_runner()
    reports = []
    a.tier.set_report(reports.append)
    assert a.info.kv_store
    a.step(StepBatch((StepItem("r", PROMPT[:12], 0, (5, 6, 7, 8), sample=False),)))
    recomputed = a.step(StepBatch((last_token((5, 6, 7, 8)),)))
    writes = tuple(StoreWrite(p, h, NS, "t") for p, h in zip((5, 6, 7), HASHES, strict=True))
    out = a.step(StepBatch((), store_writes=writes))  # a writes-only step
    assert (out.sampled, out.num_tokens, out.rejected, out.unloaded) == ([], 0, [], [])
    assert a.tier.flush(10.0) and [b.block_hash for r in reports for b in r.written] == HASHES

    b = make_runner()
    loads = [StoreLoad(p, h, NS) for p, h in zip((1, 2, 3), HASHES, strict=True)]
    absent = [StoreLoad(9, xxhash.xxh3_128_digest(b"never written"), NS)]
    loaded = b.step(StepBatch((last_token((1, 2, 3, 4), loads), last_token((9, 10, 11, 12), absent, "x"))))
    assert loaded.unloaded == ["x"] and loaded.num_loaded_pages == 3 and loaded.num_tokens == 1
    assert loaded.load_ms > 0 and loaded.rejected == []
    assert loaded.sampled == recomputed.sampled  # token, logprob and top logprobs, exactly
    assert b.tier.stats().num_loaded_pages == 3 and b.tier.stats().num_failed_loads == 1
    unfilled = b.step(StepBatch((last_token((13, 14, 15, 0)),)))  # the same step over pages never filled
    assert unfilled.sampled[0].logprob != recomputed.sampled[0].logprob  # so the loaded pages made the answer


def test_a_worker_without_a_store_fails_every_load_and_ignores_writes(make_runner):
    plain = make_runner(kv_store_url="")
    assert plain.tier is None and not plain.info.kv_store
    out = plain.step(StepBatch((last_token((1, 2, 3, 4), [StoreLoad(1, HASHES[0], NS)]),
                                StepItem("y", PROMPT, 0, (5, 6, 7, 8))),
                               store_writes=(StoreWrite(5, HASHES[0], NS, "t"),)))
    assert out.unloaded == ["r"] and [s.req_id for s in out.sampled] == ["y"] and out.num_tokens == len(PROMPT)
