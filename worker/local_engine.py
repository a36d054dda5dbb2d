"""In-process generation on one ModelRunner: no services, pages handed out in order.

Used by ``kvserve generate --local`` and the benchmarks. It drives the runner through the same StepBatch API
the gateway uses over gRPC, with chunked prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import HOLE, num_pages_for, releasable_pages
from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem
from kvserve.worker.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class GenerateParams:
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    prefill_chunk: int = 512  # tokens per prefill step
    stop_at_eos: bool = True


class _Pages:
    """The one request's page table over the whole pool: pages taken in order as positions need them, and with
    a sliding window the pages it leaves behind released (HOLEs) and reused, so a request with attention sinks
    runs for any length in a pool of a window's pages."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.table = runner, []
        self.free = list(range(runner.info.num_pages))

    def cover(self, start: int, end: int) -> tuple[int, ...]:
        """The table for a step computing positions [start, end)."""
        info, r = self.runner.info, self.runner
        if r.window:
            for k in releasable_pages(start, r.window, r.sinks, info.page_size):
                if self.table[k] != HOLE:
                    self.free.append(self.table[k])
                    self.table[k] = HOLE
        need = num_pages_for(end, info.page_size) - len(self.table)
        if need > len(self.free):
            raise InvalidRequest(f"{end} tokens need {need + sum(p != HOLE for p in self.table)} pages; the pool "
                                 f"has {info.num_pages}")
        self.table += [self.free.pop(0) for _ in range(need)]
        return tuple(self.table)


def generate(runner: ModelRunner, prompt_ids: list[int], params: GenerateParams) -> Iterator[int]:
    """Yields generated token ids one by one (greedy when sampling.temperature is 0)."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if params.max_tokens <= 0:
        return
    pages = _Pages(runner)
    if not runner.window:  # all at once: a request that cannot fit fails before it computes anything
        pages.cover(0, len(prompt_ids) + params.max_tokens)
    pos, token = 0, None
    while pos < len(prompt_ids):
        chunk = tuple(prompt_ids[pos:pos + params.prefill_chunk])
        last = pos + len(chunk) == len(prompt_ids)
        item = StepItem("local", chunk, pos, pages.cover(pos, pos + len(chunk)), last, params.sampling)
        out = runner.step(StepBatch((item,)))
        pos += len(chunk)
        token = out.sampled[0].token_id if last else None
    eos = set(runner.info.eos_token_ids) if params.stop_at_eos else set()
    for n in range(params.max_tokens):
        yield token
        if token in eos or n + 1 == params.max_tokens:
            return
        item = StepItem("local", (token,), pos, pages.cover(pos, pos + 1), True, params.sampling)
        out = runner.step(StepBatch((item,)))
        pos += 1
        token = out.sampled[0].token_id
