"""The OpenAI-compatible HTTP API of a real `kvserve up` process tree, driven by the official `openai` package
(and httpx for what that client will not send), checked against HF transformers and the admin RPCs."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from gateway_stack import running_stack
from test_cli_process import cli_env

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(temperature=0)  # OpenAI's default temperature is 1: the tests ask for greedy
LONG = "The night train from Paris to Vienna leaves at eight and stops in Munich and Salzburg. " * 12
FREED_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("http-stack")
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    with running_stack(tmp, cli_env(), "--api-keys-file", str(keys_file), "--num-pages", "256",
                       "--max-num-batched-tokens", "128") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http, api_key="key-a", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def no_pages_left(stack) -> bool:
    """Whether every page is free and no request is live, waiting up to FREED_TIMEOUT_S for the engine's step
    that frees them (a disconnect is seen by the server asynchronously)."""
    deadline = time.monotonic() + FREED_TIMEOUT_S
    while stack.used_pages() or stack.live_requests():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(stack.http.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_completion_is_token_identical_to_hf(client, tokenizer, hf_greedy):
    prompt = "The three largest cities of France are"
    expected = hf_greedy(tokenizer.encode(prompt), 24)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    assert reply.choices[0].text == tokenizer.decode(expected)
    assert reply.usage.completion_tokens == len(expected) == 24
    assert reply.choices[0].finish_reason == "length"
    by_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), max_tokens=24, **GREEDY)
    assert by_ids.choices[0].text == reply.choices[0].text  # token ids as the prompt: the same completion


def test_completion_logprobs_name_the_generated_tokens(client, tokenizer, hf_greedy):
    prompt = "One, two, three,"
    expected = hf_greedy(tokenizer.encode(prompt), 5)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, **GREEDY)
    lp = reply.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in expected]
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(top) == 2 for top in lp.top_logprobs)
    assert all(max(top.values()) == pytest.approx(v, abs=1e-5) for top, v in zip(lp.top_logprobs, lp.token_logprobs,
                                                                                   strict=True))  # greedy: the best


def chat_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": question}]


def test_chat_is_token_identical_to_hf_and_streams_the_same(client, hf_tokenizer, tokenizer, hf_greedy):
    messages = chat_messages("What is the capital of Italy?")
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = hf_tokenizer.encode(text, add_special_tokens=False)
    expected = hf_greedy(prompt_ids, 20)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, **GREEDY)
    text = whole.choices[0].message.content
    assert text == tokenizer.decode(expected)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == len(expected)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_stop_strings_are_cut_and_never_streamed(client):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7,"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[" 10"], **GREEDY)
    assert whole.choices[0].finish_reason == "stop" and " 10" not in whole.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, stop=[" 10"], stream=True, **GREEDY))
    assert streamed == whole.choices[0].text


def test_repeated_long_prompt_hits_the_cache_of_its_own_tenant_only(stack, client):
    first = client.completions.create(model=MODEL, prompt=LONG + "First:", max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=LONG + "Second:", max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 160  # LONG's full pages
    with openai.OpenAI(base_url=stack.http, api_key="key-b", max_retries=0, timeout=120) as other:
        theirs = other.completions.create(model=MODEL, prompt=LONG + "Second:", max_tokens=2, **GREEDY)
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's namespace


def test_eight_concurrent_async_streams_are_all_exact(stack, tokenizer, hf_greedy):
    prompts = [f"Question {i}: name a famous {topic}." for i, topic in enumerate(
        ["bridge", "river", "painter", "train", "mountain", "city", "composer", "island"])]
    lengths = [6 + 3 * i for i in range(8)]

    async def stream(client, prompt, n):
        chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
        parts, usage = [], None
        async for c in chunks:
            parts.extend(ch.text for ch in c.choices)
            usage = c.usage or usage
        return "".join(parts), usage

    async def all_streams():
        async with openai.AsyncOpenAI(base_url=stack.http, api_key="key-a", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(stream(c, p, n) for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(all_streams())
    for prompt, n, (text, usage) in zip(prompts, lengths, results, strict=True):
        expected = hf_greedy(tokenizer.encode(prompt), n)
        assert text == tokenizer.decode(expected), prompt
        assert usage.completion_tokens == len(expected)
    assert no_pages_left(stack)


BAD = [  # (path, body, status, what the message says); each body otherwise valid
    ("/completions", {"prompt": "hi", "n": 2}, 400, "n must be 1"),
    ("/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/completions", {"prompt": 7}, 400, "prompt must be a string or a list of token ids"),
    ("/completions", {"prompt": [1, 2, 10**9]}, 400, "is not a token id of this model"),
    ("/completions", {"prompt": ""}, 400, "empty prompt"),
    ("/completions", {"prompt": "word " * 9000}, 400, "prompt has"),
    ("/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "above this gateway's limit"),
    ("/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
                           "temperature": 1e308}, 400, "temperature must be finite and >= 0 as a float32"),
    ("/completions", {"prompt": "hi", "top_p": 1e-50}, 400, "top_p must lie in (0, 1] as a float32"),
    ("/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed must lie in [0, 2**64)"),
    ("/completions", {"prompt": "hi", "top_k": 2**40}, 400, "top_k must be >= 0"),
    ("/completions", {"prompt": "hi", "stop": ["x"] * 9}, 400, "at most 8 stop strings"),
    ("/completions", {"prompt": "hi", "echo": True}, 400, "echo is not supported"),
    ("/chat/completions", {"messages": []}, 400, "empty messages"),
    ("/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4o"}, 404, "gpt-4o"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD, ids=[f"{s}-{m[:24]}" for _, _, s, m in BAD])
def test_bad_input_gets_its_status_and_openai_error_shape(stack, path, body, status, message):
    reply = httpx.post(stack.http + path, json=body, headers={"authorization": "Bearer key-a"}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]
    assert no_pages_left(stack)


def test_keys_body_size_and_invalid_json(stack):
    url = stack.http + "/completions"
    body = {"prompt": "hi", "max_tokens": 1}
    missing = httpx.post(url, json=body, timeout=60)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(url, json=body, headers={"authorization": "Bearer nope"}, timeout=60).status_code == 401
    assert httpx.get(stack.http + "/models", timeout=60).status_code == 401
    big = httpx.post(url, content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}',
                     headers={"authorization": "Bearer key-a"}, timeout=60)
    assert big.status_code == 413 and "bytes" in big.json()["error"]["message"]
    bad_json = httpx.post(url, content=b"{not json", headers={"authorization": "Bearer key-a"}, timeout=60)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    for method, path, status in (("GET", "/nowhere", 404), ("GET", "/completions", 405)):
        reply = httpx.request(method, stack.http + path, headers={"authorization": "Bearer key-a"}, timeout=60)
        assert reply.status_code == status and path in reply.json()["error"]["message"]
    deep = httpx.post(url, content=b"[" * 100000, headers={"authorization": "Bearer key-a"}, timeout=60)
    assert deep.status_code == 400 and "too deeply" in deep.json()["error"]["message"]
    surrogate = httpx.post(url, content=b'{"prompt": "hi \\ud800"}', headers={"authorization": "Bearer key-a"},
                           timeout=60)  # valid JSON, not valid Unicode: no tokenizer can encode it
    assert surrogate.status_code == 400 and "lone UTF-16 surrogate" in surrogate.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):  # the official client's own view of the 401
        with openai.OpenAI(base_url=stack.http, api_key="nope", max_retries=0) as c:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert no_pages_left(stack)


def test_a_disconnect_mid_stream_frees_the_pages(stack):
    body = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", stack.http + "/completions", json=body, headers={"authorization": "Bearer key-a"},
                      timeout=60) as reply:
        events = 0
        for line in reply.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break
        assert stack.used_pages() > 0  # it is running
    # the connection is closed here, with 390-odd tokens still to go
    assert no_pages_left(stack)


def test_a_disconnect_while_queued_or_prefilling_frees_the_pages(stack):
    """No delta has flowed yet: the server sees the closed connection itself."""
    body = {"prompt": LONG * 4, "max_tokens": 200, "ignore_eos": True, "stream": False, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.http + "/completions", json=body, headers={"authorization": "Bearer key-a"}, timeout=1.0)
    assert no_pages_left(stack)


@pytest.fixture(scope="module")
def busy_stack(tmp_path_factory, model_dir):
    """One request runs at a time and one more may wait: a third is refused with 429."""
    with running_stack(tmp_path_factory.mktemp("busy-stack"), cli_env(), "--num-pages", "256", "--max-num-seqs", "1",
                       "--max-queued-requests", "1") as s:
        yield s


def test_a_full_queue_is_429_through_kvserve_up(busy_stack):
    url = busy_stack.http + "/completions"
    body = {"prompt": "Count to one thousand:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the response, which cancels it
        next(lines)  # the running request's first event: it holds the only seat
        with http.stream("POST", url, json=body) as queued:  # admitted (its headers came back): it waits
            assert queued.status_code == 200
            refused = httpx.post(url, json={"prompt": "hi", "max_tokens": 1}, timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "--max-queued-requests" in refused.json()["error"]["message"]
    assert no_pages_left(busy_stack)
