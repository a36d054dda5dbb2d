"""Malformed and extreme requests at both front-ends of a real `kvserve up` (issue 35): one body of each kind of
failure found so far, then a short hypothesis run per front-end (tests/support/fuzz_bodies.py), one request at a time.
Every answer a 2xx or a client error in the API's shape, never a 5xx or a hang; afterwards no page used, no
request live, no worker lost or declared dead. The long run is bench/fuzz_frontends.py (`make fuzz`).

Shrinking is off: an answer can depend on what earlier bodies did to the stack, so the first failing body is the
one to report, not a smaller one sent to a stack in another state.
"""

from __future__ import annotations

import json

import fuzz_bodies as fb
import grpc
import httpx
import pytest
from gateway_stack import running_stack
from hypothesis import HealthCheck, Phase, example, given, settings
from polling import wait_for
from test_cli_process import cli_env

from kvserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.slow

FUZZ = settings(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate], database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                       HealthCheck.large_base_example])
FREED_TIMEOUT_S = 30.0
SAY_HI = [{"role": "user", "content": "Say hi"}]


def chat(**fields) -> fb.HttpCase:
    return fb.HttpCase("/chat/completions", fb.dumps({"messages": SAY_HI, "max_tokens": 4, **fields}).encode())


def completion(**fields) -> fb.HttpCase:
    return fb.HttpCase("/completions", fb.dumps({"prompt": "Say hi", "max_tokens": 4, **fields}).encode())


# One body of each kind the fuzzer found (issue 35), sent first in every run: finite in float64 but inf or 0 in
# float32, past int32/uint64 where the worker's protobuf holds it, a lone surrogate, nesting past Python's stack.
FOUND = {"temperature 1e308": chat(temperature=1e308), "top_p 1e-50": chat(top_p=1e-50),
         "top_k 2**31": completion(top_k=2**31), "seed 2**64": completion(seed=2**64),
         "prompt lone surrogate": completion(prompt="\ud800"),
         "content lone surrogate": chat(messages=[{"role": "user", "content": "\ud800"}]),
         "nesting 100000 deep": fb.HttpCase("/completions", b"[" * 100000)}
# float32 subnormals and the largest int32 and uint64: valid, to be served
GRPC_EXTREMES = fb.GrpcCase("Complete", gateway_pb2.GenerateRequest(prompt="Say hi", max_tokens=4, sampling=(
    common_pb2.SamplingParams(temperature=1e-45, top_p=1e-45, top_k=2**31 - 1, seed=2**64 - 1))))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("fuzz-stack")
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps(fb.KEYS))
    with running_stack(tmp, cli_env(), "--api-keys-file", str(keys_file), *fb.STACK_FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def epochs(stack):
    """The workers' epochs before any fuzzing: a worker declared dead or restarted rejoins under another."""
    return fb.worker_epochs(stack.kvmanager)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(timeout=fb.CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(stack):
    with grpc.insecure_channel(stack.gateway) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def assert_nothing_held_or_lost(stack, epochs: dict[str, int]) -> None:
    wait_for(lambda: not stack.used_pages() and not stack.live_requests(), "every page free and no request live",
             FREED_TIMEOUT_S)
    trouble = fb.trouble_lines(stack.log())
    assert not trouble, "\n".join(trouble[:20])
    assert fb.worker_epochs(stack.kvmanager) == epochs


@pytest.mark.parametrize("case", FOUND.values(), ids=FOUND.keys())
def test_bodies_found_before_get_a_2xx_or_a_4xx_error(stack, http, epochs, case):
    answer = fb.send_http(http, stack.http, case)
    assert not answer.problems, f"{case.path} {case.body[:200]!r} -> {answer.outcome}: {answer.problems}"


@settings(FUZZ, max_examples=400)
@given(case=fb.http_cases())
def test_http_bodies_get_a_2xx_or_a_4xx_error(stack, http, epochs, case):
    answer = fb.send_http(http, stack.http, case)
    assert not answer.problems, f"{case.path} {case.body[:2000]!r} -> {answer.outcome}: {answer.problems}"


def test_http_fuzzing_held_and_lost_nothing(stack, epochs):
    assert_nothing_held_or_lost(stack, epochs)


@settings(FUZZ, max_examples=200)
@given(case=fb.grpc_cases())
@example(case=GRPC_EXTREMES)
def test_grpc_requests_get_ok_or_a_client_error(gateway, epochs, case):
    answer = fb.send_grpc(gateway, case)
    assert not answer.problems, f"{case.method} {case.request} -> {answer.outcome}: {answer.problems}"


def test_grpc_fuzzing_held_and_lost_nothing(stack, epochs):
    assert_nothing_held_or_lost(stack, epochs)
