"""`kvserve up --prefill-workers N --decode-workers M`: which workers `up` starts, with which ids, roles,
threads, CPUs and flags, read from the argv it would hand each child (start_child is replaced, nothing runs);
counts that leave a role nothing can hand work to are refused before anything starts."""

from __future__ import annotations

import contextlib

import pytest

from kvserve.services import cli_up
from kvserve.services.cli import build_parser, main
from kvserve.services.cli_up_workers import AUTO, NO_BINDING, plan_cpus, split, worker_specs

KVMANAGER = "127.0.0.1:50051"


def up_args(*flags: str):
    return build_parser().parse_args(["up", *flags])


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def without(argv: list[str], *flags: str) -> list[str]:
    """argv less each of ``flags`` and its value."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            out.append(word)
    return out


@pytest.fixture
def started(monkeypatch) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child `up` would start, in order; the KV store and the kvmanager are stand-ins."""
    calls: list[tuple[str, list[str]]] = []

    def start_child(name, argv, env=None):
        calls.append((name, argv))
        return cli_up.Child(name, proc=None, address=f"127.0.0.1:{len(calls)}")

    def start_kvmanagers(args, children, stack):
        children.append(cli_up.Child("kvmanager", proc=None, address=KVMANAGER))
        return {}

    monkeypatch.setattr(cli_up, "open_kv_store", lambda args, stack: None)
    monkeypatch.setattr(cli_up, "_start_kvmanagers", start_kvmanagers)
    monkeypatch.setattr(cli_up, "start_child", start_child)
    return calls


def start(*flags: str) -> None:
    with contextlib.ExitStack() as stack:
        cli_up._start_stack(up_args(*flags), [], stack)


@pytest.mark.parametrize(("flags", "expected"), [
    ((), [("worker-0", "both")]),
    (("--workers", "2"), [("worker-0", "both"), ("worker-1", "both")]),
    (("--prefill-workers", "1", "--decode-workers", "2"),
     [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]),
    (("--decode-workers", "1", "--prefill-workers", "2", "--workers", "1"),
     [("worker-0", "both"), ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]),
    (("--workers", "1", "--decode-workers", "1"), [("worker-0", "both"), ("decode-0", "decode")]),
    (("--prefill-workers", "0", "--decode-workers", "0"), [("worker-0", "both")]),
])
def test_the_role_counts_replace_workers_unless_it_is_given_too(flags, expected) -> None:
    assert [(s.worker_id, s.role) for s in worker_specs(up_args(*flags))] == expected


def test_each_worker_gets_its_id_and_role_and_every_other_flag_alike(started) -> None:
    start("--prefill-workers", "2", "--decode-workers", "1", "--model", "/models/m", "--page-size", "32",
          "--kv-cache-dtype", "int8", "--kv-scales", "tensor", "--num-pages", "64", "--sliding-window", "64",
          "--kv-store-url", "redis://127.0.0.1:6390/0")
    assert [name for name, _ in started] == ["prefill-0", "prefill-1", "decode-0", "gateway"]
    workers = started[:-1]
    assert [(flag_value(argv, "--worker-id"), flag_value(argv, "--role")) for _, argv in workers] == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    rest = [without(argv, "--worker-id", "--role", "--threads", "--cpus") for _, argv in workers]
    assert rest[0] == rest[1] == rest[2]  # one model, pool and KV format: the kvmanager refuses a mismatch
    for flag, value in (("--model", "/models/m"), ("--page-size", "32"), ("--kv-cache-dtype", "int8"),
                        ("--kv-scales", "tensor"), ("--num-pages", "64"), ("--sliding-window", "64"),
                        ("--kvmanager", KVMANAGER), ("--kv-store-url", "redis://127.0.0.1:6390/0")):
        assert flag_value(rest[0], flag) == value, flag


def test_a_worker_of_role_both_is_told_so(started) -> None:
    """Explicitly: a KVSERVE_ROLE in up's environment, which the children inherit, must not change it."""
    start()
    ((name, argv), _gateway) = started
    assert (name, flag_value(argv, "--worker-id"), flag_value(argv, "--role")) == ("worker-0", "worker-0", "both")


