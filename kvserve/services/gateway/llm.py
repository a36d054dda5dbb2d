"""Generation in this process, as nano-vllm's ``LLM``: the engine core (core.py) over an in-process kvmanager
and worker (inprocess.py), so that it batches, chunks prefills and hits the prefix cache as the gateway does,
and validates requests by the gateway's rules. ``kvserve generate --local`` runs on it, and so do the tests and
benchmarks that compare a runner's tokens with another's.

    llm = LLM(runner, tokenizer=tok)
    outputs = llm.generate([prompt_ids, ...], max_tokens=64)     # token ids per prompt, batched
    for text in llm.stream(prompt_ids, max_tokens=64): ...       # one prompt's text as it is generated
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvserve.common.tokenizer import Tokenizer
from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.worker import SamplingParams
from kvserve.services.gateway.core import EngineCore, scheduler_config
from kvserve.services.gateway.inprocess import InProcessKVManager, InProcessWorker
from kvserve.services.gateway.request import FinishReason, Request
from kvserve.services.gateway.validate import GenerateInput, Limits, validate_request

GREEDY = SamplingParams()  # temperature 0


class LLM:
    def __init__(self, runner, *, tokenizer: Tokenizer | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, prefix_caching: bool = True):
        """``runner``: a kvserve/worker/runner.py ModelRunner (or anything with its ``info`` and ``step``).
        ``tokenizer``: for stream()'s text (generate() needs none). A prefill chunk computes at most
        ``max_num_batched_tokens`` tokens, as in the gateway."""
        info = runner.info
        kv = InProcessKVManager()
        kv.register(PoolSpec.of(info))
        cfg = scheduler_config(info, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               prefix_caching=prefix_caching)
        self.core = EngineCore(InProcessWorker(runner), info, kv, cfg, tokenizer=tokenizer)
        pool_tokens = info.attention_window().max_request_tokens(info.max_model_len, info.num_pages * info.page_size)
        self.limits = Limits(info.max_model_len, pool_tokens, info.vocab_size, max_tokens_limit=info.max_model_len)

    def add(self, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False) -> Request:
        """Queues a prompt. Raises InvalidRequest as the gateway would (an empty prompt, one that does not fit)."""
        inp = GenerateInput(None, None, sampling, tuple(prompt_ids), max_tokens=max_tokens, ignore_eos=ignore_eos)
        req = validate_request(inp, "local", self.core.tokenizer, self.limits)
        self.core.add(req)
        return req

    def run(self) -> None:
        """Steps until every request has ended. Raises the error of a request that failed."""
        failed = []
        while self.core.has_work():
            failed += [req for req, _ in self.core.step().ended if req.finish_reason is FinishReason.ERROR]
        if failed:
            raise failed[0].error

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: SamplingParams = GREEDY,
                 ignore_eos: bool = False) -> list[list[int]]:
        """The token ids each prompt generates, computed together (greedy when sampling.temperature is 0)."""
        reqs = [self.add(p, max_tokens, sampling, ignore_eos) for p in prompts]
        self.run()
        return [list(r.output_token_ids) for r in reqs]

    def stream(self, prompt_ids: Sequence[int], max_tokens: int,
               sampling: SamplingParams = GREEDY) -> Iterator[str]:
        """One prompt's generated text, piece by piece (needs the tokenizer). Raises its error if it failed."""
        req = self.add(prompt_ids, max_tokens, sampling)
        while self.core.has_work():
            events = self.core.step()
            yield from (e.text for e in events.tokens if e.req is req and e.text)
            for ended, rest in events.ended:
                if ended is req and req.finish_reason is FinishReason.ERROR:
                    raise req.error
                if ended is req and rest:
                    yield rest
