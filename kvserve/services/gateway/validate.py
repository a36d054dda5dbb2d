"""A client's generation request -> a validated Request, or InvalidRequest naming what is wrong. Nothing is
queued and no page is touched before this passes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvserve.common.errors import InvalidRequest
from kvserve.common.request_checks import check_sampling, check_stop, check_text
from kvserve.common.tokenizer import ChatTemplateError, Tokenizer
from kvserve.common.wire.pages import MAX_PIN_TTL_S, MAX_PINS, PinPoint
from kvserve.common.wire.worker import SamplingParams
from kvserve.services.gateway.request import Request, RequestParams

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A Generate/Complete call after protobuf decoding, before validation."""

    prompt: str | None  # exactly one of prompt, messages and prompt_token_ids
    messages: tuple[tuple[str, str], ...] | None  # (role, content)
    sampling: SamplingParams
    prompt_token_ids: tuple[int, ...] | None = None  # an already tokenised prompt, fed as is
    max_tokens: int = 0  # 0 = the gateway's default
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    # Soft pins of prompt prefixes (cache_control breakpoints, prompt_cache_retention): num_tokens past the prompt
    # are cut to it; 0 = the whole prompt.
    pins: tuple[PinPoint, ...] = ()
    cache_key: str = ""  # placement affinity within the tenant (OpenAI's prompt_cache_key)
    template_kwargs: tuple[tuple[str, object], ...] = ()  # extra chat template variables (enable_thinking)


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int  # prompt + completion tokens
    max_pool_tokens: int  # page_size * num_pages of the smallest worker pool: one request must fit alone
    vocab_size: int = 0  # the model's: prompt token ids must lie below it (0 = unchecked)
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096

    @property
    def max_request_tokens(self) -> int:
        """Prompt + completion tokens one request may have: the model's context and one whole pool bound it."""
        return min(self.max_model_len, self.max_pool_tokens)


def _prompt_ids(inp: GenerateInput, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if sum(x is not None for x in (inp.prompt, inp.messages, inp.prompt_token_ids)) != 1:
        raise InvalidRequest("set exactly one of prompt, messages and prompt_token_ids")
    if inp.prompt_token_ids is None:
        return tokenizer.encode(_prompt_text(inp, tokenizer))
    if not inp.prompt_token_ids:
        raise InvalidRequest("empty prompt_token_ids: send at least one token id")
    limit = vocab_size or float("inf")
    bad = next((i for i, t in enumerate(inp.prompt_token_ids) if not 0 <= t < limit), None)
    if bad is not None:
        raise InvalidRequest(f"prompt_token_ids[{bad}] = {inp.prompt_token_ids[bad]} is not a token id of this "
                             f"model (0 to {vocab_size - 1})", param="prompt")
    return list(inp.prompt_token_ids)


def _prompt_text(inp: GenerateInput, tokenizer: Tokenizer) -> str:
    if inp.prompt is not None:
        if not inp.prompt:
            raise InvalidRequest("empty prompt: send at least one character", param="prompt")
        check_text("prompt", inp.prompt)
        return inp.prompt
    if not inp.messages:
        raise InvalidRequest("empty messages: send at least one chat message")
    for i, (role, content) in enumerate(inp.messages):
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}",
                                 param=f"messages.{i}.role")
        check_text(f"messages[{i}].content", content)
    for name, value in inp.template_kwargs:
        if not isinstance(value, str | int | float | bool | None):
            raise InvalidRequest(f"chat_template_kwargs[{name!r}] must be a string, a number, a boolean or null, "
                                 f"got {type(value).__name__}", param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in inp.messages],
                                             **dict(inp.template_kwargs))
    except ChatTemplateError as e:
        raise InvalidRequest(str(e)) from e


def _max_tokens(inp: GenerateInput, num_prompt: int, limits: Limits) -> int:
    room = limits.max_request_tokens - num_prompt
    if inp.max_tokens < 0:
        raise InvalidRequest(f"max_tokens must be >= 0 (0 = default), got {inp.max_tokens}", param="max_tokens")
    if inp.max_tokens > limits.max_tokens_limit:
        raise InvalidRequest(f"max_tokens {inp.max_tokens} is above this gateway's limit of "
                             f"{limits.max_tokens_limit}", param="max_tokens")
    if inp.max_tokens > room:
        raise InvalidRequest(f"prompt ({num_prompt} tokens) + max_tokens ({inp.max_tokens}) exceeds the "
                             f"{num_prompt + room} tokens a request may have (model context "
                             f"{limits.max_model_len}, worker pool {limits.max_pool_tokens} tokens)")
    return inp.max_tokens or min(limits.default_max_tokens, room)


def validate_request(inp: GenerateInput, tenant: str, tokenizer: Tokenizer, limits: Limits) -> Request:
    """Validates and tokenises. Raises InvalidRequest with a message that says what was wrong."""
    check_sampling("", inp.sampling)
    check_stop(inp.stop)
    prompt_ids = _prompt_ids(inp, tokenizer, limits.vocab_size)
    if not prompt_ids:
        raise InvalidRequest("the prompt encodes to no tokens")
    room = limits.max_request_tokens
    if len(prompt_ids) >= room:
        raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; at most {room - 1} fit (model context "
                             f"{limits.max_model_len}, worker pool {limits.max_pool_tokens} tokens), leaving room "
                             "for one generated token")
    params = RequestParams(max_tokens=_max_tokens(inp, len(prompt_ids), limits), sampling=inp.sampling,
                           stop=inp.stop, logprobs=inp.logprobs, ignore_eos=inp.ignore_eos)
    return Request(req_id=f"req-{uuid.uuid4().hex[:16]}", tenant=tenant, prompt_token_ids=prompt_ids, params=params,
                   pins=_pins(inp.pins, len(prompt_ids)), cache_key=_cache_key(inp.cache_key))


MAX_CACHE_KEY_CHARS = 1024


def _pins(pins: tuple[PinPoint, ...], num_prompt: int) -> tuple[PinPoint, ...]:
    if len(pins) > MAX_PINS:
        raise InvalidRequest(f"{len(pins)} cache pins asked for; at most {MAX_PINS} per request")
    for p in pins:
        if not 0 < p.ttl_s <= MAX_PIN_TTL_S:
            raise InvalidRequest(f"a cache pin's ttl must be 1 to {MAX_PIN_TTL_S} seconds, got {p.ttl_s}")
        if p.num_tokens < 0:
            raise InvalidRequest(f"a cache pin's num_tokens must be >= 0 (0 = the whole prompt), got {p.num_tokens}")
    return tuple(PinPoint(min(p.num_tokens or num_prompt, num_prompt), p.ttl_s) for p in pins)


def _cache_key(key: str) -> str:
    if len(key) > MAX_CACHE_KEY_CHARS:
        raise InvalidRequest(f"prompt_cache_key has {len(key)} characters; at most {MAX_CACHE_KEY_CHARS}",
                             param="prompt_cache_key")
    return key
