"""A benchmark double of a GPU worker: the worker's Step API (kvserve/services/gateway/backends.py WorkerBackend), where
every step takes a fixed wall time and samples deterministic tokens. Never a default, never in kvserve's
packages: it exists so that bench_reserve_ahead.py can measure how long the gateway waits on the kvmanager when
a step costs what a small model's decode costs on a GPU (a few milliseconds), on a machine without one.

It validates each batch as a real worker does (page tables cover every position, ids inside the pool), so a
scheduling bug still fails loudly, and it samples token ``1000 + (end_pos % 97)``: no EOS, and a request runs
to its max_tokens.
"""

from __future__ import annotations

import time

from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.worker import SampledToken, StepBatch, StepOutput, WorkerInfo
from kvserve.worker.validate import validate_batch

SPIN_S = 0.0005  # the last half millisecond of a step is spun, not slept: sleep wakes late by about that much


def hold(duration_s: float) -> None:
    """Returns ``duration_s`` after it was called (sleeping, then spinning on perf_counter for the end)."""
    end = time.perf_counter() + duration_s
    if duration_s > SPIN_S:
        time.sleep(duration_s - SPIN_S)
    while time.perf_counter() < end:
        pass


class FixedTimeWorker:
    """Every Step takes ``step_s`` of wall time, whatever it computes."""

    address = "fixed-time"

    def __init__(self, info: WorkerInfo, step_s: float):
        self.info_now, self.step_s = info, step_s
        self.num_steps = 0

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        return self.info_now

    def step(self, batch: StepBatch, traceparents=NO_TRACES) -> StepOutput:
        t0 = time.perf_counter()
        i = self.info_now
        rejected = validate_batch(batch, vocab_size=i.vocab_size, num_pages=i.num_pages, page_size=i.page_size,
                                  max_model_len=i.max_model_len, max_step_tokens=1 << 16)
        assert not rejected, f"the benchmark's engine sent malformed items: {rejected}"
        sampled = [SampledToken(item.req_id, 1000 + item.end_pos % 97, -0.5) for item in batch.items if item.sample]
        hold(self.step_s - (time.perf_counter() - t0))
        self.num_steps += 1
        return StepOutput(sampled, sum(len(item.token_ids) for item in batch.items), self.step_s * 1000)

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


def fixed_time_info(worker_id: str, model_fingerprint: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                    num_pages: int, page_size: int = 16, max_model_len: int = 8192) -> WorkerInfo:
    """A WorkerInfo for the double: the served model's identity (the gateway checks it against its tokenizer's),
    a pool of ``num_pages`` pages; the shape fields are SmolLM2-135M's (they only feed the logs)."""
    return WorkerInfo(worker_id, time.time_ns(), "fixed-time", model_fingerprint, page_size, num_pages, "bfloat16",
                      bytes_per_token=30 * 2 * 3 * 64 * 2, pool_bytes=num_pages * page_size * 30 * 2 * 3 * 64 * 2,
                      num_layers=30, num_kv_heads=3, num_heads=9, head_dim=64, vocab_size=vocab_size,
                      max_model_len=max_model_len, eos_token_ids=eos_token_ids, device="fixed-time",
                      attention_backend="fixed-time")