@pytest.mark.parametrize(("flags", "message"), [
    (("--prefill-workers", "2"), "--prefill-workers 2 needs --decode-workers"),
    (("--prefill-workers", "1", "--workers", "2"), "--prefill-workers 1 needs --decode-workers"),
    (("--decode-workers", "3"), "--decode-workers 3 needs --prefill-workers (or --workers)"),
    (("--prefill-workers", "-1", "--decode-workers", "1"), "argument --prefill-workers: must be 0 or more, got -1"),
    (("--decode-workers", "-2"), "argument --decode-workers: must be 0 or more, got -2"),
    (("--workers", "0"), "argument --workers: must be positive, got 0"),
])
def test_counts_that_cannot_serve_are_usage_errors_before_anything_starts(started, capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["up", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvserve up")
    assert f"kvserve up: error: {message}" in err
    assert started == []


def cpus(*ids: int) -> frozenset[int]:
    return frozenset(ids)


@pytest.mark.parametrize(("num_workers", "allowed", "threads"), [
    # the CPUs less one (left to the gateway, kvmanager and Redis) split between the workers, at least one each
    (1, cpus(0, 1), 1),
    (1, cpus(0, 1, 2, 3), 3),
    (1, cpus(2, 5, 7), 2),  # the allowed set (a container's cpuset) counts, not the machine's
    (2, cpus(*range(8)), 3),
    (3, cpus(*range(4)), 1),
    (2, cpus(0, 1), 1),
    (3, cpus(0, 1), 1),
    (1, cpus(0), 1),
])
def test_auto_leaves_a_cpu_to_the_services_and_binds_nothing(num_workers, allowed, threads) -> None:
    assert plan_cpus(num_workers, allowed, None, AUTO) == [(threads, None)] * num_workers


def test_threads_given_override_the_choice_and_none_leaves_torchs() -> None:
    assert plan_cpus(1, cpus(0, 1, 2, 3), 2, AUTO) == [(2, None)]
    assert plan_cpus(2, cpus(0, 1), None, NO_BINDING) == [(None, None), (None, None)]
    assert plan_cpus(1, cpus(0, 1), 1, NO_BINDING) == [(1, None)]


def test_a_cpu_list_is_split_between_the_workers_each_bound_to_its_share() -> None:
    assert plan_cpus(1, cpus(0, 1), None, cpus(0, 1)) == [(2, cpus(0, 1))]
    assert plan_cpus(2, cpus(*range(8)), None, cpus(1, 3, 5)) == [(2, cpus(1, 3)), (1, cpus(5))]
    assert plan_cpus(3, cpus(0, 1), None, cpus(0, 1)) == [(1, cpus(0)), (1, cpus(1)), (1, cpus(0))]
    assert plan_cpus(2, cpus(0, 1), 2, cpus(0, 1)) == [(2, cpus(0)), (2, cpus(1))]


@pytest.mark.parametrize(("pool", "parts", "shares"), [
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]), ([0, 1], 1, [[0, 1]]), ([4], 3, [[4], [4], [4]]),
])
def test_split_gives_contiguous_shares_within_one_of_each_other(pool, parts, shares) -> None:
    assert split(pool, parts) == shares


def test_each_worker_is_told_its_threads_and_cpus(started, monkeypatch) -> None:
    monkeypatch.setattr("kvserve.worker.cpu_binding.allowed_cpus", lambda: cpus(0, 1, 2, 3, 4))
    start("--workers", "2")
    assert [flag_value(argv, "--threads") for _, argv in started[:-1]] == ["2", "2"]
    assert all("--cpus" not in argv for _, argv in started)
    started.clear()
    start("--workers", "2", "--worker-cpus", "0")  # CPU 0: allowed anywhere these tests run
    assert [(flag_value(argv, "--threads"), flag_value(argv, "--cpus")) for _, argv in started[:-1]] == [
        ("1", "0"), ("1", "0")]


def test_no_binding_leaves_the_worker_its_defaults(started) -> None:
    start("--worker-cpus", "none")
    assert "--cpus" not in started[0][1] and "--threads" not in started[0][1]
    started.clear()
    start("--worker-cpus", "none", "--worker-threads", "3")
    assert flag_value(started[0][1], "--threads") == "3" and "--cpus" not in started[0][1]


def test_the_env_vars_set_the_defaults(started, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_WORKER_CPUS", "0")
    monkeypatch.setenv("KVSERVE_WORKER_THREADS", "2")
    start()
    assert (flag_value(started[0][1], "--threads"), flag_value(started[0][1], "--cpus")) == ("2", "0")


@pytest.mark.parametrize(("flags", "message"), [
    (("--worker-cpus", "0-x"), "argument --worker-cpus: bad CPU list '0-x': '0-x' is not a CPU number"),
    (("--worker-cpus", "4096"), "argument --worker-cpus: CPUs 4096 are not among the CPUs this process may use"),
    (("--worker-threads", "0"), "argument --worker-threads: must be positive, got 0"),
])
def test_bad_cpu_flags_are_usage_errors_before_anything_starts(started, capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["up", *flags])
    assert exit_info.value.code == 2
    assert f"kvserve up: error: {message}" in capsys.readouterr().err
    assert started == []
