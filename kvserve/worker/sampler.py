"""Token sampling on the worker: greedy, temperature, top-k, top-p, per-request seeds.

Stateless across steps: a seeded request's generator is derived from (seed, position of the sampled token),
so the same request sampled on any worker, in any batch, draws the same token.
"""

from __future__ import annotations

import torch

from kvserve.common.wire.worker import SampledToken, SamplingParams
from kvserve.kernels.reference import argmax_logsumexp

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the 64-bit space
_MAX_SEED = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    return (seed * _SEED_MIX + position) & _MAX_SEED


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p; removed tokens get -inf. logits: [vocab] fp32."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits


def _draw(logits: torch.Tensor, params: SamplingParams, position: int, rng: torch.Generator) -> int:
    probs = _filter(logits, params).softmax(-1)
    if params.seed is not None:
        rng = torch.Generator(device=logits.device).manual_seed(position_seed(params.seed, position))
    return int(torch.multinomial(probs, 1, generator=rng))


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of ``logits`` [n, vocab] that hold a NaN or an infinity: no token can be drawn from them (softmax
    is NaN, multinomial raises, argmax is arbitrary), so their requests fail alone."""
    bad = ~torch.isfinite(logits).all(dim=-1)
    return bad.nonzero().flatten().tolist() if bool(bad.any()) else []


def sample(
    req_ids: list[str],
    logits: torch.Tensor,  # [n, vocab] fp32, one row per sampled item
    params: list[SamplingParams],
    positions: list[int],  # position the sampled token will occupy, per row
    rng: torch.Generator,
    stats=argmax_logsumexp,  # an attention backend's own may be faster (the runner passes it)
) -> list[SampledToken]:
    """Picks one token per row and reports its logprob under the raw distribution, logit - logsumexp(row)."""
    ids, lse = stats(logits)
    greedy_ids, lse = ids.tolist(), lse.tolist()
    tokens = [greedy_ids[row] if p.greedy else _draw(logits[row], p, positions[row], rng)
              for row, p in enumerate(params)]
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    out = []
    for row, (req_id, p) in enumerate(zip(req_ids, params, strict=True)):
        top: list[tuple[int, float]] = []
        if p.top_logprobs:
            vals, top_ids = torch.topk(logits[row], p.top_logprobs)
            top = [(i, v - lse[row]) for i, v in zip(top_ids.tolist(), vals.tolist(), strict=True)]
        out.append(SampledToken(req_id, tokens[row], chosen[row] - lse[row], top))
    return out
