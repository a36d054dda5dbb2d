"""Anthropic's Messages API request body (``POST /v1/messages``) as pydantic models, and its conversion into the
gateway core's GenerateInput, with each ``cache_control`` breakpoint as a soft pin of the prompt's prefix up to
and including its block.

Text is what kvserve serves: tools, images, documents and extended thinking are refused naming what was sent, as
is an assistant turn at the end (Anthropic continues it; a chat template cannot), so a request never silently
gets something else than it asked for. Fields that change nothing here (``metadata``, ``service_tier``) are
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.common.errors import InvalidRequest
from kvserve.common.request_checks import check_text
from kvserve.common.tokenizer import ChatTemplateError, Tokenizer
from kvserve.common.wire.pages import PinPoint
from kvserve.common.wire.worker import SamplingParams
from kvserve.services.gateway.http.protocol import ParamError
from kvserve.services.gateway.validate import GenerateInput

DEFAULT_TEMPERATURE = 1.0  # Anthropic's, as OpenAI's: unset is not greedy
MAX_BREAKPOINTS = 4  # Anthropic's limit of blocks with cache_control per request (the top-level one included)
TTL_S = {"5m": 300, "1h": 3600}  # cache_control.ttl; unset = "5m"

# Request fields kvserve cannot honour -> (the value that asks for nothing, what the 400 says).
REFUSED_FIELDS = {"tools": ([], "tools are not supported"),
                  "tool_choice": ({"type": "none"}, "tool_choice is not supported (no tools)"),
                  "thinking": ({"type": "disabled"}, "extended thinking is not supported"),
                  "mcp_servers": ([], "MCP servers are not supported"),
                  "container": (None, "containers are not supported")}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheControl(_Body):
    type: str
    ttl: str | None = None

    @model_validator(mode="after")
    def _ephemeral(self):
        if self.type != "ephemeral":
            raise ParamError(f"cache_control.type must be 'ephemeral', got {self.type!r}", "cache_control")
        if self.ttl is not None and self.ttl not in TTL_S:
            raise ParamError(f"cache_control.ttl must be one of {', '.join(TTL_S)}, got {self.ttl!r}",
                             "cache_control")
        return self

    @property
    def ttl_s(self) -> int:
        return TTL_S[self.ttl or "5m"]


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: list[TextBlock]  # a string content arrives here as one text block (MessagesRequest._text_only)


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A block with cache_control: the prompt's prefix through block ``block`` of turn ``turn`` is pinned."""

    turn: int  # index into MessagesRequest.turns() (the system prompt, when there is one, is turn 0)
    block: int
    ttl_s: int


def _joined(blocks: list[TextBlock]) -> str:
    # A turn's text blocks are one text, concatenated with nothing between them: Anthropic reads consecutive
    # blocks as one continuous content (a client that wants a separator puts it in the text), as OpenAI's
    # content parts are joined by protocol.ChatMessage.text.
    return "".join(b.text for b in blocks)


