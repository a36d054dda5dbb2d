"""``kvserve up``'s workers: how many of each role, their ids, and the check that the roles can serve.

    --workers K                              K workers of role both             worker-0 .. worker-{K-1}
    --prefill-workers N --decode-workers M   N prefill workers                  prefill-0 .. prefill-{N-1}
                                             hand each request's pages to
                                             one of M decode workers            decode-0 .. decode-{M-1}

Each worker also gets its compute threads and CPUs (--worker-threads, --worker-cpus; kvserve worker --threads,
--cpus): by default (auto) the last CPU is left to the gateway, the kvmanager and Redis, and the workers split the
others, one thread per CPU (plan_cpus; docs/benchmarks/colocate.md measures why).

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
                   help="intra-op threads of each worker (default: one per CPU the worker is bound to; unbound, "
                        "torch's choice)")
    u.add_argument("--worker-cpus", type=_cpus_choice, default=_env("worker_cpus", AUTO), metavar="auto|none|LIST",
                   help="the CPUs the workers are bound to. auto (default): the last CPU is left to the gateway, "
                        "kvmanager and Redis and the workers split the others (with as many CPUs as workers or "
                        "fewer, one each, shared round-robin); none: no binding (torch's threads over every CPU); "
                        "a list like 0-3,6: split between the workers")


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

    AUTO leaves the last allowed CPU to the other services (the gateway, the kvmanager, Redis and the clients
    on the machine) when there are more CPUs than workers, as vLLM's CPU backend reserves one for its front end,
    and splits the rest between the workers. Bound to a core of its own, a worker computing on one thread per
    core is not held at torch's barriers by a peer thread that the gateway or another process descheduled; the
    co-location benchmark measured this choice against today's unbound threads. A CPU list is split the same
    way, nothing reserved. Threads: ``threads`` if given, else one per CPU of the worker (None when unbound)."""
    if cpus == NO_BINDING:
        return [(threads, None)] * num_workers
    pool = sorted(allowed if cpus == AUTO else cpus)
    if cpus == AUTO and len(pool) > num_workers:
        pool = pool[:-1]
    return [(threads or len(share), frozenset(share)) for share in split(pool, num_workers)]


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
