"""`kvserve worker --threads N --cpus LIST` as a real process: every thread of the worker runs on the listed CPUs
and its ready line says so; a bad list is a usage error before the model loads."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from service_process import KVSERVE, service_process

READY = re.compile(r"^kvserve worker worker-0 ready on 127\.0\.0\.1:\d+: .*; "
                   r"(?P<binding>\d+ threads? on CPUs [\d,-]+)")
READY_TIMEOUT_S = 60.0  # model load on 2 busy cores, with margin


def cli_env(**overrides: str) -> dict[str, str]:
    """This environment minus stray KVSERVE_* settings (but the model cache), on the CPU, plus overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE_DIR"}
    return env | {"KVSERVE_DEVICE": "cpu"} | overrides


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, env=cli_env(), timeout=60,
                          stdin=subprocess.DEVNULL)


def thread_cpus(pid: int) -> dict[int, str]:
    """Each thread of ``pid`` -> the CPU list it may run on (/proc/<pid>/task/<tid>/status)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        out[int(task.name)] = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M)[1]
    return out


def test_a_worker_with_one_thread_on_cpu_0_runs_every_thread_there(tmp_path) -> None:
    with service_process(["worker", "--port", "0", "--threads", "1", "--cpus", "0"], READY, cli_env(),
                         tmp_path / "worker.stderr", READY_TIMEOUT_S) as (proc, match):
        assert match["binding"] == "1 thread on CPUs 0"
        cpus = thread_cpus(proc.pid)
    assert len(cpus) > 1  # the gRPC server's and the compute thread too, not only the main thread
    assert set(cpus.values()) == {"0"}, cpus


def test_the_env_vars_set_them_too(tmp_path) -> None:
    env = cli_env(KVSERVE_THREADS="1", KVSERVE_CPUS="0")
    with service_process(["worker", "--port", "0"], READY, env, tmp_path / "worker.stderr",
                         READY_TIMEOUT_S) as (proc, match):
        assert match["binding"] == "1 thread on CPUs 0"
        assert set(thread_cpus(proc.pid).values()) == {"0"}


def test_a_bad_cpu_list_is_a_usage_error_naming_it() -> None:
    result = run_cli("worker", "--cpus", "0-2x")
    assert result.returncode == 2
    assert "kvserve worker: error: argument --cpus: bad CPU list '0-2x'" in result.stderr
    result = run_cli("worker", "--cpus", "4096")
    assert result.returncode == 2
    assert "argument --cpus: CPUs 4096 are not among the CPUs this process may use" in result.stderr
