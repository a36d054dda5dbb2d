"""kvserve and vLLM's CPU build through the same OpenAI protocol (bench/openai_load.py), in the report's run:
each server started in turn, alternated over rounds (the order rotates, so no server always runs first after a
quiet machine), every workload against every server, medians over rounds, and the greedy agreement between the
servers' completions of the mixed burst.

Servers: kvserve (`kvserve up`, float32 weights and KV, a worker thread per core), vLLM at its best configuration
for this machine (bench/vllm_peer.py: bfloat16) and vLLM in float32, like for like.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import openai_load  # noqa: E402
import vllm_peer  # noqa: E402

# a worker thread per core, as vLLM's threads are bound to every core (vllm_peer.VLLM_CONFIGS): both at their best
# on an otherwise idle machine; `kvserve up`'s default leaves one core to the services it co-locates
EVERY_CORE = ("--worker-threads", str(os.cpu_count() or 1))
KVSERVE_ARGS = ("--num-pages", "2048", *EVERY_CORE)
KVSERVE = "kvserve"


@dataclass(frozen=True)
class Workloads:
    burst: list[tuple[str, int]]  # (prompt text, new tokens)
    prefix: list[str]  # a shared system prompt, then user turns
    load_prompts: list[str]
    load_shape: tuple[int, int]  # (requests per client, new tokens)
    long_text: str
    long_new_tokens: int
    client_counts: tuple[int, ...] = openai_load.CLIENT_COUNTS


def measure(base_url: str, model: str, w: Workloads) -> dict:
    """Every workload once on one server, after a small warm-up burst. The long prompt runs first, so that no
    earlier prompt can have cached any of it."""
    openai_load.burst(base_url, model, w.burst[:2])
    out = {"long_prompt": openai_load.long_prompt(base_url, model, w.long_text, w.long_new_tokens)}
    out["burst"] = openai_load.burst(base_url, model, w.burst, texts=True)
    out["prefix"] = openai_load.prefix(base_url, model, w.prefix)
    out["latency"] = [openai_load.latency(base_url, model, w.load_prompts, c, *w.load_shape) for c in w.client_counts]
    return out


@contextmanager
def server(name: str, model_dir: Path) -> Iterator[tuple[str, str, dict]]:
    """(base URL, model name, what was run) for kvserve or one of vllm_peer.VLLM_CONFIGS."""
    if name == KVSERVE:
        with bg.stack(*KVSERVE_ARGS) as (_, stats):
            yield stats["http"], model_dir.name, {"command": "kvserve up " + " ".join(KVSERVE_ARGS),
                                                  "dtype": "float32", "kv_dtype": "float32"}
        return
    config = vllm_peer.VLLM_CONFIGS[name]
    with vllm_peer.vllm_server(model_dir, config) as s:
        yield s.base_url, s.model, {"version": s.version, "dtype": config.dtype, "why": config.why,
                                    "command": "python " + " ".join(s.argv), "env": s.env,
                                    "start_s": s.start_s}


def run(model_dir: Path, w: Workloads, servers: tuple[str, ...], rounds: int,
        progress: Callable[[str], None] = lambda _: None) -> dict:
    """Every server once per round, the order rotated each round; per server its runs and their medians."""
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    configs: dict[str, dict] = {}
    for r in range(rounds):
        for name in servers[r % len(servers):] + servers[:r % len(servers)]:
            progress(f"round {r + 1}/{rounds}: {name}")
            with server(name, model_dir) as (base_url, model, config):
                runs[name].append(measure(base_url, model, w))
                configs.setdefault(name, config)
    out = {"rounds": rounds, "servers": {name: {"config": configs[name], "median": summarise(rs), "runs": rs}
                                         for name, rs in runs.items()},
           "workloads": {"burst_requests": len(w.burst), "burst_new_tokens": sum(n for _, n in w.burst),
                         "prefix_requests": len(w.prefix), "load_shape": list(w.load_shape),
                         "long_new_tokens": w.long_new_tokens}}
    out["agreement"] = {name: openai_load.agreement(runs[KVSERVE][0]["burst"]["texts"], rs[0]["burst"]["texts"])
                        for name, rs in runs.items() if name != KVSERVE and KVSERVE in runs}
    for rs in runs.values():
        for run_ in rs:
            run_["burst"].pop("texts")
    out["ratios"] = ratios(out)
    return out


def _median(runs: list[dict], *path: str | int) -> float:
    values = []
    for r in runs:
        for key in path:
            r = r[key]
        values.append(r)
    return statistics.median(values)


def summarise(runs: list[dict]) -> dict:
    """Medians over rounds of the figures the report quotes."""
    return {
        "burst_tokens_per_s": _median(runs, "burst", "tokens_per_s"),
        "burst_ttft_p50_s": _median(runs, "burst", "ttft_p50_s"),
        "burst_tpot_p50_s": _median(runs, "burst", "tpot_p50_s"),
        "prefix_ttft_first_s": _median(runs, "prefix", "ttft_first_s"),
        "prefix_ttft_rest_mean_s": _median(runs, "prefix", "ttft_rest_mean_s"),
        "prefix_cached_tokens_rest_mean": _median(runs, "prefix", "cached_tokens_rest_mean"),
        "prefix_prompt_tokens": _median(runs, "prefix", "prompt_tokens"),
        "long_ttft_s": _median(runs, "long_prompt", "ttft_s"),
        "long_tpot_s": _median(runs, "long_prompt", "tpot_s"),
        "long_prompt_tokens": _median(runs, "long_prompt", "prompt_tokens"),
        "latency": [{"clients": lat["clients"],
                     **{key: _median(runs, "latency", i, key) for key in lat if key.endswith("_s")}}
                    for i, lat in enumerate(runs[0]["latency"])],
    }


def ratios(peers: dict) -> dict:
    """kvserve over each vLLM configuration: throughput (higher is better for kvserve) and latencies as
    vLLM's / kvserve's (so above 1 means kvserve is faster too)."""
    servers = peers["servers"]
    ours = servers[KVSERVE]["median"]
    out = {}
    for name, s in servers.items():
        if name == KVSERVE:
            continue
        theirs = s["median"]
        out[name] = {
            "burst_throughput": ours["burst_tokens_per_s"] / theirs["burst_tokens_per_s"],
            "prefix_hit_ttft": theirs["prefix_ttft_rest_mean_s"] / ours["prefix_ttft_rest_mean_s"],
            "prefix_first_ttft": theirs["prefix_ttft_first_s"] / ours["prefix_ttft_first_s"],
            "long_ttft": theirs["long_ttft_s"] / ours["long_ttft_s"],
            "long_tpot": theirs["long_tpot_s"] / ours["long_tpot_s"],
            "latency_ttft_p50": [t["ttft_p50_s"] / o["ttft_p50_s"]
                                 for o, t in zip(ours["latency"], theirs["latency"], strict=True)],
            "latency_tpot_p50": [t["tpot_p50_s"] / o["tpot_p50_s"]
                                 for o, t in zip(ours["latency"], theirs["latency"], strict=True)],
        }
    return out
