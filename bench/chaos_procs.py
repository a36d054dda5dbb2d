"""The chaos run's processes: each `kvserve` service a child in its own process group, found by its ready line
(`kvserve ... ready on H:P`), killed with SIGKILL on demand (the fault) and, whatever happens, at the end.

    procs = Processes(log_dir)           every child it ever started is killed by close() (also on failure)
    svc = procs.start("worker-0", argv)  returns once the ready line came; RuntimeError (with the log's tail) if
                                         the process exited first or printed no ready line within the deadline
    svc.kill9()                          SIGKILL to its process group, reaped

Children are started from the main thread only: their parent-death signal (die_with_parent) fires when the
thread that forked them ends, so a child started by a short-lived thread would die with it.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.common.processes import die_with_parent

READY = re.compile(r"kvserve \S+(?: \S+)? ready on (?P<host>[^\s:]+):(?P<port>\d+)")
METRICS = re.compile(r"metrics on (?P<host>[^\s:,)]+):(?P<port>\d+)")
READY_TIMEOUT_S = 240.0  # a worker loads the model; on 2 busy cores that can take a while
STOP_TIMEOUT_S = 15.0


@dataclass
class Service:
    """One running `kvserve` process: its address from the ready line, its stderr in ``log_path``."""

    name: str
    argv: list[str]
    proc: subprocess.Popen
    log_path: Path
    address: str = ""
    ready_line: str = ""
    started_s: float = 0.0  # time.monotonic() at the ready line
    lines: queue.Queue = field(default_factory=queue.Queue)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def metrics_url(self) -> str | None:
        """http://H:P/metrics when the ready line names a metrics port (--metrics-port), else None."""
        m = METRICS.search(self.ready_line)
        return f"http://{m['host']}:{m['port']}/metrics" if m else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL to the whole process group, then reaps the process."""
        _signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL to the group if it is not gone within STOP_TIMEOUT_S."""
        if self.alive():
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own group (process_group=0): the pgid is its pid
    except ProcessLookupError:
        pass  # already gone and reaped


def _pump(service: Service) -> None:
    for line in service.proc.stdout:
        service.lines.put(line)
    service.lines.put(None)  # stdout closed: the process exited


class Processes:
    """Starts `kvserve` services as children; ``close()`` kills every one still running (use as a context
    manager so that it runs on failure too)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started: list[Service] = []
        self._count = 0

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              ready_timeout_s: float = READY_TIMEOUT_S) -> Service:
        """Runs `kvserve ARGV` (``env``: variables on top of this process' environment) and returns once it
        printed its ready line; raises RuntimeError otherwise (the process is killed then)."""
        return self.await_ready(self.spawn(name, argv, env), ready_timeout_s)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        """Runs `kvserve ARGV` without waiting: await_ready() then (several can load their models at once)."""
        assert threading.current_thread() is threading.main_thread(), "start children from the main thread"
        self._count += 1
        log_path = self.log_dir / f"{self._count:02d}-{name}.log"
        with log_path.open("w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "kvserve.services.cli", *argv], stdout=subprocess.PIPE,
                                    stderr=stderr, stdin=subprocess.DEVNULL, text=True,
                                    env={**os.environ, **(env or {})},
                                    process_group=0, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
        service = Service(name, argv, proc, log_path)
        self.started.append(service)
        threading.Thread(target=_pump, args=(service,), daemon=True).start()
        return service

    def await_ready(self, service: Service, ready_timeout_s: float = READY_TIMEOUT_S) -> Service:
        """Waits for ``service``'s ready line and fills in its address; raises RuntimeError (killing it) if it
        exits first or prints none within the deadline."""
        match = self._await_ready(service, ready_timeout_s)
        service.address, service.ready_line = f"{match['host']}:{match['port']}", match.string.strip()
        service.started_s = time.monotonic()
        return service

    def _await_ready(self, service: Service, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = service.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line, why = None, f"no ready line within {timeout_s:.0f} s"
            else:
                why = f"it exited with {service.proc.wait(timeout=STOP_TIMEOUT_S)}" if line is None else ""
            match = READY.search(line or "")
            if match:
                return match
            if line is None:
                service.kill9()
                raise RuntimeError(f"{service.name} did not start ({why}); its log:\n{service.log_tail()}")
            # another stdout line before the ready line: keep waiting for it

    def close(self) -> None:
        for service in self.started:
            if service.alive():
                service.kill9()
            if service.proc.stdout:
                service.proc.stdout.close()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
