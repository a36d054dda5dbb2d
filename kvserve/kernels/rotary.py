"""Rotary position embeddings (RoPE), in the "rotate half" layout HF Llama checkpoints use."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """``1 / theta^(2i/d)`` for i in [0, d/2), with Llama-3 style frequency scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_scaling(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


def _llama3_scaling(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor, low, high = float(cfg["factor"]), float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    old_len = float(cfg["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``cos`` and ``sin`` of shape [max_positions, head_dim] (fp32)."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
