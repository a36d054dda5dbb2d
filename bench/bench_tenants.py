"""Noisy neighbour: a quiet tenant's cached system prompt while another tenant floods the pool, per eviction policy.

    python bench/bench_tenants.py [--rounds 10] [--configs solo,lru,fair,fair-3:1]    # make bench-tenants

One `kvserve up` per configuration, all started at once, each with one worker on the default model on CPU, a
small pool (--num-pages 160 of 16 tokens: 2,560 tokens) and the shared KV tier off (--kv-store-bytes 0), so
that the pool alone is measured. Two API keys (--api-keys-file) name the tenants `quiet` and `noisy`.

  quiet   a ~1,000-token system prompt and a short question that changes every visit: a streamed chat
          completion (the official openai client), greedy, 8 new tokens. Per visit: TTFT (to the first content
          chunk) and usage's cached_tokens / prompt_tokens.
  noisy   between two quiet visits, unique long prompts worth 1.5x the pool (3 completions of ~1,280 tokens,
          each opening with its own request number so that no block is shared), greedy, 8 new tokens
          (ignore_eos): tokens (prompt + completion) per second and requests per second.

Every request runs alone: the noisy prompts one after another between the quiet visits, never beside them, so
that the quiet tenant's TTFT moves with the cache alone, not with a neighbour's prefill on the same two cores.

Configurations (CONFIGS), interleaved round by round in an order that rotates each round, so that each sees
the same minutes of a machine whose speed drifts:

  solo       the quiet tenant alone (cache policy fair; alone, any policy is one LRU)
  lru        both tenants, --cache-policy lru: one global LRU over every tenant (kvserve before fair share)
  fair       both tenants, --cache-policy fair (the default), equal weights
  fair-3:1   fair, with a tenants file weighting quiet 3 and noisy 1
  fair-1:3   fair, weights quiet 1 and noisy 3 (not run by default: --configs ...,fair-1:3)

Round 0 (the quiet tenant's first visit, a cold prefill, and the first noisy block) is left out of the figures.
After every noisy block the run reads the kvmanager's per-tenant stats (`kvserve admin stats`): pages held
against the fair share, pages evicted (suffered) and evictions caused.

Writes bench/results/tenants-<date>.json and .md (bench/tenants_output.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
import hf_reference as hf  # noqa: E402
import tenants_output  # noqa: E402
from bench_tiered import Target, UpStack  # noqa: E402
from chaos import kvserve_commit  # noqa: E402
from results_io import RESULTS_DIR, write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402

PAGE_SIZE = 16
MAX_TOKENS = 8
KEYS = {"bench-quiet-key": "quiet", "bench-noisy-key": "noisy"}
QUESTIONS = ("What is this text about?", "Which function does it describe first?", "Name one argument it mentions.",
             "What does it return?", "Summarise it in one sentence.", "Does it give a warning?")


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    policy: str  # --cache-policy
    noisy: bool  # whether the noisy tenant sends its blocks
    weights: dict[str, int] | None = None  # tenant -> weight, as a tenants file

    def tenants_toml(self) -> str:
        return "".join(f"[tenant.{t}]\nweight = {w}\n\n" for t, w in (self.weights or {}).items())


CONFIGS = {c.name: c for c in (
    Config("solo", "fair", noisy=False),
    Config("lru", "lru", noisy=True),
    Config("fair", "fair", noisy=True),
    Config("fair-3:1", "fair", noisy=True, weights={"quiet": 3, "noisy": 1}),
    Config("fair-1:3", "fair", noisy=True, weights={"quiet": 1, "noisy": 3}),
)}


@dataclass
class Stack:
    """One configuration's `kvserve up`, and a client per tenant (each with its API key)."""

    config: Config
    up: UpStack
    target: Target | None = None
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)
    visits: list[dict] = field(default_factory=list)
    noisy: list[dict] = field(default_factory=list)
    tenant_stats: list[dict] = field(default_factory=list)  # after each round's noisy block

    def connect(self) -> None:
        self.target = self.up.ready()
        self.clients = {t: openai.OpenAI(base_url=self.target.http, api_key=k, max_retries=0, timeout=600)
                        for k, t in KEYS.items()}

    def tenants(self) -> dict[str, dict]:
        """The kvmanager's per-tenant stats: every TenantStats field, by tenant."""
        return {t.tenant: {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields if f.name != "tenant"}
                for t in self.target.stats().tenants}


def start(configs: list[Config], args, log_dir: Path) -> list[Stack]:
    keys_file = log_dir / "api-keys.json"
    keys_file.write_text(json.dumps(KEYS))
    stacks = []
    for c in configs:
        data_dir = log_dir / f"data-{c.name.replace(':', '-')}"
        flags = ["--num-pages", str(args.num_pages), "--page-size", str(PAGE_SIZE), "--kv-store-bytes", "0",
                 "--cache-policy", c.policy, "--api-keys-file", str(keys_file)]
        if c.weights:
            tenants_file = log_dir / f"tenants-{c.name.replace(':', '-')}.toml"
            tenants_file.write_text(c.tenants_toml())
            flags += ["--tenants-file", str(tenants_file)]
        stacks.append(Stack(c, UpStack(c.name.replace(":", "-"), data_dir, flags, log_dir)))
    for s in stacks:  # every stack loads the model at once
        s.up.spawn()
    for s in stacks:
        s.connect()
    return stacks


