"""What the worker does not serve is refused at start-up, by name: an architecture outside the served families
(named with its HF class), and a quantised checkpoint, whose weights the loader would read as plain floats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.worker.config import ModelConfig, UnsupportedModel

SHAPE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2}


@pytest.mark.parametrize("model_type, cls", [("phi3", "Phi3ForCausalLM"), ("olmo2", "Olmo2ForCausalLM"),
                                             ("llama4", "Llama4ForConditionalGeneration")])
def test_an_architecture_not_served_is_named_with_what_is(model_type, cls):
    with pytest.raises(UnsupportedModel) as e:
        ModelConfig.from_dict({**SHAPE, "model_type": model_type, "architectures": [cls]})
    assert f"'{model_type}' ({cls}) is not served" in str(e.value)
    assert all(t in str(e.value) for t in ("qwen3", "gemma3_text", "deepseek_v3", "gemma3"))


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_a_quantised_checkpoint_is_refused_rather_than_read_as_floats(model_type):
    raw = {**SHAPE, "model_type": model_type, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
           "v_head_dim": 4, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(UnsupportedModel, match=r"quantised checkpoint weights \(fp8\)"):
        ModelConfig.from_dict(raw)


def test_kvserve_worker_exits_with_a_usage_error_naming_the_architecture(tmp_path: Path, model_dir):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "phi3",
                                                      "architectures": ["Phi3ForCausalLM"]}))
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "model.safetensors").touch()
    kvserve = Path(sys.executable).with_name("kvserve")
    done = subprocess.run([str(kvserve), "worker", "--model", str(tmp_path), "--port", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "'phi3' (Phi3ForCausalLM) is not served" in done.stderr
