"""``kvserve up``'s workers: how many of each role, their ids, and the check that the roles can serve.

    --workers K                              K workers of role both             worker-0 .. worker-{K-1}
    --prefill-workers N --decode-workers M   N prefill workers                  prefill-0 .. prefill-{N-1}
                                             hand each request's pages to
                                             one of M decode workers            decode-0 .. decode-{M-1}

The role counts replace --workers: a stack with prefill or decode workers has no worker of role both unless
--workers is given as well. Every worker gets the same model, KV format, page size and window (``up`` builds
one argv for all of them, cli_up.py), as the kvmanager requires of pools that hand pages to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NUM_WORKERS = 1


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    role: str  # "both", "prefill" or "decode": the work the gateway sends it (kvserve worker --role)


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


def worker_specs(args) -> list[WorkerSpec]:
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
    return ([WorkerSpec(f"worker-{i}", "both") for i in range(num_both)]
            + [WorkerSpec(f"prefill-{i}", "prefill") for i in range(num_prefill)]
            + [WorkerSpec(f"decode-{i}", "decode") for i in range(num_decode)])
