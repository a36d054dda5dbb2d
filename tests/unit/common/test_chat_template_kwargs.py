"""Chat templates that take extra variables, as Qwen3's takes ``enable_thinking``: kvserve's renderer gives HF's
apply_chat_template's text for the same template and variables, and the OpenAI front-end's
``chat_template_kwargs`` reaches the template through validation."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve.common.tokenizer import Tokenizer
from kvserve.services.gateway.http.protocol import ChatCompletionRequest, ParamError, parse
from kvserve.services.gateway.validate import Limits, validate_request

# A template written for this test with the constructs Qwen3's uses: a namespace walked over the messages in
# reverse, string tests and splits on a reasoning tag, and a generation prompt that opens an empty reasoning
# block when enable_thinking is false.
TEMPLATE = (
    "{%- set ns = namespace(last_user=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last_user == messages|length - 1 %}"
    "{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- if m.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hm</think>\nHello"},
            {"role": "user", "content": "Add 2 and 2"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("qwen3-template")
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return out


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_the_text_equals_hfs_with_and_without_the_variable(folder, kwargs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, tokenize=False,
                                                                    add_generation_prompt=True, **kwargs)
    assert Tokenizer(folder).apply_chat_template(MESSAGES, **kwargs) == hf
    assert hf.endswith("<think>\n\n</think>\n\n") == (kwargs == {"enable_thinking": False})
    assert "<think>hm" not in hf  # the earlier turn's reasoning is stripped


def test_chat_template_kwargs_reach_the_template_through_the_openai_request(folder):
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    req = validate_request(parse(ChatCompletionRequest, body).to_input(), "a", Tokenizer(folder),
                           Limits(4096, 4096))
    plain = validate_request(parse(ChatCompletionRequest, {"messages": MESSAGES}).to_input(), "a",
                             Tokenizer(folder),
                             Limits(4096, 4096))
    tokenizer = Tokenizer(folder)
    assert tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert len(req.prompt_token_ids) > len(plain.prompt_token_ids)


def test_a_chat_template_kwarg_that_is_not_a_plain_value_names_the_field():
    with pytest.raises(ParamError, match="chat_template_kwargs"):
        parse(ChatCompletionRequest, {"messages": MESSAGES, "chat_template_kwargs": {"x": {"nested": 1}}})


def test_the_sdk_carries_them_over_grpc_to_the_same_prompt(folder):
    """The SDK's request -> the gateway servicer's GenerateInput -> validation: the same prompt as the HTTP path;
    a Struct's integral number reaches the template as an int."""
    from kvserve.services.client.types import build_request
    from kvserve.services.gateway.rpc.servicer import input_from_proto

    request = build_request(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False, "n": 3})
    inp = input_from_proto(request)
    assert inp.template_kwargs == (("enable_thinking", False), ("n", 3))
    over_grpc = validate_request(inp, "a", Tokenizer(folder), Limits(4096, 4096))
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False, "n": 3}}
    over_http = validate_request(parse(ChatCompletionRequest, body).to_input(), "a", Tokenizer(folder),
                                 Limits(4096, 4096))
    assert over_grpc.prompt_token_ids == over_http.prompt_token_ids
    assert input_from_proto(build_request(messages=MESSAGES)).template_kwargs == ()


def test_a_list_or_object_value_over_grpc_is_refused_naming_the_variable(folder):
    from kvserve.common.errors import InvalidRequest
    from kvserve.services.client.types import build_request
    from kvserve.services.gateway.rpc.servicer import input_from_proto

    inp = input_from_proto(build_request(messages=MESSAGES, chat_template_kwargs={"tools": [1, 2]}))
    with pytest.raises(InvalidRequest, match=r"chat_template_kwargs\['tools'\] must be a string") as e:
        validate_request(inp, "a", Tokenizer(folder), Limits(4096, 4096))
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(ValueError, match="chat_template_kwargs go with messages"):
        build_request(prompt="hi", chat_template_kwargs={"enable_thinking": False})
