"""Sliding-window attention and attention sinks in the worker (kvserve/kernels/window.py): a tiny random Mistral with a
window of 40 tokens generates exactly what HF's MistralForCausalLM does, through chunked prefill and decode,
with the pages the window leaves behind released as it goes; attention sinks on a tiny Llama match a slow
StreamingLLM reference, past the model's context; bad settings are refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from family_models import hf_generate, hf_model
from window_models import WINDOW, paged_logits, run_windowed, save_tiny, streaming_reference_logits

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.pages import num_pages_for
from kvserve.kernels.cpu_paged import CPUState
from kvserve.worker.runner import ModelRunner, RunnerConfig

PAGE = 16
PROMPT_LENGTHS = (130, 37, 100)
NEW_TOKENS = 60
BACKENDS = ("reference", "cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("tiny")
    return {"mistral": save_tiny(root / "mistral", "mistral", model_dir, sliding_window=WINDOW),
            "llama": save_tiny(root / "llama", "llama", model_dir)}


def prepared_states(runner: ModelRunner, monkeypatch) -> list:
    """The states the runner's backend prepares from now on (the cpu backend's are CPUStates when its kernels,
    not the reference's gather, run the step)."""
    states, prepare = [], runner.model.backend.prepare
    monkeypatch.setattr(runner.model.backend, "prepare", lambda meta: states.append(prepare(meta)) or states[-1])
    return states


def make_runner(folder, backend: str, **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=folder, num_pages=96, page_size=PAGE, device="cpu", dtype="float32",
                                    attention_backend=backend, **kw))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_greedy_matches_hf_mistral_and_holds_a_window_of_pages(tiny, backend, monkeypatch):
    runner = make_runner(tiny["mistral"], backend)
    states = prepared_states(runner, monkeypatch)
    assert runner.window == AttentionWindow(WINDOW, 0)  # read from the model's config
    seqs = run_windowed(runner, prompts(), NEW_TOKENS, budget=48)
    hf = hf_model(tiny["mistral"])
    for s in seqs:
        assert s.output == hf_generate(hf, s.prompt, NEW_TOKENS)
        assert s.most_decode_pages <= num_pages_for(WINDOW, PAGE) + 1  # ceil(W / page_size) + 1
        assert s.most_pages <= runner.window.max_pages_held(len(s.prompt) + NEW_TOKENS, PAGE, chunk=48)
        assert len(s.page_table) > num_pages_for(WINDOW, PAGE) + 1  # it did outgrow the window
    assert states and all(isinstance(st, CPUState) for st in states) == (backend == "cpu")  # the C++ kernels


def test_the_window_decides_the_tokens(tiny):
    """The tiny model is one where the window matters: without it, HF generates other tokens (so the test above
    would catch a worker that ignored the window)."""
    windowed, dense = hf_model(tiny["mistral"]), hf_model(tiny["mistral"], sliding_window=None)
    p = prompts()[0]
    assert hf_generate(windowed, p, NEW_TOKENS) != hf_generate(dense, p, NEW_TOKENS)


SINKS, SINK_WINDOW = 4, 32
CHUNKS = [37, 5, 64, 1, 1, 1, 100, 16, 1, 64]  # crossing pages, windows and the sink/window seam; then 64s


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_sinks_match_a_streaming_reference_past_the_models_context(tiny, backend, monkeypatch):
    runner = make_runner(tiny["llama"], backend, sliding_window=SINK_WINDOW, attention_sinks=SINKS)
    states = prepared_states(runner, monkeypatch)
    tokens = torch.randint(3, 49152, (1100,), generator=torch.Generator().manual_seed(2)).tolist()
    assert len(tokens) > runner.model_cfg.max_position_embeddings  # sinks run past the model's context
    assert runner.info.max_model_len > len(tokens)
    got = paged_logits(runner, tokens, CHUNKS)
    assert states and all(isinstance(st, CPUState) for st in states) == (backend == "cpu")  # the C++ kernels
    hf = hf_model(tiny["llama"])
    want = streaming_reference_logits(hf, tokens, SINK_WINDOW, SINKS)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    without_sinks = streaming_reference_logits(hf, tokens[:300], SINK_WINDOW + SINKS, 0)
    assert (got[:300] - without_sinks).abs().max() > 1e-2 * want.abs().max()  # the sinks change the answer


