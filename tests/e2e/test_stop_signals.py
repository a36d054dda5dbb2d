"""Stopping on SIGTERM/SIGINT: the first signal asks for a graceful stop, a second one ends the process. A burst
of signals must never deadlock the main thread (Event.set takes a lock; a handler nested inside another
handler's Event.set used to wait on that lock forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from kvserve.common.grpc_server import STOP_SIGNALS, install_stop_signals

CHILD = textwrap.dedent("""
    import time
    from kvserve.common.grpc_server import install_stop_signals
    stop = install_stop_signals()
    print("ready", flush=True)
    stop.wait()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # a graceful stop in progress, while more signals arrive
        pass
""")


def test_the_first_signal_sets_the_event_and_a_second_one_is_the_default_action():
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        stop = install_stop_signals()
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        assert stop.is_set()
        assert all(signal.getsignal(sig) == signal.SIG_DFL for sig in STOP_SIGNALS)
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


def test_a_burst_of_sigterms_during_a_graceful_stop_never_hangs():
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        for _ in range(2000):
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM)
        proc.stdout.close()
