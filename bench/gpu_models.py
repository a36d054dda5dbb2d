"""Random-weight models for GPU checks (bench/gpu_check.py, tests/unit/kernels/test_gpu.py): a folder holding only an HF
config.json, and a ModelRunner whose weights are drawn on the device (kvserve/worker/weights.py random_weights), so that
an 8B-shaped model runs with no download and no safetensors.

Also the decode timing of such a runner (step time against the weight-read floor) and its fidelity against HF
transformers on a tiny model.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kvserve.common.wire.worker import StepBatch, StepItem
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.weights import random_weights

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, rope_theta=10000.0)


# Tiny shapes of the two other decoders, as plain config dicts (the GPU machine may lack transformers): Gemma 3
# (sliding and full layers, 1 + w norms, tied embeddings) and DeepSeek-V3 (MLA with q_lora, every layer dense).
TINY_GEMMA3 = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
                   hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                   max_position_embeddings=4096, rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=16,
                   sliding_window=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
TINY_DEEPSEEK_V3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        first_k_dense_replace=2, vocab_size=256, max_position_embeddings=4096, rope_theta=10000.0)
FAMILIES = {"gemma3": TINY_GEMMA3, "deepseek_v3": TINY_DEEPSEEK_V3}
LLAMA_FIELDS = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def write_config(folder: Path, shape: dict) -> Path:
    """An HF config.json of ``shape`` in ``folder`` (Llama's fields unless the shape names its own, e.g. its
    model_type); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA_FIELDS, **shape}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_runner(folder: Path, shape: dict, device: str, dtype: str, num_pages: int, backend: str = "auto",
                  cuda_graphs: bool = True, seed: int = 0, std: float = 0.02, page_size: int = 16,
                  draw_device: str | None = None) -> ModelRunner:
    """A runner of ``shape`` with random weights drawn on ``device`` (or on ``draw_device``, then moved)."""
    cfg = RunnerConfig(model_dir=write_config(folder, shape), device=device, dtype=dtype, num_pages=num_pages,
                       page_size=page_size, attention_backend=backend, cuda_graphs=cuda_graphs)
    return ModelRunner(cfg, make_weights=lambda m, dt, dev: random_weights(m, dt, dev, seed=seed, std=std,
                                                                           draw_device=draw_device))


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step reads of the weights: every layer's matrices and norms, the final norm, the LM head
    (the embedding's rows read are negligible)."""
    w = runner.model.weights
    tensors = [t for layer in w.layers for t in (layer.input_norm, layer.qkv, layer.o, layer.post_norm,
                                                 layer.gate_up, layer.down) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*tensors, w.final_norm, w.lm_head])


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, pages_per_seq: int) -> list[list[int]]:
    """Greedy generation of every prompt together: one prefill step, then one decode step per token."""
    tables = [tuple(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(len(prompts))]
    items = [StepItem(f"r{b}", tuple(p), 0, tables[b]) for b, p in enumerate(prompts)]
    out = [[s.token_id] for s in runner.step(StepBatch(tuple(items))).sampled]
    for step in range(new_tokens - 1):
        items = [StepItem(f"r{b}", (out[b][-1],), len(p) + step, tables[b]) for b, p in enumerate(prompts)]
        for b, s in enumerate(runner.step(StepBatch(tuple(items))).sampled):
            out[b].append(s.token_id)
    return out


def cpu_agreement(folder: Path, shape: dict, device: str, prompts: list[list[int]], new_tokens: int,
                  dtype: str = "auto", std: float = 0.1, cuda_graphs: bool = True, backend: str = "auto") -> dict:
    """Greedy tokens of a random-weight runner of ``shape`` on ``device`` (``dtype``, auto: bf16 on CUDA; ``backend``)
    against a float32 reference-backend runner on the CPU over the same weights (drawn on the CPU): the agreement
    rate (tokens equal before each sequence's first difference, over all tokens) and both token lists."""
    pages = -(-(max(map(len, prompts)) + new_tokens) // 16)
    cpu = random_runner(folder / "reference", shape, "cpu", "float32", pages * len(prompts), backend="reference",
                        std=std, draw_device="cpu")
    dev = random_runner(folder / "device", shape, device, dtype, pages * len(prompts), std=std, draw_device="cpu",
                        cuda_graphs=cuda_graphs, backend=backend)
    ref, got = (greedy(r, prompts, new_tokens, pages_per_seq=pages) for r in (cpu, dev))
    agree = sum(_prefix_agreement(a, b) for a, b in zip(got, ref, strict=True))
    return {"agreement": agree / (len(prompts) * new_tokens), "dtype": str(dev.dtype).removeprefix("torch."),
            "backend": dev.info.attention_backend, "tokens": got, "reference": ref}


def decode_step_ms(runner: ModelRunner, batch: int, context: int, steps: int, warmup: int = 3) -> float:
    """Median wall time of a decode step of ``batch`` sequences at ``context`` cached tokens (the pool's zeros
    stand for their K/V: the time does not depend on the values), sampling included."""
    pages = -(-(context + warmup + steps + 1) // runner.info.page_size)
    times = []
    for step in range(warmup + steps):
        items = tuple(StepItem(f"r{b}", (7,), context + step, tuple(range(b * pages, (b + 1) * pages)))
                      for b in range(batch))
        t0 = time.perf_counter()
        runner.step(StepBatch(items))
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[warmup:])


def hf_fidelity(folder: Path, device: str, new_tokens: int, prompts: list[list[int]], backend: str = "auto") -> dict:
    """A tiny random HF Llama against kvserve on the same weights, both generating greedily from the same
    prompts: in float32 the tokens must be identical; in bf16, the agreement rate (tokens equal before each
    sequence's first difference, over all tokens). {"skipped": why} when transformers does not import."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # not on the GPU machine: the rest of the check still runs
        return {"skipped": f"transformers not importable: {type(e).__name__}: {e}"}
    torch.manual_seed(0)
    config = json.loads(write_config(folder, TINY_LLAMA).joinpath("config.json").read_text())
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    hf.save_pretrained(folder)
    result = {}
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = hf.to(device=device, dtype=torch_dtype)
        ref = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            ref.append(gen[0, len(p):].tolist())
        runner = ModelRunner(RunnerConfig(model_dir=folder, device=device, dtype=dtype, num_pages=64 * len(prompts),
                                          attention_backend=backend))
        ours = greedy(runner, prompts, new_tokens, 64)
        agree = [_prefix_agreement(a, b) for a, b in zip(ours, ref, strict=True)]
        result[dtype] = {"identical": ours == ref, "agreement": sum(agree) / (len(agree) * new_tokens),
                         "backend": runner.info.attention_backend}
    return result


def _prefix_agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference (after it, the two continue from different text)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
