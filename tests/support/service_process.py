"""Runs a `kvserve` service as a real process for the end-to-end tests: waits for its one ready line (no sleeps),
and always kills it afterwards."""

from __future__ import annotations

import contextlib
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXIT_TIMEOUT_S = 15.0  # a graceful stop waits at most 5 s for in-flight calls


def _kvserve_path() -> str:
    beside = Path(sys.executable).with_name("kvserve")  # the venv running these tests
    found = str(beside) if beside.is_file() else shutil.which("kvserve")
    assert found, "the kvserve console script is not installed (pip install -e .)"
    return found


KVSERVE = _kvserve_path()


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # end of stdout: the process exited (or closed it)


def _await_ready(proc, ready: re.Pattern, lines: queue.Queue, stderr_path: Path, timeout_s: float) -> re.Match:
    """The service's first stdout line, which must match ``ready``. Fails on exit, another line or deadline."""
    deadline = time.monotonic() + timeout_s
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        pytest.fail(f"no ready line within {timeout_s:.0f} s\nstderr: {stderr_path.read_text()}")
    if line is None:
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        pytest.fail(f"the service exited with {rc} before its ready line\nstderr: {stderr_path.read_text()}")
    match = ready.match(line)
    assert match, f"not a ready line: {line!r}\nstderr: {stderr_path.read_text()}"
    return match


@contextlib.contextmanager
def service_process(args: list[str], ready: re.Pattern, env: dict[str, str], stderr_path: Path,
                    ready_timeout_s: float = 60.0):
    """Runs `kvserve ARGS` and yields (process, ready-line match) once it is ready; always kills it afterwards.

    stderr goes to a file, not a pipe, so the service's logs can never block it."""
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen([KVSERVE, *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                stdin=subprocess.DEVNULL)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        yield proc, _await_ready(proc, ready, lines, stderr_path, ready_timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=EXIT_TIMEOUT_S)
        reader.join(timeout=EXIT_TIMEOUT_S)
        proc.stdout.close()
