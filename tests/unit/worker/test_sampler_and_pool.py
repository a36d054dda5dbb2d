"""Sampling on the worker and the exact sizing of the KV page pool."""

from __future__ import annotations

import pytest
import torch

from kvserve.common.wire.worker import SamplingParams
from kvserve.kernels.kv_quant import kv_format
from kvserve.worker.config import ModelConfig
from kvserve.worker.kv_pool import allocate_pool, allocate_scales, size_pool
from kvserve.worker.sampler import sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0]])


def draw(params: SamplingParams, position=10, n=1, logits=LOGITS, rng=None):
    rng = rng or torch.Generator().manual_seed(0)
    return [sample(["r"], logits, [params], [position], rng)[0].token_id for _ in range(n)]


def test_greedy_is_argmax_with_its_logprob():
    out = sample(["a"], LOGITS, [SamplingParams()], [0], torch.Generator())[0]
    assert out.token_id == 4
    assert out.logprob == pytest.approx(torch.log_softmax(LOGITS[0], -1)[4].item())


def test_top_k_keeps_only_the_k_best():
    assert set(draw(SamplingParams(temperature=5.0, top_k=2), n=300)) == {0, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS[0], -1)  # token 4: 0.58, token 0: 0.21, token 1: 0.08, ...
    assert probs[4] < 0.7 < probs[4] + probs[0]
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.7), n=300)) == {0, 4}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.1), n=50)) == {4}  # the best token always stays


def test_high_temperature_reaches_every_token():
    assert set(draw(SamplingParams(temperature=50.0), n=600)) == set(range(6))


def test_seeded_sampling_depends_only_on_seed_and_position():
    p = SamplingParams(temperature=1.0, seed=1234)
    first = [draw(p, position=pos, rng=torch.Generator().manual_seed(pos))[0] for pos in range(40)]
    again = [draw(p, position=pos, rng=torch.Generator().manual_seed(99))[0] for pos in range(40)]
    assert first == again, "the worker's own generator must not matter for a seeded request"
    other = [draw(SamplingParams(temperature=1.0, seed=4321), position=pos)[0] for pos in range(40)]
    assert first != other


def test_seeded_row_is_independent_of_its_batch():
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(["a"], LOGITS, [p], [5], torch.Generator())[0].token_id
    logits = torch.cat([torch.randn(3, 6), LOGITS])
    params = [SamplingParams(temperature=1.0)] * 3 + [p]
    batched = sample(["x", "y", "z", "a"], logits, params, [1, 2, 3, 5], torch.Generator())[3].token_id
    assert alone == batched


SMOL = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                   max_position_embeddings=8192, tie_word_embeddings=True)


def test_bytes_per_token_formula():
    assert SMOL.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46080
    assert SMOL.kv_bytes_per_token(2) == 23040


@pytest.mark.parametrize("dtype,per_token", [(torch.float32, 46080), (torch.bfloat16, 23040)])
def test_pool_from_byte_budget_rounds_down_to_whole_pages(dtype, per_token):
    page_bytes = per_token * 16
    spec = size_pool(SMOL, dtype, 16, kv_cache_bytes=10 * page_bytes + page_bytes - 1)
    assert spec.num_pages == 10 and spec.pool_bytes == 10 * page_bytes
    pool = allocate_pool(SMOL, spec, torch.device("cpu"))
    assert pool.nbytes == spec.pool_bytes and pool.shape == (30, 2, 10, 16, 3, 64)
    assert pool.count_nonzero() == 0


@pytest.mark.parametrize("kv_dtype,kv_scales,per_token,scale_shape", [
    ("int8", "token_head", 2 * 30 * 3 * (64 + 4), (30, 2, 10, 16, 3)),
    ("fp8_e4m3", "token_head", 2 * 30 * 3 * (64 + 4), (30, 2, 10, 16, 3)),
    ("fp8_e5m2", "tensor", 2 * 30 * 3 * 64, None),
    ("float16", "token_head", 23040, None),  # scales apply to the quantised dtypes only
])
def test_a_quantised_pool_counts_its_scales_in_its_bytes(kv_dtype, kv_scales, per_token, scale_shape):
    spec = size_pool(SMOL, kv_dtype, 16, kv_scales=kv_scales, num_pages=10)
    assert spec.bytes_per_token == per_token and spec.pool_bytes == 10 * 16 * per_token
    pool, scales = allocate_pool(SMOL, spec, torch.device("cpu")), allocate_scales(SMOL, spec, torch.device("cpu"))
    assert pool.shape == (30, 2, 10, 16, 3, 64) and pool.dtype == kv_format(kv_dtype).dtype
    assert (None if scales is None else tuple(scales.shape)) == scale_shape
    assert pool.nbytes + (0 if scales is None else scales.nbytes) == spec.pool_bytes


def test_pool_sizing_errors():
    with pytest.raises(ValueError, match="holds no page"):
        size_pool(SMOL, torch.float32, 16, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="exactly one"):
        size_pool(SMOL, torch.float32, 16)
    with pytest.raises(ValueError, match="exactly one"):
        size_pool(SMOL, torch.float32, 16, kv_cache_bytes=10**9, num_pages=4)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'; known: auto, float32, bfloat16, float16, "
                                         "int8, fp8_e4m3, fp8_e5m2"):
        size_pool(SMOL, "int4", 16, num_pages=4)
    with pytest.raises(ValueError, match="unknown KV scales 'channel'; known: token_head, tensor"):
        size_pool(SMOL, "int8", 16, kv_scales="channel", num_pages=4)