@pytest.mark.parametrize(("kw", "message"), [
    ({"sliding_window": 8}, "smaller than a page"),
    ({"attention_sinks": 4}, "needs --sliding-window"),
    ({"sliding_window": -1}, "--sliding-window must be >= 0"),
    ({"sliding_window": 64, "attention_sinks": -2}, "--attention-sinks must be >= 0"),
])
def test_bad_window_settings_are_refused_before_a_pool_exists(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        make_runner(tiny["llama"], "reference", **kw)


def test_a_window_other_than_the_models_is_refused(tiny):
    with pytest.raises(ValueError, match="declares sliding_window 40"):
        make_runner(tiny["mistral"], "reference", sliding_window=64)


def config(**kw) -> dict:
    base = {"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4}
    return base | kw


@pytest.mark.parametrize(("raw", "window"), [
    (config(sliding_window=4096), 4096),
    (config(sliding_window=None), 0),
    (config(model_type="llama", sliding_window=4096), 0),  # HF's Llama ignores the field
    (config(model_type="qwen2", sliding_window=4096), 0),  # ... and Qwen2 without use_sliding_window
    (config(model_type="qwen2", sliding_window=512, use_sliding_window=True, max_window_layers=0), 512),
    (config(model_type="qwen2", sliding_window=512, use_sliding_window=True, max_window_layers=4), 0),
    (config(sliding_window=256, layer_types=["sliding_attention"] * 4), 256),
])
def test_the_window_a_config_declares(raw, window):
    from kvserve.worker.config import ModelConfig

    assert ModelConfig.from_dict(raw).sliding_window == window


@pytest.mark.parametrize("raw", [  # mixed full and sliding layers are served: tests/unit/worker/test_gemma.py
    config(sliding_window=256, layer_types=["chunked_attention"] * 4),
])
def test_a_window_layout_kvserve_would_serve_wrongly_is_refused(raw):
    from kvserve.worker.config import ModelConfig, UnsupportedModel

    with pytest.raises(UnsupportedModel):
        ModelConfig.from_dict(raw)


def test_holes_are_accepted_only_where_the_window_reads_nothing(tiny):
    from kvserve.common.pages import HOLE
    from kvserve.common.wire.worker import StepBatch, StepItem

    runner = make_runner(tiny["mistral"], "reference")
    prompt = prompts()[0][:64]
    table = tuple(range(num_pages_for(65, PAGE)))  # 5 pages; a decode at 64 reads 25..64: pages 1 to 4
    ok = StepItem("a", (prompt[0],), 64, (HOLE, *table[1:]))
    runner.call(runner._run, StepBatch((StepItem("a", tuple(prompt), 0, table, sample=False),)))
    assert runner.step(StepBatch((ok,))).sampled[0].req_id == "a"
    (hole,) = runner.step(StepBatch((StepItem("a", (prompt[0],), 64, (HOLE, HOLE, *table[2:])),))).rejected
    assert hole.req_id == "a" and "page_table[1] is a hole" in hole.message  # rejected alone, nothing computed
    dense = make_runner(tiny["llama"], "reference")
    (out_of_range,) = dense.step(StepBatch((ok,))).rejected
    assert "out of range" in out_of_range.message


def test_kv_mem_counts_the_pages_a_windowed_request_really_holds(tiny):
    """`kvserve kv-mem --page-size --sliding-window --sinks` for the tiny model's folder equals the pages a live
    request with sinks holds in its last decode step, for lengths that end on and off a page boundary."""
    import json
    import subprocess
    import sys

    runner = make_runner(tiny["llama"], "reference", sliding_window=SINK_WINDOW, attention_sinks=SINKS)
    for prompt_len in (90, 103):
        (s,) = run_windowed(runner, [prompts()[0][:prompt_len]], 23, budget=48)
        seq_len = prompt_len + 23 - 1  # the last step computes position seq_len - 1 (its token is not fed back)
        held = sum(p >= 0 for p in s.page_table)
        out = subprocess.run([sys.executable, "-m", "kvserve.services.cli", "kv-mem", str(tiny["llama"]),
                              "--seq-len", str(seq_len), "--page-size", str(PAGE), "--sliding-window",
                              str(SINK_WINDOW), "--sinks", str(SINKS), "--json"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["paging"]["pages_per_sequence"] == held
        assert s.most_decode_pages <= runner.window.max_pages_held(seq_len + 1, PAGE)  # the window not page-aligned
        assert report["tokens_per_sequence"] == SINKS + SINK_WINDOW


def test_local_generation_with_sinks_reuses_pages_past_the_pool_and_the_context(tiny):
    """`kvserve generate --local` (the engine core over an in-process kvmanager, kvserve/services/gateway/llm.py) with
    sinks: the pages behind the window are released and reused, so a pool of 8 pages serves 1,100 tokens; the
    tokens are those of the step loop above."""
    from kvserve.services.gateway.llm import LLM

    kw = {"sliding_window": SINK_WINDOW, "attention_sinks": SINKS}
    small = ModelRunner(RunnerConfig(model_dir=tiny["llama"], num_pages=8, page_size=PAGE, device="cpu",
                                     dtype="float32", attention_backend="reference", **kw))
    prompt = torch.randint(3, 49152, (1040,), generator=torch.Generator().manual_seed(3)).tolist()
    (got,) = LLM(small, max_num_batched_tokens=64).generate([prompt], 60, ignore_eos=True)
    (want,) = run_windowed(make_runner(tiny["llama"], "reference", **kw), [prompt], 60, budget=64)
    assert got == want.output and len(got) == 60
