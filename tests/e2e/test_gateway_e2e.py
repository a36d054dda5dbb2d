"""The whole stack as separate processes (`kvserve up`: embedded Redis, kvmanager, worker, gateway) with the
real default model, driven through the client SDK, checked against HF transformers and the admin RPCs."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import grpc
import pytest
from gateway_stack import running_stack
from service_process import EXIT_TIMEOUT_S
from test_cli_process import cli_env, run_cli

from kvserve.services.client import Client, InvalidArgument, ResourceExhausted, Unauthenticated

PAGE_SIZE = 16
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
SYSTEM = ("You are a careful assistant for a railway company. Answer questions about timetables, tickets, "
          "refunds, bicycles on trains, seat reservations and accessibility. ") * 6
TOPICS = ["the weather", "a train to Lyon", "bicycles", "a refund", "night trains", "seat reservations",
          "dogs on board", "student tickets"]


def prompts_mixed() -> list[tuple[str, int]]:
    """16 (prompt, max_tokens): short and long prompts; half share SYSTEM (prefix-cache hits)."""
    out = []
    for i in range(16):
        topic = TOPICS[i % len(TOPICS)]
        prompt = (SYSTEM if i % 2 == 0 else "") + f"Question {i}: tell me about {topic}." + " Please." * (i % 5)
        out.append((prompt, 4 + (i * 5) % 21))
    return out


@pytest.fixture(scope="module")
def hf_reference(hf_greedy, tokenizer):
    """HF transformers generating each prompt (text) alone, greedy: the reference token ids."""
    return lambda prompt, max_tokens: hf_greedy(tokenizer.encode(prompt), max_tokens)


@pytest.fixture(scope="module")
def keys_stack(tmp_path_factory, model_dir):
    """A stack with API keys (two tenants), a roomy pool and a small token budget (chunked prefill)."""
    tmp = tmp_path_factory.mktemp("keys-stack")
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    with running_stack(tmp, cli_env(), "--api-keys-file", str(keys_file), "--num-pages", "256",
                       "--max-num-batched-tokens", "64") as stack:
        with Client(stack.gateway, api_key="key-a", timeout_s=120) as c:
            c.complete(prompt="warm up", max_tokens=2)
        yield stack


def complete_all(address: str, api_key: str | None, jobs: list[tuple[str, int]]):
    with Client(address, api_key=api_key, timeout_s=300) as client, cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(client.complete, prompt=p, max_tokens=n) for p, n in jobs]
        return [f.result() for f in futures]


def test_16_concurrent_requests_match_hf_token_for_token(keys_stack, hf_reference):
    jobs = prompts_mixed()
    with Client(keys_stack.gateway, api_key="key-a", timeout_s=120) as c:  # puts SYSTEM's pages in the cache
        c.complete(prompt=SYSTEM + "Hello.", max_tokens=1)
    results = complete_all(keys_stack.gateway, "key-a", jobs)
    for (prompt, n), got in zip(jobs, results, strict=True):
        assert list(got.token_ids) == hf_reference(prompt, n), prompt[-60:]
    assert any(r.usage.cached_tokens > 0 for r in results)  # prefix hits happened, and changed nothing
    assert keys_stack.used_pages() == 0 and keys_stack.live_requests() == 0


def first_token_s(address: str, api_key: str | None, prompt: str):
    """(seconds to the first generated token, the finished stream's usage)."""
    with Client(address, api_key=api_key, timeout_s=120) as client:
        t0 = time.perf_counter()
        ttft, usage = None, None
        for delta in client.generate(prompt=prompt, max_tokens=2):
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - t0
            usage = delta.usage or usage
    return ttft, usage


LONG_PROMPT = SYSTEM * 2 + "Which trains go to Lyon on Sunday?"


def test_repeated_long_prompt_hits_the_cache_and_first_token_comes_sooner(keys_stack, tokenizer):
    num_tokens = len(tokenizer.encode(LONG_PROMPT))
    ttft_1, usage_1 = first_token_s(keys_stack.gateway, "key-b", LONG_PROMPT)
    ttft_2, usage_2 = first_token_s(keys_stack.gateway, "key-b", LONG_PROMPT)
    assert usage_1.cached_tokens == 0 and usage_1.prompt_tokens == num_tokens
    assert usage_2.cached_tokens == (num_tokens - 1) // PAGE_SIZE * PAGE_SIZE  # every full page of the prompt
    # The hit leaves 16 tokens to prefill in one step instead of 368 in six. How much sooner is for the report's
    # prefix-cache benchmark to measure; a test asserts the order, which holds even when another process takes a
    # core mid-test (seen then: 0.39 s vs 0.21 s, where the earlier "under half" failed).
    assert ttft_2 < ttft_1, (ttft_1, ttft_2)


def test_another_tenant_never_hits_a_tenants_cache(keys_stack):
    prompt = "Confidential memo of tenant A. " * 12 + "What does the memo say?"
    first = complete_all(keys_stack.gateway, "key-a", [(prompt, 2)])[0]
    again = complete_all(keys_stack.gateway, "key-a", [(prompt, 2)])[0]
    other = complete_all(keys_stack.gateway, "key-b", [(prompt, 2)])[0]
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens > 0
    assert other.usage.cached_tokens == 0
    assert list(other.token_ids) == list(again.token_ids)


def test_admin_probes_text_on_the_stack_kvserve_up_starts(keys_stack, tokenizer):
    """`kvserve up` gives the kvmanager the workers' model, so `kvserve admin probe --text` tokenises as the
    gateway does and finds what a request cached."""
    prompt = "A short note about probing the prefix cache by text. " * 6 + "End of note."
    done = complete_all(keys_stack.gateway, "key-b", [(prompt, 2)])[0]
    num_tokens = len(tokenizer.encode(prompt))
    out = run_cli("admin", "probe", "tenant-b", "--text", prompt, "--json", "--kvmanager", keys_stack.kvmanager,
                  "--data-dir", str(keys_stack.data_dir))
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout)
    assert done.usage.prompt_tokens == num_tokens == probe["num_query_tokens"]
    assert probe["num_cached_tokens"] == (num_tokens - 1) // PAGE_SIZE * PAGE_SIZE > 0
    hint = keys_stack.ready_line.split("kvserve admin ", 1)[1].rstrip(")\n").split()  # the ready line's command
    assert hint == ["stats", "--kvmanager", keys_stack.kvmanager, "--data-dir", str(keys_stack.data_dir)]
    assert run_cli("admin", *hint).returncode == 0
    out = run_cli("admin", "stats", "--kvmanager", keys_stack.kvmanager)  # the default data dir's token (none)
    assert out.returncode == 1 and "pass that --data-dir, or --admin-token" in out.stderr


