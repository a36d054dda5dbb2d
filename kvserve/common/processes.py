"""Child processes that die with their parent."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1

try:  # resolved at import: a forked child should not take the dynamic loader's lock
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal
    _PRCTL = None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Runs in a forked child: it gets ``sig`` when the thread that forked it dies, even by kill -9.

    Used before exec so an embedded Redis never outlives its kvmanager (a restart would otherwise start a second
    server on the same AOF): SIGTERM makes redis flush and fsync its AOF before it exits, and acknowledged writes
    are already in the OS page cache either way. Without prctl (not Linux), stop() still cleans up."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, sig)