def _as_blocks(where: str, content: Any) -> list:
    """``content`` as a list of blocks: a string is one text block. Raises ParamError, naming the place
    (``messages.1.content``), for another shape or a block that is not text."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ParamError(f"{where} must be a string or a list of text blocks", where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind is not None and kind != "text":
            raise ParamError(f"{where}.{j}: {kind} blocks are not supported; this server takes text blocks only",
                             f"{where}.{j}.type")
    return content


class MessagesRequest(_Body):
    model: str | None = None  # None = the served model (Anthropic requires it; curl users need not)
    max_tokens: int = Field(ge=1)  # required, as Anthropic's
    messages: list[InputMessage]
    system: list[TextBlock] = []  # a string arrives as one text block; "" or null as none
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # ignored
    cache_control: CacheControl | None = None  # a breakpoint on the request's last block

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Refuses what is not text before the shapes are checked, so that the 400 names it (an image block,
        tools), and turns string contents into one text block (a copy: the body is left as it came)."""
        if not isinstance(data, dict):
            return data
        for name, (neutral, message) in REFUSED_FIELDS.items():
            if data.get(name) not in (None, neutral):
                raise ParamError(message, name)
        output = data.get("output_config")
        if isinstance(output, dict) and output.get("format") is not None:  # its effort changes nothing here
            raise ParamError("output_config.format (structured outputs) is not supported", "output_config.format")
        data = dict(data)
        system = data.get("system")
        data["system"] = [] if system is None or system == "" else _as_blocks("system", system)
        if isinstance(data.get("messages"), list):
            data["messages"] = [{**m, "content": _as_blocks(f"messages.{i}.content", m["content"])}
                                if isinstance(m, dict) and "content" in m else m
                                for i, m in enumerate(data["messages"])]
        return data

    @model_validator(mode="after")
    def _servable(self):
        if not self.messages:
            raise ParamError("messages is empty: send at least one message", "messages")
        if self.messages[-1].role == "assistant":
            raise ParamError("the last message must be the user's: continuing an assistant turn (prefill) is not "
                             "supported", f"messages.{len(self.messages) - 1}.role")
        num = len(self.breakpoints())
        if num > MAX_BREAKPOINTS:
            raise ParamError(f"{num} blocks have cache_control; at most {MAX_BREAKPOINTS} are allowed",
                             "cache_control")
        return self

    def turns(self) -> list[tuple[str, list[TextBlock]]]:
        """(role, text blocks) of the conversation, the system prompt as a leading "system" turn if any."""
        head = [("system", self.system)] if self.system else []
        return head + [(m.role, m.content) for m in self.messages]

    def breakpoints(self) -> list[Breakpoint]:
        """Each block with cache_control, in prompt order; the top-level cache_control marks the last block."""
        turns = self.turns()
        points = [Breakpoint(t, b, block.cache_control.ttl_s) for t, (_, blocks) in enumerate(turns)
                  for b, block in enumerate(blocks) if block.cache_control is not None]
        if self.cache_control is not None and turns and turns[-1][1]:
            last = (len(turns) - 1, len(turns[-1][1]) - 1)
            if not any((p.turn, p.block) == last for p in points):
                points.append(Breakpoint(*last, self.cache_control.ttl_s))
        return points

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
                              top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p)

    def to_input(self, tokenizer: Tokenizer) -> GenerateInput:
        """The core's input: one (role, text) message per turn, and a pin per breakpoint (tokenised here: the
        chat template decides where a block ends in tokens). Raises InvalidRequest."""
        turns = self.turns()
        messages = tuple((role, _joined(blocks)) for role, blocks in turns)
        breakpoints = self.breakpoints()
        pins = pin_points(turns, breakpoints, tokenizer) if breakpoints else ()
        return GenerateInput(prompt=None, messages=messages, sampling=self.sampling(), max_tokens=self.max_tokens,
                             stop=tuple(self.stop_sequences or ()), pins=pins)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pin_points(turns: list[tuple[str, list[TextBlock]]], breakpoints: list[Breakpoint],
               tokenizer: Tokenizer) -> tuple[PinPoint, ...]:
    """One PinPoint per breakpoint: the tokens of the conversation cut right after its block (the turns before
    it, its own turn with its blocks up to it), rendered without the generation prompt, that the whole prompt
    shares. The template closes the cut turn (``<|im_end|>``) where the prompt goes on: only the common prefix
    can be served from the cache. A breakpoint that shares no token pins nothing. Raises InvalidRequest."""
    def render(msgs: list[tuple[str, str]], generation: bool) -> list[int]:
        try:
            text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in msgs], generation)
        except ChatTemplateError as e:
            raise InvalidRequest(str(e)) from e
        return tokenizer.encode(text)

    joined = [(role, _joined(blocks)) for role, blocks in turns]
    num_system = sum(role == "system" for role, _ in turns)
    for i, (_, text) in enumerate(joined):  # before the tokenizer sees it: no lone surrogates
        check_text("system" if i < num_system else f"messages.{i - num_system}.content", text)
    prompt_ids = render(joined, True)
    pins = []
    for p in breakpoints:
        role, blocks = turns[p.turn]
        head = joined[:p.turn] + [(role, _joined(blocks[:p.block + 1]))]
        num_tokens = common_prefix(render(head, False), prompt_ids)
        if num_tokens:
            pins.append(PinPoint(num_tokens, p.ttl_s))
    return tuple(pins)