def test_cancelling_a_stream_frees_its_pages(keys_stack):
    with Client(keys_stack.gateway, api_key="key-a", timeout_s=120) as client:
        stream = client.generate(prompt="Count to one thousand:", max_tokens=400, ignore_eos=True)
        seen = 0
        for delta in stream:
            seen += len(delta.token_ids)
            if seen >= 3:
                break
        assert keys_stack.used_pages() > 0  # it is running
        stream.cancel()
        # A later request's last delta comes after its own pages are freed, in a step after the cancel's.
        client.complete(prompt="Hi", max_tokens=1)
    assert keys_stack.used_pages() == 0 and keys_stack.live_requests() == 0


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(prompt=""), InvalidArgument, "empty prompt"),
    (dict(prompt="word " * 9000), InvalidArgument, "prompt has"),
    (dict(prompt="hi", max_tokens=-1), InvalidArgument, "max_tokens must be >= 0"),
    (dict(prompt="hi", max_tokens=100000), InvalidArgument, "above this gateway's limit"),
    (dict(prompt="hi", temperature=-0.5), InvalidArgument, "temperature"),
    (dict(prompt="hi", top_p=0.0), InvalidArgument, "top_p"),
    (dict(prompt="hi", top_p=1.5), InvalidArgument, "top_p"),
    (dict(prompt="x" * (2 << 20)), ResourceExhausted, ""),
])
def test_bad_input_gets_a_clear_status_and_leaves_no_pages(keys_stack, kwargs, error, message):
    with Client(keys_stack.gateway, api_key="key-a", timeout_s=60) as client, pytest.raises(error) as info:
        client.complete(**kwargs)
    assert message in info.value.details
    assert keys_stack.used_pages() == 0 and keys_stack.live_requests() == 0


