"""Shared fixtures: the real default model, one in-process runner, a real gRPC worker on port 0."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference model is loaded from disk, never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# As `kvserve kvmanager` does, before grpc is imported: the kvmanager's call-log snapshots fork, and gRPC's
# fork handlers crash such a child (kvserve/kvmanager/snapshot.py). Nothing in kvserve relies on them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import grpc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# The triton backend's kernels run on the CPU in Triton's interpreter where there is no GPU (its tests compare
# them with the reference there); it is read when the kernels are defined, so before any test imports them.
# Never where CUDA is: there they are compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/deploy/image/ runs the stack from the built image (`make image-test`, which sets KVSERVE_IMAGE): not part of the
# default run, which builds no image.
collect_ignore = [] if os.environ.get("KVSERVE_IMAGE") else ["deploy/image"]

TEST_NUM_PAGES = 256
TEST_PAGE_SIZE = 16


@pytest.fixture(scope="session")
def model_dir():
    """The default model, converted from its GGUF once (reused from the cache when `make model` ran)."""
    from kvserve.services.model_store import prepare_default_model

    return prepare_default_model(progress=False)


@pytest.fixture(scope="session")
def runner(model_dir):
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=TEST_NUM_PAGES, page_size=TEST_PAGE_SIZE,
                                    device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def worker_server(runner):
    from kvserve.worker.server import start_worker_server

    ws = start_worker_server(runner, "127.0.0.1", 0)
    yield ws
    ws.stop(1.0)


@pytest.fixture(scope="session")
def worker_channel(worker_server):
    with grpc.insecure_channel(f"127.0.0.1:{worker_server.port}") as channel:
        yield channel


@pytest.fixture(scope="session")
def worker_stub(worker_channel):
    from kvserve.v1 import worker_pb2_grpc

    return worker_pb2_grpc.WorkerServiceStub(worker_channel)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """HF transformers on the same weights, fp32: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """HF transformers generating one prompt (token ids) alone, greedy: the reference token ids."""
    import torch

    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    do_sample=False)
        return out[0, ids.shape[1]:].tolist()
    return generate


@pytest.fixture(scope="session")
def hf_greedy_alone(hf_greedy):
    """hf_greedy over several prompts, on one thread: on two cores shared with the services of the other tests,
    HF's two OpenMP threads spin against them (measured: 17 s for 24 tokens, 2.5 s on one thread)."""
    import torch

    def generate_all(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        num_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [hf_greedy(p, max_tokens) for p in prompts]
        finally:
            torch.set_num_threads(num_threads)
    return generate_all


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from kvserve.common.tokenizer import Tokenizer

    return Tokenizer(model_dir)


# The fast lane (`make test-fast`, `pytest -m "not slow"`) leaves out every test that loads the real model or
# starts kvserve processes: every test under tests/e2e/ (separate processes by definition) and tests/deploy/image/,
# those using a fixture that loads the model, and every test of a module that starts `kvserve` processes or builds a
# model runner. Tests mark themselves only where these rules miss them. An embedded redis-server, as a port on
# 127.0.0.1, is a fixture of the fast lane.
SLOW_FOLDERS = ("e2e", "deploy/image")
MODEL_FIXTURES = {"runner", "worker_server", "worker_channel", "worker_stub", "hf_model", "hf_greedy",
                  "hf_greedy_alone"}
SLOW_MODULE_SOURCES = ("service_process", "kvmanager_process(", "worker_process(", "running_stack", "ModelRunner(",
                       "from_pretrained(", "tier_runners(")
TESTS = os.path.dirname(os.path.abspath(__file__))


def _slow_module(path) -> bool:
    rel = os.path.relpath(str(path), TESTS).replace(os.sep, "/")
    if any(rel.startswith(folder + "/") for folder in SLOW_FOLDERS):
        return True
    text = path.read_text() if path.suffix == ".py" else ""
    return any(s in text for s in SLOW_MODULE_SOURCES)


def pytest_collection_modifyitems(config, items):
    slow_modules: dict[str, bool] = {}
    for item in items:
        if str(item.path) not in slow_modules:
            slow_modules[str(item.path)] = _slow_module(item.path)
        if slow_modules[str(item.path)] or MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
