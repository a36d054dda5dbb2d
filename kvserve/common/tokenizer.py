"""Text <-> token ids for a model folder: ``tokenizer.json`` via the tokenizers library, and the chat
template rendered with Jinja2 the way HF transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Encodes and decodes like ``AutoTokenizer`` on the same folder (fast tokenizer, special tokens added
    by tokenizer.json's post-processor only)."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_file = folder / "chat_template.jinja"
        self.chat_template: str | None = config.get("chat_template")
        if template_file.exists():
            self.chat_template = template_file.read_text()
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Renders ``messages`` ([{"role": ..., "content": ...}]) into the prompt text the model expects; ``kwargs``
        are extra template variables (Qwen3's ``enable_thinking``), as HF's apply_chat_template passes them."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        try:
            template = env.from_string(self.chat_template)
            return template.render(**{**kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                                      "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """Appends one token; returns the new text that is complete so far (may be empty)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta
