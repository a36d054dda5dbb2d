"""The OpenAI request bodies kvserve serves, as pydantic models (one module, as vLLM's protocol.py), and their
conversion into the gateway core's GenerateInput.

Fields OpenAI defines that kvserve cannot honour are accepted only at their neutral value (``n`` = 1,
``echo`` false, penalties 0, no ``logit_bias``, no tools), so a request never silently gets something else than
it asked for; fields nobody here defines are ignored, as OpenAI's own clients send extras.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.pages import PinPoint
from kvserve.common.wire.worker import SamplingParams
from kvserve.services.gateway.validate import GenerateInput

# OpenAI's default sampling temperature (the API's, not kvserve gRPC's, where unset means greedy).
DEFAULT_TEMPERATURE = 1.0
# prompt_cache_retention -> the soft pins it asks for: "24h" pins the whole prompt's prefix for a day.
RETENTION_PINS = {"in_memory": (), "24h": (PinPoint(num_tokens=0, ttl_s=24 * 3600),)}


class ParamError(InvalidRequest):
    """A request body field is malformed or unsupported; ``param`` names it (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param=param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields completions and chat completions share."""

    model: str | None = None  # None = the served model (OpenAI requires it; curl users need not)
    max_tokens: int | None = None  # None = the gateway's default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0 disables it
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_cache_key: str | None = None  # placement affinity within the tenant (its length: validate.py)
    prompt_cache_retention: str | None = None  # a key of RETENTION_PINS; None = "in_memory"

    @model_validator(mode="after")
    def _supported(self):
        if self.prompt_cache_retention not in (None, *RETENTION_PINS):
            raise ParamError(f"prompt_cache_retention must be one of {', '.join(map(repr, RETENTION_PINS))}, got "
                             f"{self.prompt_cache_retention!r}", "prompt_cache_retention")
        if self.n not in (None, 1):
            raise ParamError(f"n must be 1 (one choice per request), got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ParamError(f"{name} is not supported (send 0 or leave it out)", name)
        if self.logit_bias:
            raise ParamError("logit_bias is not supported", "logit_bias")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, top_logprobs: int) -> SamplingParams:
        top_k = self.top_k or 0
        return SamplingParams(temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
                              top_k=0 if top_k == -1 else top_k, top_p=1.0 if self.top_p is None else self.top_p,
                              seed=self.seed, top_logprobs=top_logprobs)

    def _input(self, *, max_tokens: int | None, logprobs: bool, top_logprobs: int, **prompt) -> GenerateInput:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerateInput(sampling=self.sampling(top_logprobs), max_tokens=max_tokens or 0, stop=stop,
                             logprobs=logprobs, ignore_eos=self.ignore_eos,
                             pins=RETENTION_PINS[self.prompt_cache_retention or "in_memory"],
                             cache_key=self.prompt_cache_key or "", **prompt)


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = None  # alternatives per token; 0 = the sampled token's logprob alone
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ParamError(f"send one prompt per request, got {len(self.prompt)}", "prompt")
            self.prompt = self.prompt[0]
        if self.echo:
            raise ParamError("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise ParamError(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.suffix:
            raise ParamError("suffix is not supported", "suffix")
        return self

    def to_input(self) -> GenerateInput:
        prompt = dict(prompt=self.prompt, messages=None) if isinstance(self.prompt, str) else dict(
            prompt=None, messages=None, prompt_token_ids=tuple(self.prompt))
        return self._input(max_tokens=self.max_tokens, logprobs=self.logprobs is not None,
                           top_logprobs=self.logprobs or 0, **prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are sent
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    # Extra variables for the model's chat template, as vLLM takes them: {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools:
            raise ParamError("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ParamError("response_format other than text is not supported", "response_format")
        return self

    def to_input(self) -> GenerateInput:
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        messages = tuple((m.role, m.text) for m in self.messages)
        return self._input(max_tokens=max_tokens, logprobs=self.logprobs, top_logprobs=self.top_logprobs or 0,
                           prompt=None, messages=messages,
                           template_kwargs=tuple(sorted((self.chat_template_kwargs or {}).items())))


# What a field that takes one of several shapes must be, for the message when it is none of them.
SHAPES = {"prompt": "a string or a list of token ids (integers >= 0), or a list of one of those",
          "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def _error(e: ValidationError) -> ParamError:
    """One ParamError for pydantic's errors: the first field named, as ``messages.0.content``."""
    errors = e.errors()
    cause = errors[0].get("ctx", {}).get("error")
    if isinstance(cause, ParamError):  # raised by a validator above: its own message and param
        return cause
    loc = errors[0]["loc"]
    union = [err for err in errors if err["loc"][:1] == loc[:1]]
    if len(union) > 1:  # the value is none of a union's shapes: pydantic names each member after the field
        common = min(next((i for i, (a, b) in enumerate(zip(loc, err["loc"], strict=False)) if a != b),
                          len(loc)) for err in union[1:])
        path = ".".join(str(p) for p in loc[:common])
        name = next((str(p) for p in reversed(loc[:common]) if isinstance(p, str)), "")
        return ParamError(f"{path} must be {SHAPES.get(name, 'of another type')}", path)
    path = ".".join(str(p) for p in loc)
    return ParamError(f"{path}: {errors[0]['msg']}" if path else errors[0]["msg"], path or None)


def parse(model: type[_Sampling], body: Any) -> _Sampling:
    """The request body as ``model``. Raises ParamError naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise ParamError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _error(e) from None
