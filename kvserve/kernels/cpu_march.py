"""Which instruction set the CPU kernels are compiled for (``-march``), and whether this CPU runs that code.

``native`` (the default) is this CPU's own: the fastest, but only for CPUs with the same instruction sets, so its
build is named by the CPU's flags and a machine with other flags builds its own. A container image is built on
one machine and run on others: it names an x86-64 micro-architecture level instead (KVSERVE_CPU_MARCH, set by
the Containerfile), whose one build loads on every CPU that has the level's instruction sets. A CPU without them
builds ``native`` code at start instead (and says so), rather than crash on an illegal instruction.

    level       what it adds (as /proc/cpuinfo names it)
    x86-64-v2   SSE4.2, SSSE3, POPCNT, CMPXCHG16B, LAHF         (Nehalem, 2008)
    x86-64-v3   AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE, XSAVE     (Haswell, 2013; Zen 1)
    x86-64-v4   AVX-512 F, BW, CD, DQ, VL                       (Skylake-SP, 2017; Zen 4)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
NATIVE = "native"
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_LEVELS = {"x86-64": frozenset(), "x86-64-v2": _V2, "x86-64-v3": _V3, "x86-64-v4": _V4}


def cpu_flags_line(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The ``flags`` line of the first CPU ('' where there is no /proc/cpuinfo)."""
    if not cpuinfo.exists():
        return ""
    return next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")


def runs_here(march: str, flags_line: str) -> bool:
    """Whether a CPU with these flags runs code built for ``march``: a level's flags all present; ``native``
    always; any other -march value (a named CPU, another architecture) is the builder's word, trusted."""
    required = X86_LEVELS.get(march)
    if required is None:
        return True
    return required <= set(flags_line.partition(":")[2].split())


def kernel_march(flags_line: str | None = None) -> str:
    """The -march to build for: KVSERVE_CPU_MARCH (default native), or native where this CPU lacks it."""
    march = os.environ.get("KVSERVE_CPU_MARCH", "").strip() or NATIVE
    if march != NATIVE and not runs_here(march, cpu_flags_line() if flags_line is None else flags_line):
        log.warning("cpu kernels: this CPU lacks instruction sets of KVSERVE_CPU_MARCH=%s; building for this CPU "
                    "(-march=native) instead", march)
        return NATIVE
    return march
