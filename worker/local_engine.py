"""In-process generation on one ModelRunner: no services, pages handed out in order.

Used by ``kvserve generate --local`` and the benchmarks. It drives the runner through the same StepBatch API
the gateway uses over gRPC, with chunked prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import num_pages_for
from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem
from kvserve.worker.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class GenerateParams:
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    prefill_chunk: int = 512  # tokens per prefill step
    stop_at_eos: bool = True


def _pages(runner: ModelRunner, num_tokens: int) -> tuple[int, ...]:
    num = num_pages_for(num_tokens, runner.info.page_size)
    if num > runner.info.num_pages:
        raise InvalidRequest(f"{num_tokens} tokens need {num} pages; the pool has {runner.info.num_pages}")
    return tuple(range(num))


def generate(runner: ModelRunner, prompt_ids: list[int], params: GenerateParams) -> Iterator[int]:
    """Yields generated token ids one by one (greedy when sampling.temperature is 0)."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if params.max_tokens <= 0:
        return
    page_table = _pages(runner, len(prompt_ids) + params.max_tokens)
    pos, token = 0, None
    while pos < len(prompt_ids):
        chunk = tuple(prompt_ids[pos:pos + params.prefill_chunk])
        last = pos + len(chunk) == len(prompt_ids)
        out = runner.step(StepBatch((StepItem("local", chunk, pos, page_table, last, params.sampling),)))
        pos += len(chunk)
        token = out.sampled[0].token_id if last else None
    eos = set(runner.info.eos_token_ids) if params.stop_at_eos else set()
    for n in range(params.max_tokens):
        yield token
        if token in eos or n + 1 == params.max_tokens:
            return
        out = runner.step(StepBatch((StepItem("local", (token,), pos, page_table, True, params.sampling),)))
        pos += 1
        token = out.sampled[0].token_id
