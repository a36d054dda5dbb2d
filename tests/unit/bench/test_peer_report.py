"""The vLLM comparison's arithmetic and text (bench/peer_compare.py, peer_output.py, headline.py, openai_load.py)
on a made-up report: medians over rounds, kvserve-over-peer ratios in the right direction, the table's rows,
and the README headline rewritten between its markers and nowhere else."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import headline  # noqa: E402
import openai_load  # noqa: E402
import peer_compare  # noqa: E402
import peer_output  # noqa: E402


def _run(tok_s: float, hit_s: float, long_s: float, lat_scale: float) -> dict:
    return {"burst": {"tokens_per_s": tok_s, "ttft_p50_s": 1.0, "tpot_p50_s": 0.1},
            "prefix": {"ttft_first_s": 2.0, "ttft_rest_mean_s": hit_s, "cached_tokens_rest_mean": 2000,
                       "prompt_tokens": 2040},
            "long_prompt": {"ttft_s": long_s, "tpot_s": 0.05, "prompt_tokens": 4096},
            "latency": [{"clients": c, "ttft_p50_s": 0.1 * c * lat_scale, "ttft_p90_s": 0.2, "ttft_p99_s": 0.3,
                         "tpot_p50_s": 0.02 * lat_scale, "tpot_p90_s": 0.03, "tpot_p99_s": 0.04} for c in (1, 16)]}


def _peers() -> dict:
    runs = {"kvserve": [_run(100, 0.1, 5, 1), _run(120, 0.3, 7, 1), _run(80, 0.2, 6, 1)],
            "vllm_bf16": [_run(50, 0.4, 3, 2)] * 3, "vllm_fp32": [_run(25, 0.8, 12, 4)] * 3}
    peers = {"rounds": 3, "workloads": {"burst_requests": 24},
             "servers": {n: {"config": {"dtype": "x", "command": "c", "version": "0.32.0", "why": "w"},
                             "median": peer_compare.summarise(rs), "runs": rs} for n, rs in runs.items()},
             "agreement": {"vllm_bf16": openai_load.agreement(["a", "bb", "cc"], ["a", "bx", "cc"]),
                           "vllm_fp32": openai_load.agreement(["a", "bb", "cc"], ["a", "bb", "cc"])}}
    peers["ratios"] = peer_compare.ratios(peers)
    return peers


def test_medians_over_rounds_and_ratios_say_how_many_times_faster_kvserve_is():
    peers = _peers()
    ours = peers["servers"]["kvserve"]["median"]
    assert ours["burst_tokens_per_s"] == 100 and ours["prefix_ttft_rest_mean_s"] == 0.2 and ours["long_ttft_s"] == 6
    best, fp32 = peers["ratios"]["vllm_bf16"], peers["ratios"]["vllm_fp32"]
    assert best["burst_throughput"] == pytest.approx(2.0)  # 100 tok/s against 50
    assert best["prefix_hit_ttft"] == pytest.approx(2.0)  # vLLM's 0.4 s against kvserve's 0.2 s
    assert best["long_ttft"] == pytest.approx(0.5)  # vLLM faster here: below 1
    assert fp32["latency_tpot_p50"] == pytest.approx([4.0, 4.0])


def test_agreement_counts_identical_completions():
    a = openai_load.agreement(["abc", "abd", "x"], ["abc", "abc", "y"])
    assert (a["identical"], a["of"]) == (1, 3)
    assert a["differing_common_prefix_median"] == pytest.approx(1.0 / 3.0)  # "abd"/"abc": 2 of 3; "x"/"y": 0


def test_the_table_has_a_row_per_workload_and_the_configurations():
    out = {"peers": _peers(), "throughput": {"hf_generate_batch": {"tokens_per_s": 20}},
           "prefix": {"hf": {"ttft_first_s": 3, "ttft_rest_mean_s": 3}}, "long_prompt": {"hf": {"ttft_s": 9}}}
    text = peer_output.markdown(out)
    burst = next(line for line in text.splitlines() if line.startswith("| mixed burst"))
    assert burst.split(" | ")[1:] == ["100.0", "50.0", "25.0", "20.0", "2.00x", "4.00x", "5.00x |"]
    assert "| 16 closed-loop clients: TPOT p50, ms |" in text
    assert "identical on 2 of 3" in text and "identical on 3 of 3" in text
    assert peer_output.markdown({"peers": {"skipped": "no .venv-vllm"}}).strip().endswith("(no .venv-vllm).")


def test_the_headline_is_written_between_its_markers_only():
    report = {"peers": _peers(), "cpu": {"model": "Some CPU", "cores": 2, "flags": ["avx2"]},
              "throughput": {"hf_generate_batch": {"tokens_per_s": 20}, "hf_generate": {"tokens_per_s": 10}},
              "prefix": {"hf": {"ttft_rest_mean_s": 3.0}}, "long_prompt": {"hf": {"ttft_s": 9.0}}}
    block = headline.render(report, "2026-12-03.json")
    assert "requests: **4.00x** / 2.00x vLLM's throughput" in block and "vLLM 0.32.0's CPU build" in block
    assert "**5.00x** HF transformers' continuous" in block and "bench/results/2026-12-03.json" in block
    assert "identical to vLLM float32's on **3 of 3** (bfloat16's: 2 of 3)" in block
    text = f"intro\n{headline.START}\nold figures\n{headline.END}\nrest\n"
    assert headline.rewrite(text, block) == f"intro\n{headline.START}\n{block}\n{headline.END}\nrest\n"
    with pytest.raises(ValueError, match="no headline markers"):
        headline.rewrite("no markers here", block)
