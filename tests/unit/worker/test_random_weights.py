"""random_weights (kvserve/worker/weights.py) for the Gemma 3 and MLA (DeepSeek-V2/V3) decoders: a runner made from a
folder holding only config.json prefills and decodes with finite logits; one seed gives the same weights twice (and
in any dtype, the same draws rounded); every tensor has the shape and dtype load_weights gives a saved HF model of
the same config, MoE layers included; the bench's tiny shapes (bench/gpu_models.py FAMILIES, which the GPU check
runs) build and agree with themselves on the CPU."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from gemma_models import gemma3_config, save_gemma3
from mla_models import save_tiny_mla

from kvserve.common.wire.worker import StepBatch, StepItem
from kvserve.worker.config import ModelConfig
from kvserve.worker.gemma import GemmaDecoder
from kvserve.worker.mla import MLADecoder
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.weights import load_weights, random_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from gpu_models import FAMILIES, cpu_agreement  # noqa: E402

CPU = torch.device("cpu")
PAGE = 16


def deepseek_v3_dict(**overrides) -> dict:
    """A 3-layer DeepSeek-V3 config dict (tests/support/mla_models.py's shapes): layer 0 dense, layers 1-2 routed
    MoE with a shared expert, q through q_a_proj / q_b_proj."""
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, n_group=2,
              topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2)
    return DeepseekV3Config(num_mtp_layers=0, **(kw | overrides)).to_dict()


CONFIGS = {
    "gemma3": lambda: gemma3_config(vocab_size=512).to_dict(),
    "deepseek_v3_moe": deepseek_v3_dict,
    "deepseek_v3_dense_q_proj": lambda: deepseek_v3_dict(q_lora_rank=None, first_k_dense_replace=3),
}
DECODERS = {"gemma3": GemmaDecoder, "deepseek_v3_moe": MLADecoder, "deepseek_v3_dense_q_proj": MLADecoder}


def config_folder(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def random_runner(folder: Path, seed: int = 0) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=folder, num_pages=16, page_size=PAGE, device="cpu", dtype="float32"),
                       make_weights=lambda m, dt, dev: random_weights(m, dt, dev, seed=seed))


def tensors(obj, path: str = "") -> dict[str, torch.Tensor | None]:
    """Every tensor (or None) of a weights object by its path: dataclass fields, list and tuple items."""
    if isinstance(obj, torch.Tensor) or obj is None:
        return {path: obj}
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, list | tuple):
        items = list(enumerate(obj))
    else:
        raise TypeError(f"{path}: {type(obj).__name__}")
    return {k: v for name, value in items for k, v in tensors(value, f"{path}.{name}").items()}


def layouts(weights) -> dict[str, tuple | None]:
    return {k: None if t is None else (tuple(t.shape), t.dtype) for k, t in tensors(weights).items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_random_runner_prefills_and_decodes_with_finite_logits(tmp_path, name):
    runner = random_runner(config_folder(tmp_path, CONFIGS[name]()))
    assert isinstance(runner.model, DECODERS[name])
    seen = []
    logits = runner.model.logits

    def record(hidden):
        out = logits(hidden)
        seen.append(out)
        return out

    runner.model.logits = record
    prompt, table = tuple(range(3, 40)), (0, 1, 2, 3)
    tokens = [runner.step(StepBatch((StepItem("r", prompt, 0, table),))).sampled[0].token_id]
    for i in range(4):
        step = runner.step(StepBatch((StepItem("r", (tokens[-1],), len(prompt) + i, table),)))
        tokens.append(step.sampled[0].token_id)
    vocab = runner.model_cfg.vocab_size
    assert len(seen) == 5 and all(t.shape[-1] == vocab and torch.isfinite(t).all() for t in seen)
    assert all(t.float().std() > 0 for t in seen)  # the logits depend on the tokens: no all-zero weights
    assert all(0 <= t < vocab for t in tokens)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_seed_gives_the_same_weights_in_any_dtype(name):
    cfg = ModelConfig.from_dict(CONFIGS[name]())
    a, b = (tensors(random_weights(cfg, torch.float32, CPU, seed=7)) for _ in range(2))
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    other = tensors(random_weights(cfg, torch.float32, CPU, seed=8))
    assert not _same(a[".embed"], other[".embed"])
    half = tensors(random_weights(cfg, torch.bfloat16, CPU, seed=7))
    for k, t in a.items():  # drawn in float32, then cast: the router stays float32 in both
        if t is not None:
            assert torch.equal(half[k].float(), t.to(half[k].dtype).float()), k


def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))


def test_gemma3_norms_are_drawn_near_zero_as_it_scales_by_one_plus_w():
    cfg = ModelConfig.from_dict(CONFIGS["gemma3"]())
    w = random_weights(cfg, torch.float32, CPU)
    norms = [w.final_norm] + [getattr(layer, n) for layer in w.layers
                              for n in ("input_norm", "post_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm",
                                        "k_norm")]
    assert all(n is not None and n.abs().max() < 0.2 and n.abs().max() > 0 for n in norms)
    assert w.layers[0].q_norm.shape == (cfg.head_dim,) and w.lm_head is w.embed  # tied


def test_mla_moe_layers_follow_first_k_dense_replace():
    cfg = ModelConfig.from_dict(CONFIGS["deepseek_v3_moe"]())
    layers = random_weights(cfg, torch.float32, CPU).layers
    assert layers[0].moe is None and layers[0].gate_up is not None
    for layer in layers[1:]:
        assert layer.gate_up is None and layer.down is None and len(layer.moe.experts) == 8
        assert layer.moe.router.dtype == torch.float32 and layer.moe.score_bias is not None
        assert layer.moe.shared is not None


@pytest.mark.parametrize("variant", ["gemma3", "dense", "moe_yarn", "v2_moe"])
def test_random_weights_have_load_weights_layout(tmp_path, model_dir, variant):
    """Every tensor's shape and dtype (and the tied LM head) as load_weights reads a saved HF model of the config."""
    folder = tmp_path / variant
    if variant == "gemma3":
        save_gemma3(folder, model_dir)
    else:
        save_tiny_mla(folder, model_dir, variant)
    cfg = ModelConfig.from_folder(folder)
    loaded, drawn = load_weights(folder, cfg, torch.float32, CPU), random_weights(cfg, torch.float32, CPU)
    assert layouts(drawn) == layouts(loaded)
    assert (drawn.lm_head is drawn.embed) == (loaded.lm_head is loaded.embed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_gpu_checks_family_shapes_run_on_the_cpu(tmp_path, family):
    """bench/gpu_models.py's tiny Gemma 3 and DeepSeek-V3 shapes (the GPU check's families) build their decoder
    and, on the CPU in float32, the cpu backend gives the reference backend's tokens."""
    result = cpu_agreement(tmp_path, FAMILIES[family], "cpu", [[5, 17, 33, 2, 9], list(range(40, 60))], 6,
                           dtype="float32")
    assert result["dtype"] == "float32" and result["agreement"] == 1.0, result
