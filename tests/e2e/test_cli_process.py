"""The real `kvserve` console script, run as separate processes: a worker's lifecycle, its flags and env vars.

Each worker process loads the real model (a few seconds on CPU); this file starts three of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_process import EXIT_TIMEOUT_S, KVSERVE, service_process

from kvserve.v1 import worker_pb2, worker_pb2_grpc

BYTES_PER_TOKEN = 46080  # 2 * 30 layers * 3 kv heads * 64 head_dim * 4 bytes (fp32 on CPU)
PAGE_SIZE = 16
READY_TIMEOUT_S = 60.0  # model load on 2 busy cores, with margin
CLI_TIMEOUT_S = 60.0


def cli_env(**overrides: str) -> dict[str, str]:
    """This environment minus stray KVSERVE_* settings (but the model cache), on the CPU, plus overrides.

    KVSERVE_DEVICE=cpu pins fp32 on any machine, so that the byte arithmetic below holds.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE_DIR"}
    env["KVSERVE_DEVICE"] = "cpu"
    return env | overrides


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, env=env or cli_env(),
                          timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def worker_process(tmp_path: Path, *args: str, worker_id: str = "worker-0", env: dict | None = None):
    """Runs `kvserve worker ARGS` and yields (process, port) once it is ready; always kills it afterwards."""
    ready = re.compile(rf"^kvserve worker {re.escape(worker_id)} ready on 127\.0\.0\.1:(\d+): ")
    with service_process(["worker", *args], ready, env or cli_env(), tmp_path / f"{worker_id}.stderr",
                         READY_TIMEOUT_S) as (proc, match):
        yield proc, int(match.group(1))


def info_of(port: int) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)


def step_request() -> worker_pb2.StepBatch:
    item = worker_pb2.StepItem(req_id="r", token_ids=[1, 2, 3], start_pos=0, page_table=[0], sample=True)
    return worker_pb2.StepBatch(items=[item])


