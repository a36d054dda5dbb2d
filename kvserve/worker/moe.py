"""Routed mixtures of experts, as HF computes them, for every decoder that has them: DeepSeek-V2/V3's (with their MLA,
kvserve/worker/mla.py) and Qwen3-MoE's (with LlamaDecoder). A MoE layer's MLP is a router over ``n_routed_experts``
gated MLPs, of which each token runs ``num_experts_per_tok``, weighted, plus any shared experts every token runs::

    router(x) -> scores [T, E] -> top-k experts per token (within the best groups)  -> weights [T, k]
    out = sum_k weight_k * expert_k(x) + shared(x)

The experts keep HF's per-expert matrices, gate and up fused, packed for the backend's ``linear`` like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class MoEParams:
    """Which layers route and how: ``num_experts_per_tok`` of ``n_routed_experts`` chosen per token (within
    ``topk_group`` of ``n_group`` groups), plus ``n_shared_experts``. DeepSeek routes every layer from
    ``first_k_dense_replace`` on; Qwen3-MoE every ``sparse_step``-th layer but its ``dense_layers``."""

    first_k_dense_replace: int  # layers [0, k) have a dense MLP
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "sigmoid" (V3: + e_score_correction_bias) or "softmax" (V2, Qwen3-MoE)
    topk_method: str  # "noaux_tc" (V3), "greedy" (V2, Qwen3-MoE) or "group_limited_greedy" (V2)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP whatever else says (Qwen3-MoE's mlp_only_layers)
    sparse_step: int = 1  # layer i routes when (i + 1) % sparse_step == 0 (Qwen3-MoE's decoder_sparse_step)

    def is_moe_layer(self, layer: int) -> bool:
        return (layer >= self.first_k_dense_replace and layer not in self.dense_layers
                and (layer + 1) % self.sparse_step == 0)


@dataclass(slots=True)
class MoEWeights:
    router: torch.Tensor  # [n_routed_experts, hidden] float32 (HF keeps it in fp32)
    score_bias: torch.Tensor | None  # [n_routed_experts] float32: V3's e_score_correction_bias
    experts: list[tuple[torch.Tensor, torch.Tensor]]  # per expert: gate_up [2 I, hidden], down [hidden, I]
    shared: tuple[torch.Tensor, torch.Tensor] | None  # shared experts' gate_up, down (None: none)


def gate_up(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """An MLP's gate and up projections fused into one matrix (one GEMM)."""
    return torch.cat([t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"]])


def load_moe(t: dict[str, torch.Tensor], mlp: str, moe: MoEParams, cast) -> MoEWeights:
    """A MoE layer's tensors under ``mlp`` (``model.layers.{i}.mlp.``): the router (``gate``), the experts, the
    shared experts (DeepSeek's ``shared_experts``)."""
    experts = [(cast(gate_up(t, f"{mlp}experts.{e}.")), cast(t[f"{mlp}experts.{e}.down_proj.weight"]))
               for e in range(moe.n_routed_experts)]
    bias = t.get(mlp + "gate.e_score_correction_bias")
    shared = (cast(gate_up(t, mlp + "shared_experts.")), cast(t[mlp + "shared_experts.down_proj.weight"])) \
        if moe.n_shared_experts else None
    device = experts[0][1].device
    return MoEWeights(router=t[mlp + "gate.weight"].to(device, torch.float32),
                      score_bias=None if bias is None else bias.to(device, torch.float32),
                      experts=experts, shared=shared)


def pack_moe(w: MoEWeights | None, pack) -> MoEWeights | None:
    """The experts' matrices in the backend's packed layout (the router stays a plain float32 tensor)."""
    if w is None:
        return None
    return replace(w, experts=[(pack(gu), pack(d)) for gu, d in w.experts],
                   shared=None if w.shared is None else (pack(w.shared[0]), pack(w.shared[1])))


def route(x: torch.Tensor, w: MoEWeights, p: MoEParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, [T, k] each, as HF's DeepseekV3TopkRouter (sigmoid scores, the
    correction bias for choosing only, the best groups' experts), DeepseekV2's (softmax, greedy or
    group-limited) or Qwen3-MoE's (softmax, greedy, renormalised when norm_topk_prob) computes them, in float32."""
    scores = F.linear(x.float(), w.router)
    num_tokens, groups = scores.shape[0], p.n_group
    if p.scoring_func == "sigmoid":
        scores = scores.sigmoid()
        choice = scores if w.score_bias is None else scores + w.score_bias
        group_scores = choice.view(num_tokens, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        scores = choice = scores.softmax(dim=-1, dtype=torch.float32)
        group_scores = scores.view(num_tokens, groups, -1).max(dim=-1).values
    if p.topk_method != "greedy":
        group_idx = torch.topk(group_scores, k=p.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep[:, :, None].expand(-1, -1, p.n_routed_experts // groups).reshape(num_tokens, -1)
        choice = choice.masked_fill(~keep, float("-inf") if p.scoring_func == "sigmoid" else 0.0)
    topk_idx = torch.topk(choice, k=p.num_experts_per_tok, dim=-1, sorted=False)[1]
    topk_w = scores.gather(1, topk_idx)
    if p.norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_w * p.routed_scaling_factor, topk_idx


def random_moe(p: MoEParams, hidden: int, d, router_dtype: torch.dtype | None = None) -> MoEWeights:
    """Random experts in load_moe's layout, drawn by ``d`` (random_draws.Draws): the router (in ``router_dtype``,
    else the weights' own, then float32 as load_moe keeps it), V3's correction bias at 0 as HF starts it, the
    routed experts, the shared ones."""
    router = d.mat(p.n_routed_experts, hidden, dtype=router_dtype).float()
    bias = torch.zeros(p.n_routed_experts, device=d.device) if p.topk_method == "noaux_tc" else None
    experts = [d.gated_mlp(hidden, p.moe_intermediate_size) for _ in range(p.n_routed_experts)]
    shared = d.gated_mlp(hidden, p.moe_intermediate_size * p.n_shared_experts) if p.n_shared_experts else None
    return MoEWeights(router=router, score_bias=bias, experts=experts, shared=shared)


def feed_forward(x: torch.Tensor, layer, p: MoEParams | None, backend) -> torch.Tensor:
    """A layer's MLP on the backend: its routed experts when it has them (``layer.moe``), else its gated MLP."""
    def dense(x: torch.Tensor, gate_up, down) -> torch.Tensor:
        return backend.linear(backend.silu_mul(backend.linear(x, gate_up)), down)

    return dense(x, layer.gate_up, layer.down) if layer.moe is None else run_moe(x, layer.moe, p, dense)


def run_moe(x: torch.Tensor, w: MoEWeights, p: MoEParams,
            dense: Callable[[torch.Tensor, object, object], torch.Tensor]) -> torch.Tensor:
    """The routed experts' weighted sum, expert by expert in id order (as HF adds them), plus the shared experts;
    ``dense(x, gate_up, down)`` is the decoder's gated MLP on the backend."""
    topk_w, topk_idx = route(x, w, p)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_idx).tolist():
        tokens, slot = torch.where(topk_idx == e)
        y = dense(x[tokens], *w.experts[e]) * topk_w[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out if w.shared is None else out + dense(x, *w.shared)
