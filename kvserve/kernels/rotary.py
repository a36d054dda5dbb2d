"""Rotary position embeddings (RoPE), in the "rotate half" layout HF Llama checkpoints use, with the frequency
scalings HF configs name: linear, llama3 and yarn (whose attention factor scales cos and sin)."""

from __future__ import annotations

import math

import torch


def frequencies(head_dim: int, theta: float, rope_scaling: dict | None, max_positions: int
                ) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the attention factor cos and sin are multiplied by (1.0 but for yarn), for
    any scaling a config names."""
    if scaling_kind(rope_scaling) == "yarn":
        return yarn_frequencies(head_dim, theta, rope_scaling, max_positions)
    return inverse_frequencies(head_dim, theta, rope_scaling), 1.0


def scaling_kind(rope_scaling: dict | None) -> str:
    """The rope_scaling type a config names ("default" for none)."""
    return (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """``1 / theta^(2i/d)`` for i in [0, d/2), with linear or Llama-3 style frequency scaling when configured
    (yarn, which also scales cos and sin: ``frequencies``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling_kind(rope_scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_scaling(inv_freq, rope_scaling)
    if kind == "yarn":
        raise ValueError("yarn scales cos and sin too: take its frequencies with rotary.frequencies")
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")


def _llama3_scaling(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor, low, high = float(cfg["factor"]), float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    old_len = float(cfg["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int, factor: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``cos`` and ``sin`` of shape [max_positions, head_dim] (fp32), times the attention factor."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale, Eq. 21: ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, theta: float, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and attention factor, as transformers' _compute_yarn_parameters computes them."""
    old = float(s["original_max_position_embeddings"])
    factor = float(s["factor"]) if s.get("factor") is not None else max_positions / old
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim else \
            yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    extrapolation = 1 - ramp.clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention)



def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