def stop_and_expect_clean_exit(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0


def test_worker_serves_over_grpc_then_exits_cleanly_on_sigterm(tmp_path):
    with worker_process(tmp_path, "--port", "0", "--num-pages", "32", "--worker-id", "w-test",
                        worker_id="w-test") as (proc, port):
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
            assert (info.worker_id, info.num_pages, info.page_size) == ("w-test", 32, PAGE_SIZE)
            assert info.pool_bytes == BYTES_PER_TOKEN * PAGE_SIZE * 32
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            step = worker_pb2_grpc.WorkerServiceStub(channel).Step(step_request(), timeout=30)
            assert len(step.results) == 1 and step.results[0].req_id == "r"
            assert 0 <= step.results[0].token_id < info.vocab_size and step.num_tokens == 3

        out = run_cli("info", "--worker", target)
        assert out.returncode == 0, out.stderr
        printed = json.loads(out.stdout)  # proto3 JSON: camelCase names, int64 values as strings
        assert printed["worker_id"] == "w-test" and printed["epoch"] == str(info.epoch)
        assert int(printed["pool_bytes"]) == info.pool_bytes

        stop_and_expect_clean_exit(proc)
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerServiceStub(channel).Step(step_request(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_worker_takes_its_settings_from_env_vars_as_in_the_k8s_manifests(tmp_path):
    env = cli_env(KVSERVE_NUM_PAGES="24", KVSERVE_WORKER_ID="w-env")
    with worker_process(tmp_path, "--port", "0", worker_id="w-env", env=env) as (proc, port):
        info = info_of(port)
        assert (info.worker_id, info.num_pages) == ("w-env", 24)
        assert info.pool_bytes == BYTES_PER_TOKEN * PAGE_SIZE * 24
        stop_and_expect_clean_exit(proc)


def test_kv_cache_bytes_flag_sizes_the_pool_and_beats_an_env_page_count(tmp_path):
    # A manifest sets one pool size in env; a flag on the command line must win, not clash with it.
    env = cli_env(KVSERVE_NUM_PAGES="24")
    with worker_process(tmp_path, "--kv-cache-bytes", "10MiB", "--port", "0", env=env) as (proc, port):
        info = info_of(port)
        assert info.num_pages == 10 * 2**20 // (BYTES_PER_TOKEN * PAGE_SIZE) == 14
        assert info.pool_bytes == BYTES_PER_TOKEN * PAGE_SIZE * 14
        stop_and_expect_clean_exit(proc)


BAD_WORKER_FLAGS = [
    ("byte size not a number", ["--kv-cache-bytes", "lots"], {},
     "argument --kv-cache-bytes: not a byte size: 'lots'"),
    ("zero pages", ["--num-pages", "0"], {}, "argument --num-pages: must be positive, got 0"),
    ("budget below one page", ["--kv-cache-bytes", "1KiB"], {},
     "kvserve: the KV budget holds no page: one page of 16 tokens needs 737280 bytes"),
    ("no such model folder", ["--model", "/nonexistent"], {},
     "kvserve: model folder /nonexistent does not exist"),
    ("bad env page count", [], {"KVSERVE_NUM_PAGES": "many"}, "argument --num-pages: not an integer: 'many'"),
    ("bad env page size", [], {"KVSERVE_PAGE_SIZE": "big"}, "argument --page-size: not an integer: 'big'"),
    ("unknown KV cache dtype", ["--kv-cache-dtype", "fp4"], {},
     "kvserve: unknown KV cache dtype 'fp4'; known: auto, float32, bfloat16, float16, int8, fp8_e4m3, fp8_e5m2"),
    ("unknown KV scales", ["--kv-cache-dtype", "int8", "--kv-scales", "row"], {},
     "kvserve: unknown KV scales 'row'; known: token_head, tensor"),
    ("KV pages the cpu backend cannot read", ["--attention-backend", "cpu", "--kv-cache-dtype", "bfloat16"], {},
     "kvserve: the cpu attention backend is not available: it reads float32, int8, fp8_e4m3, fp8_e5m2 pages, not "
     "bfloat16 (--attention-backend reference serves every KV cache dtype)"),
    ("sinks without a window", ["--attention-sinks", "4"], {},
     "kvserve: --attention-sinks needs --sliding-window (the window kept beside the sinks)"),
    ("a window smaller than a page", ["--sliding-window", "8"], {},
     "kvserve: a sliding window of 8 tokens is smaller than a page (16 tokens)"),
    ("a negative window", ["--sliding-window", "-4"], {}, "argument --sliding-window: must be 0 or more, got -4"),
]


@pytest.mark.parametrize("args,env,message", [c[1:] for c in BAD_WORKER_FLAGS],
                         ids=[c[0] for c in BAD_WORKER_FLAGS])
def test_bad_worker_settings_exit_2_with_a_message_and_serve_nothing(args, env, message):
    out = run_cli("worker", "--port", "0", *args, env=cli_env(**env))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    if message.startswith("kvserve:"):  # checked by kvserve, not argparse (which prints its usage too)
        assert len(out.stderr.strip().splitlines()) == 1  # one clear line
    assert "ready" not in out.stdout


BAD_GENERATE_FLAGS = [
    ("negative temperature", ["--local", "--temperature", "-1"], "temperature must be finite and >= 0"),
    ("zero max tokens", ["--local", "--max-tokens", "0"], "argument --max-tokens: must be positive, got 0"),
    ("zero max tokens from a gateway", ["--max-tokens", "0"], "argument --max-tokens: must be positive, got 0"),
    ("zero timeout", ["--timeout", "0"], "argument --timeout: must be positive, got 0"),
    ("negative seed", ["--seed", "-3", "--gateway", "127.0.0.1:1"], "seed=-3 does not fit"),
    ("unknown KV cache dtype", ["--local", "--kv-cache-dtype", "e4m3"], "kvserve: unknown KV cache dtype 'e4m3'"),
]


@pytest.mark.parametrize("args,message", [c[1:] for c in BAD_GENERATE_FLAGS],
                         ids=[c[0] for c in BAD_GENERATE_FLAGS])
def test_bad_generate_flags_exit_2_with_a_message(args, message):
    out = run_cli("generate", "--prompt", "hi", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout.strip() == ""


def test_up_with_a_missing_api_keys_file_exits_2_before_starting_anything(tmp_path):
    out = run_cli("up", "--data-dir", str(tmp_path / "data"), "--api-keys-file", str(tmp_path / "nope.json"))
    assert out.returncode == 2 and f"--api-keys-file {tmp_path / 'nope.json'}" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "data").exists()  # no kvmanager ever ran


def test_up_with_an_unknown_kv_cache_dtype_exits_2_before_starting_anything(tmp_path):
    out = run_cli("up", "--data-dir", str(tmp_path / "data"), "--kv-cache-dtype", "fp6")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("kvserve: unknown KV cache dtype 'fp6'; known: auto, float32, bfloat16, float16, "
                                  "int8, fp8_e4m3, fp8_e5m2")
    assert not (tmp_path / "data").exists()  # no kvmanager ever ran


def test_up_with_sinks_but_no_window_exits_2_before_starting_anything(tmp_path):
    out = run_cli("up", "--data-dir", str(tmp_path / "data"), "--attention-sinks", "4")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "kvserve: --attention-sinks needs --sliding-window (the window kept beside the sinks)"
    assert not (tmp_path / "data").exists()  # no kvmanager ever ran


def test_generate_without_a_gateway_says_which_address_it_tried_and_exits_1():
    out = run_cli("generate", "--prompt", "hi", "--gateway", "127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 1, out.stderr
    assert "gateway 127.0.0.1:1" in out.stderr and "Traceback" not in out.stderr


def test_model_prepare_prints_the_prepared_folder(model_dir):
    out = run_cli("model", "prepare")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == Path(model_dir)
    assert (Path(model_dir) / "config.json").is_file()


def test_up_with_a_negative_long_prefill_threshold_exits_2_before_starting_anything(tmp_path):
    out = run_cli("up", "--data-dir", str(tmp_path / "data"), "--long-prefill-token-threshold", "-1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --long-prefill-token-threshold: must be 0 or more, got -1" in out.stderr
    assert not (tmp_path / "data").exists()  # no kvmanager ever ran


def test_the_long_prefill_threshold_reaches_the_gateways_config(model_dir):
    from kvserve.services.cli import build_parser
    from kvserve.services.cli_gateway import gateway_config

    args = build_parser().parse_args(["gateway", "--model", str(model_dir), "--long-prefill-token-threshold", "64"])
    assert gateway_config(args).long_prefill_token_threshold == 64
    default = build_parser().parse_args(["gateway", "--model", str(model_dir)])
    assert gateway_config(default).long_prefill_token_threshold == 0  # off unless asked for, as in vLLM