def quiet_visit(client: openai.OpenAI, model: str, system: str, round_: int) -> dict:
    """One streamed chat completion: TTFT to the first content chunk (not the role chunk), and usage."""
    question = f"{QUESTIONS[round_ % len(QUESTIONS)]} (visit {round_})"
    t0 = time.perf_counter()
    first, usage = None, None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details
    return {"round": round_, "ttft_s": first - t0, "total_s": time.perf_counter() - t0,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": details.cached_tokens if details else 0,
            "completion_tokens": usage.completion_tokens}


def noisy_request(client: openai.OpenAI, model: str, prompt: str, round_: int) -> dict:
    t0 = time.perf_counter()
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    details = r.usage.prompt_tokens_details
    return {"round": round_, "latency_s": time.perf_counter() - t0, "prompt_tokens": r.usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details else 0,
            "completion_tokens": r.usage.completion_tokens}


def noisy_prompts(tok: Tokenizer, corpus: list[int], num_tokens: int, count: int, start: int) -> list[str]:
    """``count`` prompts of about ``num_tokens`` tokens, windows of the corpus, each opening with its own number
    (request ``start``, ``start + 1``, ...) so that none shares a block with another."""
    prompts = []
    for i in range(start, start + count):
        at = (i * num_tokens) % (len(corpus) - num_tokens)
        prompts.append(f"Request {i}.\n" + tok.decode(corpus[at:at + num_tokens]))
    return prompts


def warm_up(stack: Stack, model: str, limit_s: float = 180.0) -> None:
    """A short request of the quiet tenant, retried until the stack answers."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            stack.clients["quiet"].chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=2, temperature=0)
            return
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)  # polling a condition under a deadline


def run_round(stacks: list[Stack], model: str, system: str, prompts: list[str], round_: int) -> None:
    """Each stack in turn (the order rotated by the round): a quiet visit, then its noisy block."""
    k = round_ % len(stacks)
    for s in stacks[k:] + stacks[:k]:
        s.visits.append(quiet_visit(s.clients["quiet"], model, system, round_))
        if s.config.noisy:
            s.noisy += [noisy_request(s.clients["noisy"], model, p, round_) for p in prompts]
        s.tenant_stats.append({"round": round_, "tenants": s.tenants()})
    line = ", ".join(f"{s.config.name} {1000 * s.visits[-1]['ttft_s']:.0f} ms "
                     f"({s.visits[-1]['cached_tokens']}/{s.visits[-1]['prompt_tokens']} cached)" for s in stacks)
    print(f"  round {round_}: quiet TTFT {line}", flush=True)


def command(argv: list[str]) -> str:
    """The run's command line, less the options that name this machine's paths."""
    kept = [a for i, a in enumerate(argv) if a not in ("--keep-logs", "--out")
            and (i == 0 or argv[i - 1] not in ("--keep-logs", "--out"))]
    return " ".join(["python bench/bench_tenants.py", *kept])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="quiet visits measured, after round 0")
    p.add_argument("--num-pages", type=int, default=160, help="pages of each worker's pool")
    p.add_argument("--system-tokens", type=int, default=1000, help="the quiet tenant's system prompt")
    p.add_argument("--noisy-factor", type=float, default=1.5, help="noisy tokens between quiet visits / the pool's")
    p.add_argument("--noisy-requests", type=int, default=3, help="noisy prompts between quiet visits")
    p.add_argument("--configs", default="solo,lru,fair,fair-3:1", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--keep-logs", type=Path, help="keep the stacks' logs and data here (default: a temporary dir)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    configs = [CONFIGS[name] for name in args.configs.split(",")]
    model_dir = prepare_default_model(progress=False)
    tok, model = Tokenizer(model_dir), model_dir.name
    corpus = hf.corpus_token_ids(model_dir)
    system = tok.decode(corpus[:args.system_tokens])
    noisy_tokens = round(args.noisy_factor * args.num_pages * PAGE_SIZE / args.noisy_requests)
    report = {"date": str(dt.date.today()), "command": command(argv or sys.argv[1:]), "kvserve": kvserve_commit(),
              "config": {"rounds": args.rounds, "num_pages": args.num_pages, "page_size": PAGE_SIZE,
                         "pool_tokens": args.num_pages * PAGE_SIZE, "system_tokens": args.system_tokens,
                         "noisy_factor": args.noisy_factor, "noisy_requests": args.noisy_requests,
                         "noisy_prompt_tokens": noisy_tokens, "max_tokens": MAX_TOKENS, "kv_store_bytes": 0,
                         "workers": 1, "concurrency": "sequential: one request at a time",
                         "configs": {c.name: {"cache_policy": c.policy, "noisy": c.noisy, "weights": c.weights}
                                     for c in configs}}}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        t0, report["load_avg_rounds"] = time.monotonic(), []
        print(f"starting {len(configs)} stacks: {', '.join(c.name for c in configs)}", flush=True)
        stacks = start(configs, args, log_dir)
        try:
            for s in stacks:
                warm_up(s, model)
            for r in range(args.rounds + 1):
                prompts = noisy_prompts(tok, corpus, noisy_tokens, args.noisy_requests, r * args.noisy_requests)
                run_round(stacks, model, system, prompts, r)
                report["load_avg_rounds"].append(os.getloadavg()[0])
        finally:
            for s in stacks:
                s.up.stop()
        report["wall_s"] = time.monotonic() - t0
    report["runs"] = {s.config.name: {"visits": s.visits, "noisy": s.noisy, "tenant_stats": s.tenant_stats}
                      for s in stacks}
    out = args.out or RESULTS_DIR / f"tenants-{report['date']}.json"
    tenants_output.summarise(report)
    write_results(report, "tenants", tenants_output.markdown(report), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
