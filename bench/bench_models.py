"""The model families kvserve serves, through the KV lens (make bench-models).

For each family a random-weight model of one shape (the default model's width and heads, fewer layers), built and
saved by transformers' own classes, is loaded by the worker:

  memory   bytes per token and tokens in a 512 MiB pool: the calculator (kvserve kv-mem on the folder's
           config.json) against the worker's real pool tensors (kv_cache + kv_scales nbytes / slots), for the
           model dtype and int8 with per-token scales
  decode   batch-1 decode steps through the runner at 1k and 4k tokens of context on the cpu backend (the longest
           context prefilled in chunks once, bench/decode_steps.py), tok/s over the steps, median of the rounds,
           and against the same-size dense Llama measured in the same run, families alternated over rounds
  modes    MLA's two attention modes (bench/models_mla.py): absorbed up-projections against decompressing the
           latents every step, one layer's batch-1 decode at 1k and 4k context, DeepSeek-V2-Lite's shape
  groups   Gemma 3's page groups: per group, bytes per token, calculator against the worker's two real pools, and
           how many sequences of 8,192 tokens a 512 MiB budget holds with page groups (the sliding pool sized for
           the windows of as many requests as the full pool then holds) against one pool for every layer
  mla      the latent cache's saving against the same model's per-head equivalent (K of qk_nope + qk_rope and V of
           v_head_dim per head per layer, what an MHA model of those heads caches): DeepSeek-V3's shapes through
           the calculator, and the test model through its real pool

A family the worker refuses is reported with the worker's own error. Results: bench/results/models-<date>.json
and .md; the docs' model page shows the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_steps import Decode  # noqa: E402
from results_io import write_results  # noqa: E402

from kvserve.common.kvmem import get_dtype, per_token  # noqa: E402
from kvserve.common.kvmem_models import find_model, load_hf_config  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402
from kvserve.worker.config import UnsupportedModel  # noqa: E402
from kvserve.worker.runner import ModelRunner, RunnerConfig  # noqa: E402

POOL_BYTES = 512 * 2**20
PAGE = 16
CONTEXTS = (1024, 4096)
CHUNK = 512
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The default model's width and heads (SmolLM2-135M), 12 of its 30 layers: every family at one size.
DIMS = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2)


def hf_model(family: str):
    """A random-weight HF model of ``family`` at DIMS (its own defaults for what DIMS does not set)."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**DIMS))
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**DIMS, head_dim=64))
    if family == "qwen3_moe":  # 8 experts of a quarter of the dense MLP, 2 per token (half the dense's active MLP)
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**DIMS, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                                        moe_intermediate_size=384, norm_topk_prob=True))
    if family == "gemma3":  # Gemma 3's pattern: five sliding layers (window 512) to one full one
        n = DIMS["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**DIMS, head_dim=64, sliding_window=512, layer_types=types,
                                                        query_pre_attn_scalar=64))
    if family == "gemma2":  # Gemma 2's pattern: sliding and full layers alternate; scores soft-capped at 50
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**DIMS, head_dim=64, sliding_window=512,
                                                    query_pre_attn_scalar=64, attn_logit_softcapping=50.0))
    if family == "deepseek_v3":  # MLA at DeepSeek-V3's ratios (latent 512 + 64 for 128 heads of 128 + 64 / 128)
        mla = dict(kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                   first_k_dense_replace=DIMS["num_hidden_layers"], n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=256, n_group=1, topk_group=1)
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**DIMS, **mla))
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3", "deepseek_v3")


def save_family(family: str, root: Path, tokenizer_dir: Path) -> Path:
    import shutil

    torch.manual_seed(0)
    folder = root / family
    hf_model(family).save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def make_runner(folder: Path, kv_dtype: str = "auto", **size) -> ModelRunner:
    size = size or {"kv_cache_bytes": POOL_BYTES}
    return ModelRunner(RunnerConfig(model_dir=folder, page_size=PAGE, device="cpu", dtype="float32",
                                    attention_backend="cpu", kv_cache_dtype=kv_dtype, **size))


def memory(folder: Path) -> list[dict]:
    """Calculator against the real pool, per KV dtype."""
    rows = []
    for kv_dtype, calc_name in (("auto", "fp32"), ("int8", "int8")):
        runner = make_runner(folder, kv_dtype)
        slots = runner.pool_size.num_pages * PAGE
        pool = runner.kv_cache.nbytes + (0 if runner.kv_scales is None else runner.kv_scales.nbytes)
        calc = per_token(load_hf_config(folder), get_dtype(calc_name))
        rows.append({"kv_dtype": calc_name, "pool_bytes_per_token": pool / slots, "calc_bytes_per_token": calc.bytes,
                     "pool_tokens_512mib": slots, "calc_tokens_512mib": POOL_BYTES // calc.bytes // PAGE * PAGE,
                     "formula": calc.formula})
        del runner
    return rows


