"""Decode steps at a given context through a runner's real step path (ModelRunner.step: metadata, attention,
sampling), the context prefilled once and shared by every context and round: bench_kvquant's decode speed per KV
dtype and bench_models' per model family."""

from __future__ import annotations

import time

import torch

from kvserve.common.wire.worker import StepBatch, StepItem
from kvserve.worker.runner import ModelRunner


class Decode:
    """Batch sequences holding the same prompt in pages of their own, and a scratch page each for decoding:

        sequence b: prompt pages [b*P, (b+1)*P), scratch page batch*P + b;  P = longest context / page_size
        context c:  page_table = the first c / page_size prompt pages + the scratch page
    """

    def __init__(self, runner: ModelRunner, ids: list[int], prompt_tokens: int, batch: int, chunk: int):
        """Prefills ids[:prompt_tokens] for sequence 0 and copies its pages to the others; ids[context] is each
        sequence's first decode input at a context."""
        self.runner, self.ids, self.batch = runner, ids, batch
        self.page_size = runner.info.page_size
        self.num_prompt_pages = prompt_tokens // self.page_size
        table = tuple(range(self.num_prompt_pages))
        for start in range(0, prompt_tokens, chunk):
            piece = tuple(ids[start:min(start + chunk, prompt_tokens)])
            runner.step(StepBatch((StepItem("p", piece, start, table, sample=False),)))
        runner.call(self._copy_pages)

    def _copy_pages(self) -> None:
        p = self.num_prompt_pages
        for pool in (self.runner.kv_cache, self.runner.kv_scales):
            if pool is not None:
                raw = pool.view(torch.uint8) if pool.element_size() == 1 else pool  # fp8 has no copy kernels
                for b in range(1, self.batch):
                    raw[:, :, b * p:(b + 1) * p] = raw[:, :, :p]

    def run(self, context: int, steps: int) -> float:
        """tok/s of ``steps`` decode steps of every sequence from ``context`` on."""
        page = self.page_size
        assert context % page == 0 and steps <= page and context <= self.num_prompt_pages * page
        p = self.num_prompt_pages
        tables = [tuple(range(b * p, b * p + context // page)) + (self.batch * p + b,) for b in range(self.batch)]
        tokens = [self.ids[context]] * self.batch
        t0 = time.perf_counter()
        for s in range(steps):
            items = tuple(StepItem(f"r{b}", (t,), context + s, tables[b]) for b, t in enumerate(tokens))
            tokens = [o.token_id for o in self.runner.step(StepBatch(items)).sampled]
        return self.batch * steps / (time.perf_counter() - t0)
