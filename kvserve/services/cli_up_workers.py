"""``kvserve up``'s workers: how many of each role, their ids, and the check that the roles can serve.

    --workers K                              K workers of role both             worker-0 .. worker-{K-1}
    --prefill-workers N --decode-workers M   N prefill workers                  prefill-0 .. prefill-{N-1}
                                             hand each request's pages to
                                             one of M decode workers            decode-0 .. decode-{M-1}

Each worker also gets its compute threads and CPUs (--worker-threads, --worker-cpus; kvserve worker --threads,
--cpus): by default (auto) one core's worth is left to the gateway, the kvmanager and Redis, the workers split
the other cores' worth of threads, and nothing is bound (plan_cpus; docs/benchmarks/colocate.md measures why).

The role counts replace --workers: a stack with prefill or decode workers has no worker of role both unless
--workers is given as well. Every worker gets the same model, KV format, page size and window (``up`` builds
one argv for all of them, cli_up.py), as the kvmanager requires of pools that hand pages to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_NUM_WORKERS = 1
AUTO, NO_BINDING = "auto", "none"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    role: str  # "both", "prefill" or "decode": the work the gateway sends it (kvserve worker --role)
    threads: int | None = None  # kvserve worker --threads (None: the worker's default)
    cpus: frozenset[int] | None = None  # kvserve worker --cpus (None: no binding)


def add_worker_flags(u) -> None:
    from kvserve.services.cli_flags import non_negative_int, positive_int

    u.add_argument("--workers", type=positive_int, default=None, metavar="K",
                   help=f"worker processes of role both, each prefilling and decoding its own requests (default "
                        f"{DEFAULT_NUM_WORKERS}; with --prefill-workers/--decode-workers, none unless given)")
    u.add_argument("--prefill-workers", type=non_negative_int, default=0, metavar="N",
                   help="worker processes of role prefill (prefill-0, ...): they run prompts, whose pages a decode "
                        "worker then pulls. Needs --decode-workers. With either, these replace --workers")
    u.add_argument("--decode-workers", type=non_negative_int, default=0, metavar="M",
                   help="worker processes of role decode (decode-0, ...): they pull a prefilled request's pages "
                        "and generate its tokens. Needs --prefill-workers (or --workers, whose workers prefill)")
    u.add_argument("--worker-threads", type=positive_int, default=_env("worker_threads"), metavar="N",
                   help="intra-op threads of each worker (default: with --worker-cpus auto, the CPUs less one "
                        "split between the workers, at least 1; with a list, one per CPU of the worker's share; "
                        "with none, torch's choice)")
    u.add_argument("--worker-cpus", type=_cpus_choice, default=_env("worker_cpus", AUTO), metavar="auto|none|LIST",
                   help="the CPUs the workers are bound to. auto (default): none, and the threads (see "
                        "--worker-threads) leave a CPU to the gateway, kvmanager and Redis; none: no binding and "
                        "torch's threads (one per CPU: kvserve's behaviour before --worker-cpus); a list like "
                        "0-3,6: split between the workers, each bound to its share")


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


def _cpus_choice(text: str):
    """--worker-cpus's value: AUTO, NO_BINDING or a CPU list this process may use (a usage error otherwise)."""
    if text.strip().lower() in (AUTO, NO_BINDING):
        return text.strip().lower()
    from kvserve.services.cli_worker import cpu_list

    return cpu_list(text)


def plan_cpus(num_workers: int, allowed: frozenset[int], threads: int | None, cpus) -> list[tuple]:
    """(threads, cpus) for each of ``num_workers`` co-located workers; ``cpus``: AUTO, NO_BINDING or a CPU set.
    ``threads`` (--worker-threads), when given, is every worker's thread count.

    AUTO binds nothing and gives the workers one thread per allowed CPU less one, split between them (at least
    one each): the CPU left over is for the gateway, the kvmanager, Redis and whatever else runs there, as vLLM's
    CPU backend leaves one to its front end. Fewer threads than cores, because torch's own ops split their work
    evenly across the threads and wait for the slowest: a thread that shares its core with a busy process (or the
    gateway) holds every op at that barrier. Unbound, because a bound worker cannot move off a core an unrelated
    process has taken, and the scheduler moves an unbound one to the idle core. The co-location benchmark
    (docs/benchmarks/colocate.md) measured this against torch's default (a thread per core, unbound) and against
    vLLM's choice (bound to all cores but the last) with one core taken by a busy process.

    NO_BINDING: torch's choice of threads, no binding (kvserve's behaviour before). A CPU set is split between
    the workers in contiguous shares, each worker bound to its share with one thread per CPU of it."""
    if cpus == AUTO:
        return [(threads or max(1, (len(allowed) - 1) // num_workers), None)] * num_workers
    if cpus == NO_BINDING:
        return [(threads, None)] * num_workers
    return [(threads or len(share), frozenset(share)) for share in split(sorted(cpus), num_workers)]


def split(pool: list[int], parts: int) -> list[list[int]]:
    """``pool`` in ``parts`` contiguous shares whose sizes differ by at most one; with fewer items than parts,
    one item each, round-robin (parts then share items)."""
    if len(pool) < parts:
        return [[pool[i % len(pool)]] for i in range(parts)]
    size, extra = divmod(len(pool), parts)
    shares, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        shares.append(pool[start:end])
        start = end
    return shares


def worker_specs(args, allowed: frozenset[int] | None = None) -> list[WorkerSpec]:
    """The workers ``up`` starts, in start order: role both, then prefill, then decode. Raises ValueError (the
    message names the flags) when the counts leave a role nobody can hand work to: prefill workers without a
    decode worker, or decode workers with nothing that prefills."""
    num_prefill, num_decode = args.prefill_workers, args.decode_workers
    if num_prefill and not num_decode:
        raise ValueError(f"--prefill-workers {num_prefill} needs --decode-workers: a prefill worker hands each "
                         "request's pages to a decode worker")
    if num_decode and not num_prefill and args.workers is None:
        raise ValueError(f"--decode-workers {num_decode} needs --prefill-workers (or --workers): a decode worker "
                         "only decodes requests that another worker prefilled")
    if args.workers is not None:
        num_both = args.workers
    else:
        num_both = 0 if num_prefill or num_decode else DEFAULT_NUM_WORKERS
    specs = ([WorkerSpec(f"worker-{i}", "both") for i in range(num_both)]
             + [WorkerSpec(f"prefill-{i}", "prefill") for i in range(num_prefill)]
             + [WorkerSpec(f"decode-{i}", "decode") for i in range(num_decode)])
    return _with_cpus(args, specs, allowed)


def _with_cpus(args, specs: list[WorkerSpec], allowed: frozenset[int] | None) -> list[WorkerSpec]:
    from kvserve.worker.cpu_binding import allowed_cpus

    threads = int(args.worker_threads) if args.worker_threads is not None else None
    plan = plan_cpus(len(specs), allowed_cpus() if allowed is None else allowed, threads, args.worker_cpus)
    return [replace(spec, threads=t, cpus=c) for spec, (t, c) in zip(specs, plan, strict=True)]


def cpu_argv(spec: WorkerSpec) -> list[str]:
    """The worker's --threads and --cpus for ``spec`` (none for what it leaves to the worker's default)."""
    from kvserve.worker.cpu_binding import format_cpu_list

    return ((["--threads", str(spec.threads)] if spec.threads is not None else [])
            + (["--cpus", format_cpu_list(spec.cpus)] if spec.cpus is not None else []))
