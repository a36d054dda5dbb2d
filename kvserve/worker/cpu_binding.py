"""The worker's compute threads and the CPUs it may run on (``kvserve worker --threads N --cpus LIST``).

    CpuBinding(threads=None, cpus=None)   today's behaviour: torch's choice of intra-op threads, no binding
    CpuBinding(threads=1, cpus={0})       one intra-op thread, the process and every thread on CPU 0

apply() runs early in the worker's start-up, before torch starts its thread pool: the binding first (every
thread the process has then, so that threads started later inherit it), then the thread count (the variables
OpenMP and MKL read when they start, and torch.set_num_threads). The cpu backend's kernels
(kvserve/kernels/cpu_parallel.h) and torch's own ops both run on these intra-op threads. No grpc here: the CLI passes a
CpuBinding in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class CpuBinding:
    threads: int | None = None  # intra-op threads; None: torch's choice (one per CPU the process may use)
    cpus: frozenset[int] | None = None  # CPUs the process and all its threads run on; None: no binding


def parse_cpu_list(text: str) -> frozenset[int]:
    """A CPU list as taskset writes it, "0-3,6" -> {0, 1, 2, 3, 6}. ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part.strip()!r} is not a CPU number or a range like 0-3") \
                from None
        if lo < 0 or hi < lo:
            raise ValueError(f"bad CPU list {text!r}: {part.strip()!r} is not a CPU number or a range like 0-3")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus) -> str:
    """{0, 1, 2, 3, 6} -> "0-3,6" (the inverse of parse_cpu_list)."""
    ordered, runs = sorted(cpus), []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on now (its affinity, which a container's cpuset or taskset narrows)."""
    return frozenset(os.sched_getaffinity(0))


def check_cpus(cpus: frozenset[int], allowed: frozenset[int] | None = None) -> None:
    """ValueError naming the CPUs of ``cpus`` that the process may not use (``allowed``: default, its own)."""
    allowed = allowed_cpus() if allowed is None else allowed
    outside = cpus - allowed
    if outside:
        raise ValueError(f"CPUs {format_cpu_list(outside)} are not among the CPUs this process may use "
                         f"({format_cpu_list(allowed)})")


def apply(binding: CpuBinding) -> CpuBinding:
    """Binds the process (every thread it has) to ``binding.cpus`` and sets the intra-op thread count; returns
    what it then runs with. With cpus and no threads, one thread per CPU bound to. Call it before torch runs an
    op; ValueError (before anything changed) if a CPU is not allowed."""
    if binding.cpus is not None:
        check_cpus(binding.cpus)
    threads = binding.threads
    if threads is None and binding.cpus is not None:
        threads = len(binding.cpus)  # torch would size its pool from the CPUs of the whole machine
    if binding.cpus is not None:
        _bind_all_threads(binding.cpus)
    if threads is not None:
        for name in THREAD_VARIABLES:  # read by OpenMP and MKL when they start, if torch is not loaded yet
            os.environ[name] = str(threads)
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return CpuBinding(torch.get_num_threads(), allowed_cpus())


def _bind_all_threads(cpus: frozenset[int]) -> None:
    os.sched_setaffinity(0, cpus)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def describe(binding: CpuBinding) -> str:
    """ "2 threads on CPUs 0-1" (what the startup line says)."""
    threads = "torch's threads" if binding.threads is None else \
        f"{binding.threads} thread{'s' if binding.threads != 1 else ''}"
    cpus = "any CPU" if binding.cpus is None else f"CPUs {format_cpu_list(binding.cpus)}"
    return f"{threads} on {cpus}"
