"""The gateway core's deltas in OpenAI's response shapes: text completions (``text_completion``) and chat
completions (``chat.completion`` / ``chat.completion.chunk``), whole or as stream chunks, with usage and
logprobs. One Rendering per request; it keeps the little state a stream needs (the text offset of completions'
logprobs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.common.wire.worker import SampledToken
from kvserve.services.gateway.handle import OutputDelta, Usage
from kvserve.services.gateway.request import FinishReason

FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def usage_body(usage: Usage) -> dict:
    """OpenAI's usage, with the prompt tokens served from the prefix cache always filled in."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.num_cached_tokens}}


@dataclass(slots=True)
class Rendering:
    chat: bool  # chat completions, else text completions
    req_id: str
    model: str
    token_text: Callable[[int], str]  # a token's text, special tokens included
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # completions' logprobs: characters of the completion before the next token

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.req_id}"

    def _envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": f"{kind}.chunk" if chunk and self.chat else kind,
                "created": self.created, "model": self.model}

    # -- logprobs ----------------------------------------------------------------------------------------
    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _chat_logprobs(self, sampled: list[SampledToken]) -> dict:
        return {"content": [{**self._chat_entry(s.token_id, s.logprob),
                             "top_logprobs": [self._chat_entry(t, lp) for t, lp in s.top_logprobs]}
                            for s in sampled]}

    def _completion_logprobs(self, sampled: list[SampledToken]) -> dict:
        tokens = [self.token_text(s.token_id) for s in sampled]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in sampled],
                "top_logprobs": [{self.token_text(t): lp for t, lp in s.top_logprobs} for s in sampled],
                "text_offset": offsets}

    def _logprobs(self, sampled: list[SampledToken]) -> dict:
        return self._chat_logprobs(sampled) if self.chat else self._completion_logprobs(sampled)

    # -- whole responses and stream chunks ---------------------------------------------------------------
    def _choice(self, text: str, sampled: list[SampledToken] | None, finish: FinishReason | None,
                chunk: bool) -> dict:
        choice: dict = {"index": 0}
        if self.chat:  # a stream's chunks carry the role once, in the first (role_chunk)
            choice["delta" if chunk else "message"] = {"content": text} if chunk else {"role": "assistant",
                                                                                      "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(sampled) if sampled is not None else None
        choice["finish_reason"] = FINISH.get(finish)
        return choice

    def response(self, text: str, sampled: list[SampledToken] | None, finish: FinishReason, usage: Usage) -> dict:
        """The whole completion (not streamed); ``sampled`` when the request asked for logprobs."""
        return {**self._envelope(chunk=False), "choices": [self._choice(text, sampled, finish, chunk=False)],
                "usage": usage_body(usage)}

    def chunk(self, delta: OutputDelta, with_logprobs: bool, include_usage: bool) -> dict:
        """One stream chunk for ``delta``; ``usage`` is null in each when the client asked for a usage chunk."""
        body = {**self._envelope(chunk=True),
                "choices": [self._choice(delta.text, delta.logprobs if with_logprobs else None, delta.finish_reason,
                                         chunk=True)]}
        if include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, include_usage: bool) -> dict:
        """A chat stream's first chunk: the assistant's role, no content yet (as OpenAI's)."""
        body = self.chunk(OutputDelta(), with_logprobs=False, include_usage=include_usage)
        body["choices"][0]["delta"]["role"] = "assistant"
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        """The stream's last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(chunk=True), "choices": [], "usage": usage_body(usage)}
