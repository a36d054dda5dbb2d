"""Tiny random-weight models saved as HF folders, for the sliding-window and attention-sink tests (HF's reference
to them is family_models.hf_model); a minimal
paged loop that releases the pages a window leaves behind; and a slow, obviously-correct StreamingLLM reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from family_models import save_model

from kvserve.common.pages import HOLE, num_pages_for

WINDOW = 40  # the tiny Mistral's sliding window, in tokens


def save_tiny(folder: Path, model_type: str, tokenizer_dir: Path, sliding_window: int | None = None,
              seed: int = 0) -> Path:
    """A 2-layer model of the default model's vocabulary (so its tokenizer serves it) with random weights
    large enough that attention decides the tokens (a window changes them)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  initializer_range=0.08, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if model_type == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return save_model(model, folder, tokenizer_dir)


@dataclass
class Seq:
    prompt: list[int]
    new_tokens: int
    output: list[int] = field(default_factory=list)
    computed: int = 0
    page_table: list[int] = field(default_factory=list)
    most_pages: int = 0  # the most pages it held in any step
    most_decode_pages: int = 0  # ... in a step that decoded it

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.new_tokens


def run_windowed(runner, prompts: list[list[int]], new_tokens: int, budget: int) -> list[Seq]:
    """Greedy generation through runner.step: decodes first, then prefill chunks under the token budget; before
    each step a sequence's pages that no query from its next position on reads become holes (released to the
    free list), as the gateway and kvmanager do."""
    from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

    page_size, window = runner.info.page_size, runner.window
    free = list(range(runner.info.num_pages))
    seqs = [Seq(p, new_tokens) for p in prompts]
    while not all(s.done for s in seqs):
        items, used = [], 0
        for s in sorted((s for s in seqs if not s.done), key=lambda s: s.computed < len(s.prompt)):
            n = 1 if s.computed >= len(s.prompt) else min(len(s.prompt) - s.computed, budget - used)
            if n <= 0:
                continue
            for k in window.releasable_pages(s.computed, page_size):
                if s.page_table[k] != HOLE:
                    free.append(s.page_table[k])
                    s.page_table[k] = HOLE
            while len(s.page_table) < num_pages_for(s.computed + n, page_size):
                s.page_table.append(free.pop(0))
            held = sum(p != HOLE for p in s.page_table)
            s.most_pages = max(s.most_pages, held)
            if n == 1:
                s.most_decode_pages = max(s.most_decode_pages, held)
            sample = s.computed + n >= len(s.prompt)
            items.append((s, StepItem(f"r{seqs.index(s)}", tuple(s.tokens[s.computed:s.computed + n]), s.computed,
                                      tuple(s.page_table), sample=sample, sampling=SamplingParams(temperature=0.0))))
            used += n
        out = {o.req_id: o for o in runner.step(StepBatch(tuple(it for _, it in items))).sampled}
        for s, item in items:
            s.computed += len(item.token_ids)
            if item.req_id in out:
                s.output.append(out[item.req_id].token_id)
    return seqs


def streaming_reference_logits(hf_model, tokens: list[int], window: int, sinks: int) -> torch.Tensor:
    """StreamingLLM, slowly and plainly: token by token, each layer's pre-RoPE keys and values of every token are
    kept; token t's query attends to exactly the kept tokens (the first `sinks` and the last `window`, itself
    included), with queries and keys rotated at their indices inside that kept list. Returns [len, vocab]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    m = hf_model.model
    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    keys = [[] for _ in m.layers]  # per layer: [kv_heads, head_dim] pre-RoPE, per token
    values = [[] for _ in m.layers]
    out = []
    with torch.no_grad():
        for t, tok in enumerate(tokens):
            kept = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))
            pos = torch.arange(len(kept))[None]
            x = m.embed_tokens(torch.tensor([[tok]]))
            for i, layer in enumerate(m.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                q = a.q_proj(h).view(1, 1, heads, head_dim).transpose(1, 2)
                keys[i].append(a.k_proj(h).view(kv_heads, head_dim))
                values[i].append(a.v_proj(h).view(kv_heads, head_dim))
                k = torch.stack([keys[i][j] for j in kept], dim=1)[None]  # [1, kv_heads, kept, d]
                v = torch.stack([values[i][j] for j in kept], dim=1)[None]
                cos, sin = m.rotary_emb(x, pos)
                q_rot, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
                _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
                k_rot, v = repeat_kv(k_rot, heads // kv_heads), repeat_kv(v, heads // kv_heads)
                att = torch.softmax(q_rot @ k_rot.transpose(-1, -2) / head_dim ** 0.5, dim=-1) @ v
                x = x + a.o_proj(att.transpose(1, 2).reshape(1, 1, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append(hf_model.lm_head(m.norm(x))[0, 0])
    return torch.stack(out)


def paged_logits(runner, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Every position's logits through the runner's model and pool, fed in chunks of the given sizes (the last
    one repeated until the tokens run out); the window's pages released before each chunk. [len, vocab]."""
    from kvserve.kernels.paged_attention import build_metadata

    page_size, window = runner.info.page_size, runner.window
    free, table, out, at, i = list(range(runner.info.num_pages)), [], [], 0, 0
    while at < len(tokens):
        n = min(chunks[min(i, len(chunks) - 1)], len(tokens) - at)
        for k in window.releasable_pages(at, page_size):
            if table[k] != HOLE:
                free.append(table[k])
                table[k] = HOLE
        while len(table) < num_pages_for(at + n, page_size):
            table.append(free.pop(0))
        meta = build_metadata([at], [n], [list(table)], page_size, runner.device, window)
        ids = torch.tensor(tokens[at:at + n])

        def run(ids=ids, meta=meta):
            return runner.model.logits(runner.model.forward(ids, meta, runner.kv_cache, runner.kv_scales))

        out.append(runner.call(run))
        at, i = at + n, i + 1
    return torch.cat(out)