GROUP_SEQ = 8192  # the sequences page_groups() fits


def page_groups(folder: Path) -> dict:
    """A mixed model's two pools against the calculator, per group, and sequences of GROUP_SEQ tokens in POOL_BYTES
    with page groups against one pool for every layer (the worker's real pool sizes in both)."""
    from kvserve.worker.page_groups import window_pages

    spec = load_hf_config(folder)
    per_layer = per_token(spec, get_dtype("fp32")).bytes // spec.num_layers
    full_layers = spec.num_layers - spec.sliding_layers
    seq_pages = GROUP_SEQ // PAGE
    one = make_runner(folder)
    one_pool = one.pool_size.num_pages // seq_pages
    del one
    window = window_pages(spec.layer_window, GROUP_SEQ, PAGE)
    f, s = full_layers * per_layer * PAGE, spec.sliding_layers * per_layer * PAGE  # the calculator's page bytes
    n = POOL_BYTES // (seq_pages * f + window * s)  # requests whose pages fit both pools
    runner = make_runner(folder, kv_cache_bytes=POOL_BYTES, page_groups=True, sliding_group_pages=n * window)
    full_pool, sliding_pool = runner.pool_size, runner.group_size
    pool_bytes = lambda t, p: t.nbytes / (p.num_pages * PAGE)  # noqa: E731
    return {"full_layers": full_layers, "sliding_layers": spec.sliding_layers, "window": spec.layer_window,
            "calc_full_bytes_per_token": full_layers * per_layer, "pool_full_bytes_per_token":
            pool_bytes(runner.kv_cache, full_pool), "calc_sliding_bytes_per_token": spec.sliding_layers * per_layer,
            "pool_sliding_bytes_per_token": pool_bytes(runner.group_cache, sliding_pool),
            "full_pages": full_pool.num_pages, "sliding_pages": sliding_pool.num_pages,
            "window_pages": window, "seq_tokens": GROUP_SEQ,
            "sequences_grouped": min(full_pool.num_pages // seq_pages, sliding_pool.num_pages // window),
            "sequences_one_pool": one_pool}


def decode(folders: dict[str, Path], rounds: int, steps: int) -> dict:
    """{family: {context: [tok/s, one per round]}}: each family's longest context prefilled once (decode_steps.Decode),
    then ``steps`` batch-1 decode steps from each context, families alternated within each round."""
    longest = max(CONTEXTS)
    ids = torch.randint(3, DIMS["vocab_size"], (longest + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    benches = {f: Decode(make_runner(folder, num_pages=longest // PAGE + 1), ids, longest, 1, CHUNK)
               for f, folder in folders.items()}
    out = {f: {c: [] for c in CONTEXTS} for f in folders}
    for r in range(rounds):
        order = list(folders)[r % len(folders):] + list(folders)[:r % len(folders)]
        for context in CONTEXTS:
            for f in order:
                out[f][context].append(benches[f].run(context, steps))
                print(f"round {r + 1} {f} @ {context}: {out[f][context][-1]:.1f} tok/s", flush=True)
    return out


def mla_saving(folder: Path | None) -> dict:
    """Latent against per-head bytes: DeepSeek-V3's shapes (calculator) and the test model's real pool."""
    v3 = find_model("DeepSeek-V3")
    heads, nope, rope, v = 128, 128, 64, 128  # deepseek-ai/DeepSeek-V3 config.json
    per_head_v3 = v3.num_layers * heads * (nope + rope + v) * 2  # bf16
    latent_v3 = per_token(v3, get_dtype("bf16")).bytes
    out = {"deepseek_v3": {"latent_bytes_per_token": latent_v3, "per_head_bytes_per_token": per_head_v3,
                           "saving": per_head_v3 / latent_v3}}
    if folder is not None:
        import json

        raw = json.loads((folder / "config.json").read_text())
        runner = make_runner(folder, num_pages=8)
        latent = runner.kv_cache.nbytes / (runner.pool_size.num_pages * PAGE)
        per_head = raw["num_hidden_layers"] * raw["num_attention_heads"] * (
            raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"] + raw["v_head_dim"]) * 4  # fp32
        out["test_model"] = {"latent_bytes_per_token": latent, "per_head_bytes_per_token": per_head,
                             "saving": per_head / latent}
    return out


def markdown(report: dict) -> str:
    lines = ["Memory: bytes per token and tokens in a 512 MiB pool, calculator (kvserve kv-mem) vs the worker's "
             "real pool tensors.", "",
             "| family | KV dtype | bytes/token calc | bytes/token pool | tokens in 512 MiB calc | pool |",
             "|---|---|---:|---:|---:|---:|"]
    for family, r in report["families"].items():
        if "refused" in r:
            lines.append(f"| {family} | refused: {r['refused']} | | | | |")
            continue
        for m in r["memory"]:
            lines.append(f"| {family} | {m['kv_dtype']} | {m['calc_bytes_per_token']:,} | "
                         f"{m['pool_bytes_per_token']:,.0f} | {m['calc_tokens_512mib']:,} | "
                         f"{m['pool_tokens_512mib']:,} |")
    lines += ["", f"Decode, batch 1, cpu backend, float32: tok/s over {report['decode_steps']} steps through the "
              f"runner, median of {report['rounds']} rounds (families alternated); ratio = the family's tok/s over the "
              "dense Llama's.", "", "| family | " + " | ".join(f"{c} ctx tok/s | vs Llama" for c in CONTEXTS) + " |",
              "|---|" + "---:|---:|" * len(CONTEXTS)]
    for family, r in report["families"].items():
        if "decode" in r:
            cells = " | ".join(f"{r['decode'][str(c)]['tok_s']:.1f} | {r['decode'][str(c)]['vs_llama']:.2f}x"
                               for c in CONTEXTS)
            lines.append(f"| {family} | {cells} |")
    g = report.get("page_groups")
    if g:
        lines += ["", f"Gemma 3's page groups ({g['full_layers']} full layers, {g['sliding_layers']} sliding, window "
                  f"{g['window']}), float32: bytes per token per group, calculator vs the worker's two pools, and "
                  f"sequences of {g['seq_tokens']:,} tokens in 512 MiB.", "",
                  "| group | bytes/token calc | bytes/token pool | pages |", "|---|---:|---:|---:|",
                  f"| full layers | {g['calc_full_bytes_per_token']:,} | {g['pool_full_bytes_per_token']:,.0f} | "
                  f"{g['full_pages']:,} |",
                  f"| sliding layers | {g['calc_sliding_bytes_per_token']:,} | "
                  f"{g['pool_sliding_bytes_per_token']:,.0f} | {g['sliding_pages']:,} |", "",
                  f"Sequences of {g['seq_tokens']:,} tokens held at once: **{g['sequences_grouped']}** with page "
                  f"groups (each holds {g['seq_tokens'] // PAGE} full pages and at most {g['window_pages']} sliding "
                  f"ones) against {g['sequences_one_pool']} in one pool for every layer, "
                  f"{g['sequences_grouped'] / max(1, g['sequences_one_pool']):.1f}x."]
    mla = report.get("mla_saving", {})
    if mla:
        lines += ["", "MLA: the latent cache against the per-head K and V of the same heads.", "",
                  "| model | latent bytes/token | per-head bytes/token | saving |", "|---|---:|---:|---:|"]
        for name, m in mla.items():
            lines.append(f"| {name} | {m['latent_bytes_per_token']:,.0f} | {m['per_head_bytes_per_token']:,} | "
                         f"{m['saving']:.1f}x |")
    modes = report.get("mla_modes")
    if modes:
        lines += ["", "MLA attention, one layer, batch-1 decode, DeepSeek-V2-Lite's shape: absorbed up-projections "
                  "against decompressing every cached latent each step (median ms).", "",
                  "| context | absorbed ms | decompress ms | absorbed faster by |", "|---:|---:|---:|---:|"]
        for c in modes["absorbed"]:
            a, d = modes["absorbed"][c], modes["decompress"][c]
            lines.append(f"| {c} | {a:.2f} | {d:.2f} | {d / a:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    families = args.families.split(",")
    report = {"shape": DIMS, "rounds": args.rounds, "decode_steps": args.steps, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = prepare_default_model()
        folders = {}
        for family in families:
            folder = save_family(family, Path(tmp), tokenizer_dir)
            try:
                report["families"][family] = {"memory": memory(folder)}
                folders[family] = folder
            except UnsupportedModel as e:
                report["families"][family] = {"refused": str(e)}
        times = decode(folders, args.rounds, args.steps)
        for family, by_ctx in times.items():
            report["families"][family]["decode"] = {
                str(c): {"tok_s": statistics.median(rates), "rounds_tok_s": rates,
                         "vs_llama": statistics.median(rates) / statistics.median(times["llama"][c]) if "llama" in times
                         else None} for c, rates in by_ctx.items()}
        report["mla_saving"] = mla_saving(folders.get("deepseek_v3"))
        if "gemma3" in folders:
            report["page_groups"] = page_groups(folders["gemma3"])
    if "deepseek_v3" in folders:
        from models_mla import V2_LITE, time_modes

        report["mla_modes"] = {mode: {str(c): ms for c, ms in by_ctx.items()} if mode != "shape" else by_ctx
                               for mode, by_ctx in time_modes(**V2_LITE).items()}
    write_results(report, "models", markdown(report), args.out)


if __name__ == "__main__":
    main()
