"""kvserve/worker/cpu_binding.py: CPU lists as taskset writes them, and the check against the CPUs a process may use.
(apply() changes the process it runs in: tests/e2e/test_worker_cpus.py checks it in a real worker.)"""

from __future__ import annotations

import pytest

from kvserve.worker.cpu_binding import CpuBinding, check_cpus, describe, format_cpu_list, parse_cpu_list


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", {0}), ("0-3,6", {0, 1, 2, 3, 6}), (" 2 , 0-1 ", {0, 1, 2}), ("5-5", {5}), ("1,1,0-1", {0, 1}),
])
def test_cpu_lists_parse_like_taskset(text, cpus) -> None:
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize(("text", "bad"), [
    ("", "''"), ("0-", "'0-'"), ("a", "'a'"), ("0,x", "'x'"), ("3-1", "'3-1'"), ("-1", "'-1'"), ("0-2-4", "'0-2-4'"),
    ("1;2", "'1;2'"),
])
def test_a_bad_cpu_list_is_an_error_naming_the_bad_part(text, bad) -> None:
    with pytest.raises(ValueError, match=f"bad CPU list {text!r}: {bad} is not a CPU number or a range"):
        parse_cpu_list(text)


@pytest.mark.parametrize(("cpus", "text"), [({0}, "0"), ({0, 1, 2, 3, 6}, "0-3,6"), ({7, 1, 2, 5}, "1-2,5,7")])
def test_formatting_inverts_parsing(cpus, text) -> None:
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(text) == frozenset(cpus)


def test_cpus_outside_the_allowed_set_are_named() -> None:
    check_cpus(frozenset({0, 1}), frozenset({0, 1, 2}))
    with pytest.raises(ValueError, match=r"CPUs 3-4 are not among the CPUs this process may use \(0-2\)"):
        check_cpus(frozenset({1, 3, 4}), frozenset({0, 1, 2}))


def test_the_startup_line_says_what_the_worker_runs_with() -> None:
    assert describe(CpuBinding(1, frozenset({0}))) == "1 thread on CPUs 0"
    assert describe(CpuBinding(4, frozenset({0, 1, 2, 3}))) == "4 threads on CPUs 0-3"
    assert describe(CpuBinding()) == "torch's threads on any CPU"
