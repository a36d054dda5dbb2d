"""KVSERVE_CPU_MARCH: the CPU kernels built for an x86-64 level (a container image's one build for every node
that has the level) or for this CPU (native, the default), and never for a level this CPU lacks."""

from __future__ import annotations

import pytest

from kvserve.kernels import cpu_march, cpu_paged
from kvserve.kernels.cpu_march import X86_LEVELS, kernel_march, runs_here

V3_CPU = "flags\t\t: fpu sse2 " + " ".join(sorted(X86_LEVELS["x86-64-v3"]))
V2_CPU = "flags\t\t: fpu sse2 " + " ".join(sorted(X86_LEVELS["x86-64-v2"]))


@pytest.mark.parametrize(("march", "line", "runs"), [
    ("x86-64-v3", V3_CPU, True), ("x86-64-v3", V2_CPU, False), ("x86-64-v4", V3_CPU, False),
    ("x86-64-v2", V3_CPU, True), ("x86-64", "", True), ("native", "", True), ("skylake-avx512", V2_CPU, True)])
def test_a_level_runs_only_where_all_its_flags_are(march, line, runs):
    assert runs_here(march, line) is runs


def test_native_by_default_and_the_level_asked_for_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("KVSERVE_CPU_MARCH", raising=False)
    assert kernel_march(V3_CPU) == "native"
    monkeypatch.setenv("KVSERVE_CPU_MARCH", "x86-64-v3")
    assert kernel_march(V3_CPU) == "x86-64-v3"


def test_a_cpu_without_the_level_builds_native_code_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_CPU_MARCH", "x86-64-v3")
    assert kernel_march(V2_CPU) == "native"
    assert "lacks instruction sets of KVSERVE_CPU_MARCH=x86-64-v3" in caplog.text


def test_a_levels_build_is_named_the_same_on_every_cpu_and_a_native_one_by_the_cpus_flags(monkeypatch):
    def name_on(line: str, march: str) -> str:
        monkeypatch.setattr(cpu_paged, "cpu_flags_line", lambda: line)
        monkeypatch.setattr(cpu_march, "cpu_flags_line", lambda: line)
        monkeypatch.setenv("KVSERVE_CPU_MARCH", march)
        return cpu_paged._build_name(cpu_paged.compile_flags())

    other_v3_cpu = V3_CPU + " avx512f"
    assert name_on(V3_CPU, "x86-64-v3") == name_on(other_v3_cpu, "x86-64-v3")
    assert name_on(V3_CPU, "native") != name_on(other_v3_cpu, "native")
    assert name_on(V3_CPU, "x86-64-v3") != name_on(V3_CPU, "native")
    assert name_on(V2_CPU, "x86-64-v3") == name_on(V2_CPU, "native")  # lacks v3: its own native build
