"""The client SDK's value types, and the only place that converts between them and the gateway's protos."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.v1 import gateway_pb2

_FINISH_REASONS = {
    gateway_pb2.FINISH_REASON_EOS: "eos",
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request, as billing and cache metrics see them.

    Attributes:
        prompt_tokens: tokens of the prompt (after the chat template).
        cached_tokens: of those, tokens whose K/V came from the prefix cache.
        completion_tokens: tokens generated.
        pinned_tokens: of the prompt tokens, those under a soft pin this request took or refreshed
            (``cache_pins``); a multiple of the page size.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    pinned_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CachePin:
    """A soft pin of a prompt's prefix: its pages stay cached (in the workers' pools and the shared KV tier)
    for ``ttl_s`` seconds after the pin is taken or last hit, within the tenant's pin budget.

    Attributes:
        num_tokens: prompt tokens the pin covers (its full pages are pinned); 0 = the whole prompt.
        ttl_s: seconds the pin lasts after it is taken or last hit (the gateway takes 1 to 7 days' worth).
    """

    num_tokens: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class Logprob:
    """The logprob of one generated token and its most likely alternatives.

    Attributes:
        token_id: the generated token.
        logprob: its natural-log probability under the model's raw distribution.
        top_logprobs: ``(token_id, logprob)`` of the most likely alternatives, most likely first.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed message of a completion.

    Attributes:
        req_id: server-assigned request id, the same on every delta of a stream.
        text: text new since the previous delta (may be empty).
        token_ids: token ids generated since the previous delta.
        logprobs: one per ``token_ids`` entry when the request asked for logprobs; empty otherwise.
        finish_reason: ``"eos"``, ``"stop"`` or ``"length"`` on the last delta, None before it
            (``"unknown"`` for a reason this SDK does not know yet).
        usage: token counts, on the last delta only.
    """

    req_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    usage: Usage | None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished completion.

    Attributes:
        req_id: server-assigned request id.
        text: the completion's text (without a matched stop string).
        token_ids: all generated token ids, those of a matched stop string included.
        logprobs: one per ``token_ids`` entry when the request asked for logprobs; empty otherwise.
        finish_reason: ``"eos"``, ``"stop"`` or ``"length"`` (``"unknown"`` for a reason this SDK does not know).
        usage: token counts.
    """

    req_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    usage: Usage


def _set(message, **fields) -> None:
    """Sets fields of a message; a value that does not fit its field (range, type) is a ValueError that names
    the argument, not protobuf's bare "Value out of range"."""
    for name, value in fields.items():
        try:
            setattr(message, name, value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}={value!r} does not fit the request's field: {e}") from None


def build_request(prompt: str | None = None, messages: Sequence[Mapping[str, str]] | None = None, *,
                  prompt_token_ids: Sequence[int] | None = None, max_tokens: int = 0, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: str | Iterable[str] = (),
                  logprobs: bool = False, top_logprobs: int = 0, ignore_eos: bool = False,
                  cache_pins: Iterable[CachePin | tuple[int, int]] = (),
                  cache_key: str = "",
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> gateway_pb2.GenerateRequest:
    """Builds a GenerateRequest. Values are sent as given: the gateway validates ranges.

    Args:
        prompt: raw text, tokenised as is (no chat template).
        messages: chat messages, each a mapping with ``"role"`` and ``"content"``, oldest first.
        prompt_token_ids: the prompt as token ids of the model's vocabulary, fed as they are (no tokenisation,
            no chat template); the gateway rejects an empty list or an id at or above the vocabulary size.
        max_tokens: most tokens to generate; 0 means the gateway's default.
        temperature: softmax temperature; 0 is greedy.
        top_p: nucleus mass; 1.0 disables the filter (and leaves the field unset).
        top_k: keep only the k most likely tokens; 0 disables the filter.
        seed: per-request seed for reproducible sampling; None is nondeterministic.
        stop: a string, or strings, that end the completion when generated (not returned in text).
        logprobs: whether to return each generated token's logprob.
        top_logprobs: number of alternatives returned with each token's logprob.
        ignore_eos: keep generating past end-of-sequence tokens until max_tokens.
        cache_pins: soft pins of prompt prefixes, each a ``CachePin`` or a ``(num_tokens, ttl_s)`` pair
            (num_tokens 0 = the whole prompt); at most 8. ``usage.pinned_tokens`` says what was pinned.
        cache_key: placement affinity within the tenant: requests with the same key go to the same worker
            while it has room (OpenAI's prompt_cache_key); empty for none.
        chat_template_kwargs: extra variables for the model's chat template, with ``messages`` only (Qwen3's
            ``{"enable_thinking": False}``); values are strings, numbers, booleans or None.

    Returns:
        The request message.

    Raises:
        ValueError: not exactly one of ``prompt``, ``messages`` and ``prompt_token_ids`` is given, a message
            lacks ``"role"`` or ``"content"``, a cache pin is not a CachePin or a pair of ints, or a value does
            not fit its field (``seed=-1``, ``max_tokens=2**40``, a token id outside 0 to 2**32 - 1); the
            message names the argument.
    """
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages and prompt_token_ids")
    if chat_template_kwargs and messages is None:
        raise ValueError("chat_template_kwargs go with messages (a chat template renders them)")
    request = gateway_pb2.GenerateRequest()
    sampling = request.sampling
    _set(sampling, temperature=temperature, top_k=top_k, top_logprobs=top_logprobs)
    if top_p != 1.0:
        _set(sampling, top_p=top_p)
    if seed is not None:
        _set(sampling, seed=seed)
    _set(request, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=ignore_eos, cache_key=cache_key)
    request.cache_pins.extend(_cache_pins(cache_pins))
    try:
        request.stop.extend([stop] if isinstance(stop, str) else stop)
    except TypeError as e:
        raise ValueError(f"stop={stop!r}: give a string or a list of strings ({e})") from None
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.CopyFrom(_chat_messages(messages))
        if chat_template_kwargs:
            try:
                request.messages.chat_template_kwargs.update(chat_template_kwargs)
            except (ValueError, TypeError) as e:
                raise ValueError(f"chat_template_kwargs={chat_template_kwargs!r}: {e}") from None
    else:
        request.prompt_token_ids.CopyFrom(_prompt_token_ids(prompt_token_ids))
    return request


def _chat_messages(messages: Sequence[Mapping[str, str]]) -> gateway_pb2.ChatMessages:
    chat = gateway_pb2.ChatMessages()
    for i, message in enumerate(messages):
        try:
            chat.messages.add(role=message["role"], content=message["content"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content'") from e
    return chat


def _prompt_token_ids(token_ids: Sequence[int]) -> gateway_pb2.PromptTokenIds:
    """The ids as the oneof's message; an empty list is sent too (set, and empty), for the gateway to refuse."""
    message = gateway_pb2.PromptTokenIds()
    try:
        message.token_ids.extend(token_ids)
    except (ValueError, TypeError) as e:
        raise ValueError(f"prompt_token_ids: give a sequence of ints from 0 to 2**32 - 1 ({e})") from None
    return message


def _cache_pins(pins: Iterable[CachePin | tuple[int, int]]) -> list[gateway_pb2.CachePin]:
    messages = []
    for i, pin in enumerate(pins):
        try:
            num_tokens, ttl_s = (pin.num_tokens, pin.ttl_s) if isinstance(pin, CachePin) else pin
            messages.append(gateway_pb2.CachePin(num_tokens=num_tokens, ttl_s=ttl_s))
        except (ValueError, TypeError) as e:
            raise ValueError(f"cache_pins[{i}]={pin!r}: give a CachePin or a (num_tokens, ttl_s) pair of ints "
                             f"({e})") from None
    return messages


def delta_from_response(response: gateway_pb2.GenerateResponse) -> Delta:
    """Converts one streamed GenerateResponse into a Delta (usage only when the message carries it)."""
    return Delta(req_id=response.req_id, text=response.text, token_ids=tuple(response.token_ids),
                 logprobs=_logprobs(response.logprobs), finish_reason=_finish_reason(response.finish_reason),
                 usage=_usage(response.usage) if response.HasField("usage") else None)


def completion_from_response(response: gateway_pb2.GenerateResponse) -> Completion:
    """Converts Complete's answer (one GenerateResponse holding the whole completion) into a Completion (zero
    usage when the message lacks it)."""
    return Completion(req_id=response.req_id, text=response.text, token_ids=tuple(response.token_ids),
                      logprobs=_logprobs(response.logprobs), finish_reason=_finish_reason(response.finish_reason),
                      usage=_usage(response.usage))


def _finish_reason(value: int) -> str | None:
    if value == gateway_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_REASONS.get(value, "unknown")


def _usage(usage: gateway_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                 completion_tokens=usage.completion_tokens, pinned_tokens=usage.pinned_tokens)


def _logprobs(logprobs: Iterable[gateway_pb2.GeneratedLogprob]) -> tuple[Logprob, ...]:
    return tuple(Logprob(token_id=lp.token_id, logprob=lp.logprob,
                         top_logprobs=tuple((alt.token_id, alt.logprob) for alt in lp.top_logprobs))
                 for lp in logprobs)
