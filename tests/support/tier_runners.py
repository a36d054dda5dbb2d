"""Model runners with a shared KV tier for the worker's tier tests: a tiny random-weight Llama (PAGE tokens per
page, 16 pages) on the reference backend, every runner made by one ``tier_runners`` block reading and writing the
same real embedded redis-server. Tests using it are slow-lane (tests/conftest.py: they build model runners)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.weights import random_weights

PAGE = 4
CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# A DeepSeek-V3 with MLA (dense MLPs): its pages hold one latent plane, and move through the tier the same way.
MLA_CONFIG = {**CONFIG, "model_type": "deepseek_v3", "kv_lora_rank": 16, "qk_rope_head_dim": 8,
              "qk_nope_head_dim": 8, "v_head_dim": 8, "q_lora_rank": None, "first_k_dense_replace": 2,
              "n_routed_experts": 0}


@contextlib.contextmanager
def tier_runners(tmp_path: Path, config: dict = CONFIG):
    """Yields ``make(**RunnerConfig overrides) -> ModelRunner`` of ``config``'s model, each runner on the block's
    store unless given another ``kv_store_url`` ("" for none); their tiers are flushed and closed, and the store
    stopped, after."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    server = EmbeddedRedis(tmp_path / "store")
    runners: list[ModelRunner] = []

    def make(**kw) -> ModelRunner:
        cfg = RunnerConfig(model_dir=tmp_path / "model", num_pages=16, page_size=PAGE, device="cpu", dtype="float32",
                           attention_backend="reference", **{"kv_store_url": server.url, **kw})
        runners.append(ModelRunner(cfg, make_weights=lambda m, dtype, device: random_weights(m, dtype, device,
                                                                                             std=0.1)))
        return runners[-1]

    try:
        yield make
    finally:
        for r in runners:
            r.close_tier(5.0)
        server.stop()