def test_a_request_that_is_not_a_valid_message_is_invalid_argument(keys_stack):
    """A prompt that is not UTF-8 (string field 1 of GenerateRequest holding the bytes ff fe) fails to parse:
    INVALID_ARGUMENT saying so, not grpc's INTERNAL "Exception deserializing request!"."""
    with grpc.insecure_channel(keys_stack.gateway) as channel:
        generate = channel.unary_stream("/kvserve.v1.GatewayService/Generate")
        with pytest.raises(grpc.RpcError) as info:
            list(generate(b"\x0a\x02\xff\xfe", metadata=(("authorization", "Bearer key-a"),), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "String field had bad UTF-8" in info.value.details()
    assert keys_stack.used_pages() == 0 and keys_stack.live_requests() == 0


@pytest.mark.parametrize("api_key", [None, "not-a-key"])
def test_missing_or_unknown_api_key_is_unauthenticated(keys_stack, api_key):
    with Client(keys_stack.gateway, api_key=api_key, timeout_s=30) as client, pytest.raises(Unauthenticated):
        client.complete(prompt="hi", max_tokens=1)


def test_a_pool_too_small_for_the_burst_preempts_and_outputs_stay_identical(tmp_path, hf_reference):
    jobs = [(f"Story {i}: once upon a time in the city of {TOPICS[i]}, there lived", 40) for i in range(6)]
    with running_stack(tmp_path, cli_env(), "--num-pages", "12", "--max-num-batched-tokens", "128") as stack:
        baseline = stack.admin_stats().pools[0]
        results = complete_all(stack.gateway, None, jobs)
        for (prompt, n), got in zip(jobs, results, strict=True):
            assert list(got.token_ids) == hf_reference(prompt, n)
        assert "preempted" in stack.log()
        after = stack.admin_stats().pools[0]
        assert after.num_used_pages == baseline.num_used_pages == 0 and after.num_requests == 0
        assert after.num_free_pages + after.num_cached_pages == after.num_pages


def test_no_prefix_caching_dev_mode_cli_and_graceful_stop(tmp_path, tokenizer):
    with running_stack(tmp_path, cli_env(), "--no-prefix-caching") as stack:
        assert "dev mode: no API key needed" in stack.ready_line and "prefix caching off" in stack.ready_line
        first_token_s(stack.gateway, None, "warm up")
        _, usage_1 = first_token_s(stack.gateway, None, LONG_PROMPT)
        _, usage_2 = first_token_s(stack.gateway, None, LONG_PROMPT)
        assert usage_1.cached_tokens == usage_2.cached_tokens == 0  # the repeat computes its whole prompt again
        out = run_cli("generate", "--gateway", stack.gateway, "--prompt", "The capital of France is",
                      "--max-tokens", "4")
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        stats = run_cli("admin", "stats", "--json", "--kvmanager", stack.kvmanager, "--data-dir",
                        str(stack.data_dir))
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["pools"][0]["num_used_pages"] == 0
        os.kill(stack.proc.pid, signal.SIGTERM)
        assert stack.proc.wait(timeout=EXIT_TIMEOUT_S * 2) == 0
        log = stack.log()
        assert "gateway stopping" in log or "engine worker-0 stopped" in log
        assert "kvmanager stopping" in log


def test_two_workers_share_the_load_and_requests_follow_their_cached_prefix(tmp_path):
    prompts = [f"Document {i}. " + f"All about {TOPICS[i]}, in detail. " * 20 for i in range(4)]
    with running_stack(tmp_path, cli_env(), "--workers", "2", "--num-pages", "128") as stack:
        complete_all(stack.gateway, None, [(p, 2) for p in prompts])
        pools = stack.admin_stats().pools
        assert [p.worker_id for p in pools] == ["worker-0", "worker-1"]
        assert all(p.num_cached_pages > 0 for p in pools)  # concurrent requests spread over both workers
        again = complete_all(stack.gateway, None, [(p, 2) for p in prompts])
        assert all(r.usage.cached_tokens == (r.usage.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE for r in again)
