"""bench/roofline_floor.py: what a step must compute and read, its floor, the raw runner's steps for a workload,
and the figures and targets derived from bench_roofline.py's measurements. Tiny shapes, counted by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import roofline_floor as rf  # noqa: E402
from long_floor import Shape  # noqa: E402

# head_dim 2; per token and layer: q, o 4 x 4 each, k, v 4 x 2 each, gate, up, down 4 x 8 each = 144 MACs
TINY = Shape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10)


def test_a_decode_step_counts_its_linears_attention_and_lm_head():
    # 2 layers x 144 linear, LM head 10 x 4, attention over 6 keys: 2 layers x 2 heads x 6 x head_dim 2 x (QK, PV)
    assert rf.step_macs(TINY, [rf.Work(5, 1)]) == 288 + 40 + 96
    assert rf.step_macs(TINY, [rf.Work(5, 1, sample=False)]) == 288 + 96


def test_a_step_reads_the_weights_once_and_every_attended_position():
    assert rf.kv_bytes_per_token(TINY) == 2 * 2 * 1 * 2 * 4  # layers x (K, V) x kv heads x head_dim x float32
    assert rf.step_bytes(TINY, 1000, [rf.Work(5, 1), rf.Work(9, 1)]) == 1000 + 32 * (6 + 10)
    assert rf.step_bytes(TINY, 1000, [rf.Work(0, 4)], elem_bytes=1) == 1000 + 8 * 4


def test_the_floor_is_the_slower_of_arithmetic_and_reading():
    assert rf.step_floor_s(100, 10, macs_per_s=10, bytes_per_s=10) == 10
    assert rf.step_floor_s(10, 100, macs_per_s=10, bytes_per_s=10) == 10


def test_burst_steps_follow_the_raw_runner():
    steps = rf.burst_steps([(3000, 3), (10, 1)], max_step_tokens=2048)
    assert steps == [[rf.Work(0, 2048, sample=False)], [rf.Work(2048, 952)], [rf.Work(0, 10)],
                     [rf.Work(3000, 1)], [rf.Work(3001, 1)]]


def test_a_workload_floor_sums_each_steps_bound():
    steps = [[rf.Work(0, 4)], [rf.Work(4, 1)]]
    macs = [rf.step_macs(TINY, s) for s in steps]  # 4 x 288 + 40 + attention (10 pairs), 288 + 40 + 5 pairs
    assert macs == [1152 + 40 + 160, 288 + 40 + 80]
    floor = rf.workload_floor(TINY, 1000, steps, macs_per_s=1, bytes_per_s=1)
    assert floor["floor_s"] == 1352 + 1160  # the first bound by its arithmetic, the second by its bytes
    assert floor["compute_bound_steps"] == 1 and floor["steps"] == 2
    assert floor["macs"] == sum(macs) and floor["bytes"] == 1128 + 1160


def _report(kernel_gbs: float, burst_wall_s: float, kvserve_ttft_s: float) -> dict:
    run = {"gemm_macs_per_s": 1000.0, "read_bytes_per_s": 1e9}
    return {"limits": {"runs": [run, {**run, "read_bytes_per_s": 2e9}]}, "weight_bytes": 1000,
            "prefill": [{"kernel_macs_per_s": 500.0}],
            "decode": [{"context": 4096, "batch": 1, "step_ms": 1000.0, "pool_bytes": 10 ** 9,
                        "kernel": {"gbs": kernel_gbs}},
                       {"context": 300, "batch": 1, "step_ms": 1000.0, "pool_bytes": 10 ** 9,
                        "kernel": {"gbs": 0.1}}],
            "burst": {"requests": [[4, 2]], "kvserve_wall_s": burst_wall_s, "raw_runner_wall_s": 1.0},
            "long": {"prompt_tokens": 4, "kvserve_ttft_s": kvserve_ttft_s, "hf_ttft_s": 2.0}}


def test_derive_takes_the_best_limits_and_judges_the_targets():
    report = _report(kernel_gbs=1.3, burst_wall_s=1.0, kvserve_ttft_s=1.8)
    rf.derive(report, TINY)
    assert report["limits"]["read_bytes_per_s"] == 2e9  # the better of the two runs
    assert report["prefill"][0]["of_gemm"] == 0.5
    row = report["decode"][0]
    assert row["bytes"] == 1000 + 32 * 4097 and row["of_read"] == pytest.approx(row["bytes"] / 2e9)
    assert row["kernel"]["of_machine"] == pytest.approx(0.65)
    floor = report["burst"]["floor"]["floor_s"]  # [0, 4) then one decode at 4, both bound by the arithmetic
    assert floor == pytest.approx((1352 + 408) / 1000)
    assert report["burst"]["kvserve_over_floor"] == pytest.approx(1.0 / floor)
    met = {t["name"]: t["met"] for t in report["targets"]}
    assert met == {"decode_attention": True, "burst": True, "long_ttft": False}  # 1.8 s / HF's 2.0 s > 0.8x
    assert report["targets"][2]["measured"] == pytest.approx(0.9)


def test_derive_says_a_target_is_missed():
    report = _report(kernel_gbs=1.1, burst_wall_s=10.0, kvserve_ttft_s=1.0)
    rf.derive(report, TINY)
    assert {t["name"]: t["met"] for t in report["targets"]} == {"decode_attention": False, "burst": False,
                                                               "long_ttft": True}
    assert report["targets"][0]["at"] == "context 4,096, batch 1"  # only rows at 4k+ context count
