"""Prefill/decode disaggregation with real processes: a kvmanager, a prefill worker, a decode worker and a
gateway (tests/support/kv_tier_stack.py's, each under the test's control). Greedy tokens through disaggregated
serving equal HF transformers' (prompts of several lengths, chunked prefill, prefix hits, both CPU attention
backends); and with a worker killed around a transfer (the source mid-pull, the receiver mid-pull, the prefill
worker after its prefill and before the pull reads a byte) no request is lost or wrong and no page stays held.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal

import pytest
from kv_tier_stack import GATEWAY_READY, READY_TIMEOUT_S, TierStack, tier_stack
from polling import wait_for
from service_process import service_process

PAGE_SIZE = 16
MAX_TOKENS = 12
WAIT_S = 60.0
TEXT = ("The glacier above the village had retreated a little every summer since the records began, and the "
        "guides kept a notebook of its edge, measured with a chain from the same painted rock. ")


def start_split(stack: TierStack, backend: str = "cpu", worker_timeout: str = "2", max_local_prefill: int = 16,
                budget: int = 64) -> None:
    """prefill-0 and decode-0 (the tier stack's worker-0 is not started) and a gateway that sends prompts with
    more than ``max_local_prefill`` uncached tokens to prefill-0, in chunks of ``budget`` tokens."""
    backend_flag = ("--attention-backend", backend)
    stack.start_worker("prefill-0", "--role", "prefill", *backend_flag)
    stack.start_worker("decode-0", "--role", "decode", *backend_flag)
    args = ["gateway", "--port", "0", "--http-port", "0", "--kvmanager", stack.kvmanager, "--worker-timeout",
            worker_timeout, "--max-local-prefill", str(max_local_prefill), "--max-num-batched-tokens", str(budget),
            "--api-keys-file", str(_keys(stack))]
    _, m = stack._exits.enter_context(service_process(args, GATEWAY_READY, stack.env, stack.gateway_log_path,
                                                      READY_TIMEOUT_S))
    stack.gateway = f"127.0.0.1:{m.group(1)}"
    for worker_id, (_, port) in stack.workers.items():
        stack.gateway_serves(worker_id, port)


def _keys(stack: TierStack):
    path = stack.tmp / "keys.json"
    path.write_text('{"key-a": "a"}')
    return path


def transfers(stack: TierStack):
    return stack.stats().transfers


def settled(stack: TierStack) -> bool:
    """Every page of every live pool back (no request, no page held, no pull's hold)."""
    return stack.idle() and transfers(stack).num_holds == 0


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 12)
    # one page and a token, three pages exactly, longer ones; the last shares the third's first 90 tokens
    return [ids[0:17], ids[5:53], ids[10:100], ids[20:170], ids[10:100] + ids[300:340]]


@pytest.fixture(scope="module")
def hf_tokens(prompts, hf_greedy_alone) -> list[list[int]]:
    return hf_greedy_alone(prompts, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_greedy_tokens_through_disaggregated_serving_equal_hf(tmp_path, prompts, hf_tokens, backend):
    """Each prompt over 16 tokens prefills on prefill-0 in 64-token chunks, then decode-0 pulls its pages and
    decodes; the last prompt hits the third's pages on prefill-0. Then every prompt again: hits on decode-0's
    pool (the pulled pages were committed there), decoded there. HF's tokens every time."""
    with tier_stack(tmp_path, tenants=("a",), start_worker=False, start_gateway=False, num_pages=64) as stack:
        start_split(stack, backend)
        for round_ in range(2):
            got = [list(stack.complete("a", p, MAX_TOKENS).token_ids) for p in prompts]
            assert got == hf_tokens, f"round {round_}"
        t = transfers(stack)
        long_ones = sum(1 for p in prompts if len(p) > 16)
        assert t.num_moved >= long_ones and t.num_ok >= long_ones and t.num_failed == 0
        assert t.num_bytes > 0
        wait_for(lambda: settled(stack), "every page back", WAIT_S)


def long_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 40)
    return [ids[7 * i: 7 * i + length] for i in range(n)]


@pytest.fixture(scope="module")
def fault_prompts(tokenizer) -> list[list[int]]:
    return long_prompts(tokenizer, 3, 700)


@pytest.fixture(scope="module")
def fault_tokens(fault_prompts, hf_greedy_alone) -> list[list[int]]:
    return hf_greedy_alone(fault_prompts, 8)


def run_all(stack: TierStack, prompts: list[list[int]], max_tokens: int = 8) -> list[cf.Future]:
    pool = cf.ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(stack.complete, "a", p, max_tokens) for p in prompts]
    pool.shutdown(wait=False)
    return futures


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_a_worker_killed_while_pages_are_pulled_loses_nothing(tmp_path, fault_prompts, fault_tokens, victim):
    """Three 700-token prompts; once the first pull is ordered, the source (prefill-0) or the receiver
    (decode-0) is SIGKILLed. The prompts still prefilling or being pulled are recomputed on the survivor (a
    prefill worker decodes when no decode worker is left): every request answers HF's tokens, and every page of
    the surviving pool comes back."""
    with tier_stack(tmp_path, tenants=("a",), start_worker=False, start_gateway=False, num_pages=256) as stack:
        start_split(stack)
        futures = run_all(stack, fault_prompts)
        wait_for(lambda: transfers(stack).num_pulls >= 1, "a pull ordered", WAIT_S)
        stack.kill(stack.workers[victim][0])
        assert [list(f.result(timeout=300).token_ids) for f in futures] == fault_tokens
        # the kill hit requests in flight there: handed over to the survivor (and a pull, if one was reading)
        assert f"engine {victim}: worker gone, handing" in stack.gateway_log_path.read_text()
        wait_for(lambda: victim not in {p.worker_id for p in stack.stats().pools}, f"{victim}'s pool dropped",
                 WAIT_S)
        wait_for(lambda: settled(stack), "every page of the survivor back", WAIT_S)


def test_the_prefill_worker_killed_between_its_prefill_and_the_pull(tmp_path, fault_prompts, fault_tokens):
    """decode-0 is stopped (SIGSTOP) before the request comes: the prefill runs on prefill-0, the request moves to
    decode-0 and its pull is ordered, but decode-0 cannot read; prefill-0 is then killed, and decode-0 resumed.
    Its pull finds no source: it fails, and decode-0 recomputes the prompt. HF's tokens; every page back (a long
    worker timeout keeps decode-0 a member while it is stopped)."""
    with tier_stack(tmp_path, tenants=("a",), start_worker=False, start_gateway=False, num_pages=256,
                    worker_timeout="60") as stack:
        start_split(stack, worker_timeout="60")
        decode = stack.workers["decode-0"][0]
        decode.send_signal(signal.SIGSTOP)
        try:
            (future,) = run_all(stack, fault_prompts[:1])
            wait_for(lambda: transfers(stack).num_pulls >= 1, "the pull ordered", WAIT_S)
            stack.kill(stack.workers["prefill-0"][0])
        finally:
            decode.send_signal(signal.SIGCONT)
        assert list(future.result(timeout=300).token_ids) == fault_tokens[0]
        t = transfers(stack)
        assert t.num_failed == 1 and t.num_ok == 0
        wait_for(lambda: settled(stack), "every page back", WAIT_S)
