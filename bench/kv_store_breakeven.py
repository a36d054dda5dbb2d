"""When is loading a prefix's KV pages from Redis cheaper than recomputing them? (issue 38's break-even)

    python bench/kv_store_breakeven.py [--tokens 1200] [--rounds 3]    # make bench-kv-breakeven

On this machine, side by side and alternated round by round, for the default model's float32 pages and int8
pages (per-(token, kv head) scales):

  recompute  the worker prefilling a ``--tokens`` prompt in chunks of 512 (ModelRunner.step, real model): s/token
  load       the same prompt's full pages read back from an embedded redis-server (one value per page,
             kvserve/worker/page_codec.py: pipelined GETs with redis-py, each value verified and copied into a pool
             page)

and their ratio: load time / recompute time for the same tokens (below 1: loading wins), with the load's MB/s
and the bandwidth at which the two break even (bytes per token x prefill tokens/s). Medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from results_io import write_results  # noqa: E402

from kvserve.common.embedded_redis import EmbeddedRedis  # noqa: E402
from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402
from kvserve.worker.page_codec import decode_page, encode_page  # noqa: E402
from kvserve.worker.runner import ModelRunner, RunnerConfig  # noqa: E402

PAGE_SIZE = 16
CHUNK = 512
FORMATS = {"float32": dict(dtype="float32"), "int8": dict(dtype="float32", kv_cache_dtype="int8")}


def make_runner(model_dir: Path, tokens: int, **kw) -> ModelRunner:
    num_pages = 2 * (-(-tokens // PAGE_SIZE)) + 2
    return ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=num_pages, page_size=PAGE_SIZE, device="cpu",
                                    **kw))


def prefill_s(runner: ModelRunner, prompt: list[int]) -> float:
    """Seconds to compute every position of ``prompt`` from scratch, chunk by chunk, into pages 0.."""
    table = tuple(range(-(-len(prompt) // PAGE_SIZE)))
    t0 = time.perf_counter()
    for start in range(0, len(prompt), CHUNK):
        end = min(start + CHUNK, len(prompt))
        item = StepItem("r", tuple(prompt[start:end]), start, table, sample=end == len(prompt),
                        sampling=SamplingParams())
        runner.step(StepBatch((item,)))
    return time.perf_counter() - t0


def load_s(runner: ModelRunner, client, keys: list[str], ns: bytes, hashes: list[bytes]) -> float:
    """Seconds to read every page's value and load it, verified, into the pool's pages after the prompt's."""
    first = len(keys)
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    for i, value in enumerate(pipe.execute()):
        decode_page(value, ns, hashes[i], runner.kv_cache, runner.kv_scales, first + i)
    return time.perf_counter() - t0


def measure(name: str, runner: ModelRunner, client, prompt: list[int], rounds: int) -> dict:
    num_pages = len(prompt) // PAGE_SIZE
    ns = xxhash.xxh3_128_digest(f"bench {name}".encode())
    hashes = [xxhash.xxh3_128_digest(ns + i.to_bytes(4, "little")) for i in range(num_pages)]
    prefill_s(runner, prompt)  # warm-up, and the pages the values are made of
    keys = [f"bench:{name}:{h.hex()}" for h in hashes]
    for i, key in enumerate(keys):
        client.set(key, encode_page(ns, hashes[i], runner.kv_cache, runner.kv_scales, i))
    value_bytes = sum(client.strlen(k) for k in keys)
    tokens = num_pages * PAGE_SIZE
    computed, loaded = [], []
    for r in range(rounds):  # alternated: recompute first in even rounds, load first in odd ones
        sides = [lambda: computed.append(prefill_s(runner, prompt[:tokens])),
                 lambda: loaded.append(load_s(runner, client, keys, ns, hashes))]
        for side in (sides if r % 2 == 0 else sides[::-1]):
            side()
    first = len(keys)  # the loaded pages equal the computed ones, byte for byte
    assert torch.equal(runner.kv_cache[:, :, first:2 * first].view(torch.uint8),
                       runner.kv_cache[:, :, :first].view(torch.uint8))
    recompute, load = statistics.median(computed), statistics.median(loaded)
    bytes_per_token = runner.pool_size.bytes_per_token
    return {"format": name, "tokens": tokens, "pages": num_pages, "bytes_per_token": bytes_per_token,
            "value_bytes": value_bytes, "recompute_s": recompute, "load_s": load,
            "load_over_recompute": load / recompute, "prefill_tokens_per_s": tokens / recompute,
            "load_mb_per_s": value_bytes / load / 1e6,
            "break_even_mb_per_s": bytes_per_token * tokens / recompute / 1e6,
            "rounds": {"recompute_s": computed, "load_s": loaded}}


def table(report: dict) -> str:
    lines = [f"A {report['tokens']}-token prompt's full pages: recompute (prefill, chunks of {CHUNK}) vs load from an "
             f"embedded redis-server (pipelined GETs, verified, copied into the pool); medians of "
             f"{report['num_rounds']} alternated rounds.", "",
             "| KV format | bytes/token | recompute | load | load / recompute | load MB/s | break-even MB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["formats"]:
        lines.append(f"| {r['format']} | {r['bytes_per_token']:,} | {r['recompute_s'] * 1000:.0f} ms | "
                     f"{r['load_s'] * 1000:.0f} ms | {r['load_over_recompute']:.3f} | {r['load_mb_per_s']:.0f} | "
                     f"{r['break_even_mb_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    model_dir = prepare_default_model(progress=False)
    prompt = torch.randint(3, 49152, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    report = {"tokens": args.tokens // PAGE_SIZE * PAGE_SIZE, "num_rounds": args.rounds, "page_size": PAGE_SIZE,
              "command": f"python bench/kv_store_breakeven.py --tokens {args.tokens} --rounds {args.rounds}",
              "formats": []}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        client = redis.Redis.from_url(server.url)  # plain redis-py, replies as bytes
        for name, kw in FORMATS.items():
            report["formats"].append(measure(name, make_runner(model_dir, args.tokens, **kw), client, prompt,
                                             args.rounds))
        client.close()
    write_results(report, "kv-store-breakeven", table(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
