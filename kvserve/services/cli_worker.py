"""``kvserve worker``, ``kvserve info`` and ``kvserve generate``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("kvserve.cli")
DEFAULT_WORKER_PORT = 50061
TIER_FLUSH_S = 5.0  # a stopping worker waits this long for its queued store writes and their report


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


class _PoolSize(argparse.Action):
    """--kv-cache-bytes or --num-pages: a flag on the command line clears the other one's env default."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, "num_pages" if self.dest == "kv_cache_bytes" else "kv_cache_bytes", None)


def add_kv_format_flags(p: argparse.ArgumentParser, dtype_default: str, scales_default: str) -> None:
    """--kv-cache-dtype and --kv-scales. Checked when the pool is sized, before anything is allocated, so that a
    bad value is one line (kvserve: unknown KV cache dtype ...) and exit code 2."""
    p.add_argument("--kv-cache-dtype", default=dtype_default,
                   help="element type of the KV pool: auto (the model dtype), float32, bfloat16, float16, or the "
                        "1-byte int8, fp8_e4m3, fp8_e5m2 (quantised on write, dequantised in the kernel)")
    p.add_argument("--kv-scales", default=scales_default,
                   help="scales of a quantised KV pool: token_head (default: one per token and kv head, computed "
                        "on write) or tensor (one per-tensor scale of 1.0, as vLLM without calibration)")


def add_window_flags(p: argparse.ArgumentParser, window_default: str, sinks_default: str) -> None:
    """--sliding-window and --attention-sinks, checked (with the model's own window) before a pool exists."""
    from kvserve.services.cli_flags import non_negative_int

    p.add_argument("--sliding-window", type=non_negative_int, default=window_default,
                   help="attend to the last W tokens only (default 0: the model's own window, if its config has "
                        "one); the pages a request's window leaves behind are released as it runs")
    p.add_argument("--attention-sinks", type=non_negative_int, default=sinks_default,
                   help="with --sliding-window: the first S tokens stay visible too (StreamingLLM), for models "
                        "trained with full attention; requests may then run past the model's context")


def add_cuda_flags(p: argparse.ArgumentParser) -> None:
    """--cuda-graphs/--no-cuda-graphs and --cuda-graph-max-seqs: what a CUDA worker captures (ignored on CPU)."""
    from kvserve.services.cli_flags import env_switch, positive_int

    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=env_switch("cuda_graphs", True),
                   help="on CUDA with the triton backend, replay CUDA graphs for pure-decode steps, captured per "
                        "batch and length bucket the first time one runs (default on)")
    p.add_argument("--cuda-graph-max-seqs", type=positive_int, default=_env("cuda_graph_max_seqs", "64"),
                   help="the largest decode batch a CUDA graph is captured for; larger ones run eagerly (default "
                        "64, the gateway's --max-num-seqs)")


def add_page_group_flags(p: argparse.ArgumentParser) -> None:
    """--page-groups/--no-page-groups and --sliding-group-pages: how a model mixing sliding and full layers keeps
    its pages (kvserve/worker/page_groups.py)."""
    from kvserve.services.cli_flags import env_switch, positive_int

    p.add_argument("--page-groups", action=argparse.BooleanOptionalAction, default=env_switch("page_groups", True),
                   help="for a model mixing sliding-window and full-attention layers (Gemma 3, Qwen2's "
                        "max_window_layers, a layer_types list), keep the sliding layers' pages in a pool of their "
                        "own, released as they leave the window (default on; off, or with --kv-store-url, a role "
                        "other than both or attention sinks: one pool, every page kept, the sliding layers masking)")
    p.add_argument("--sliding-group-pages", type=positive_int, default=_env("sliding_group_pages"),
                   help="with page groups, pages of the sliding layers' pool (default: the windows of 64 requests, "
                        "at most the full layers' pages; the KV budget holds both pools)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    from kvserve.services.cli_flags import parse_bytes, positive_int

    p.add_argument("--model", default=_env("model"), help="HF-layout model folder (default: the prepared SmolLM2)")
    p.add_argument("--cache-dir", type=Path, default=_env("cache_dir"))
    p.add_argument("--device", default=_env("device", "auto"), help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=_env("dtype", "auto"), help="auto (fp32 on CPU, bf16 on CUDA), float32, "
                   "bfloat16, float16")
    # String defaults (env values included) go through `type` like typed flags: a bad value is a usage error.
    p.add_argument("--page-size", type=positive_int, default=_env("page_size", "16"))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-bytes", type=parse_bytes, default=_env("kv_cache_bytes"), action=_PoolSize,
                      help="KV pool budget, e.g. 512MiB (default 512MiB)")
    size.add_argument("--num-pages", type=positive_int, default=_env("num_pages"), action=_PoolSize)
    add_kv_format_flags(p, _env("kv_cache_dtype", "auto"), _env("kv_scales", "token_head"))
    add_window_flags(p, _env("sliding_window", "0"), _env("attention_sinks", "0"))
    add_cuda_flags(p)
    add_page_group_flags(p)
    p.add_argument("--attention-backend", default=_env("attention_backend", "auto"),
                   choices=["auto", "cpu", "triton", "reference", "flash-attn"],
                   help="auto (default): cpu for float32 on CPU when its C++ module builds, else reference; on "
                        "CUDA triton when it runs, else reference; "
                        "cpu: the in-place decode kernel and linear layers on packed weights, or an error; "
                        "triton: the in-place Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1), or an error; "
                        "reference: gather + SDPA and F.linear; flash-attn: flash-attn 4 (or 2) on CUDA, bf16/fp16, "
                        "untested on hardware, never picked by auto")


def add_commands(sub) -> None:
    from kvserve.services.cli_flags import add_observability_flags, add_tls_flags, positive_float, positive_int

    w = sub.add_parser("worker", help="run a worker: model weights + KV page pool, serving Step and Info")
    _add_engine_flags(w)
    w.add_argument("--host", default=_env("host", "127.0.0.1"))
    w.add_argument("--port", type=int, default=_env("port", str(DEFAULT_WORKER_PORT)))
    w.add_argument("--worker-id", default=_env("worker_id", "worker-0"))
    w.add_argument("--kvmanager", default=_env("kvmanager"),
                   help="join the kvmanager's membership and keep a lease there: host:port, or a comma-separated "
                        "list (leader and standbys). Without it, the gateway's --workers list names this worker")
    w.add_argument("--advertise-address", default=_env("advertise_address"),
                   help="host:port the gateway dials, as told to the kvmanager (default: --host and the bound port)")
    w.add_argument("--drain-timeout", type=positive_float, default=_env("drain_timeout", "30"),
                   help="with --kvmanager: on SIGTERM, seconds to let the running requests finish before "
                        "leaving (default 30)")
    w.add_argument("--kv-store-url", default=_env("kv_store_url", ""),
                   help="the shared KV tier: a Redis every worker of the model reads and writes KV pages in "
                        "(redis://, rediss://, unix://, redis+sentinel://). With --kvmanager the worker writes "
                        "the committed pages it is asked to and loads store hits; without --kvmanager it only "
                        "loads (nothing could record its writes). Default: none")
    w.add_argument("--role", type=_role, default=_env("role", "both"),
                   help="the work the gateway sends this worker: both (default: prefill and decode), prefill (a "
                        "request's prompt, whose pages a decode worker then pulls) or decode")
    add_cpu_flags(w)
    add_observability_flags(w)
    add_tls_flags(w, "both", dials="the kvmanager (and other workers, for page transfers)")
    w.add_argument("--peer-tls-server-name", default=_env("peer_tls_server_name"),
                   help="with TLS: the name this worker verifies other workers' certificates against when it pulls "
                        "pages from them (they are dialled at the address they advertise, often a pod IP that no "
                        "certificate names). Default: their host")
    w.set_defaults(func=run_worker)

    info = sub.add_parser("info", help="print a running worker's Info")
    info.add_argument("--worker", default=_env("worker", f"127.0.0.1:{DEFAULT_WORKER_PORT}"))
    add_tls_flags(info, "client", dials="the worker")
    info.set_defaults(func=run_info)

    g = sub.add_parser("generate", help="stream a completion from a running gateway (or --local)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    g.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--local", action="store_true",
                   help="generate in this process: the engine core over an in-process kvmanager and worker "
                        "(no services)")
    g.add_argument("--gateway", default=_env("gateway", "127.0.0.1:50050"), help="gateway host:port")
    g.add_argument("--api-key", default=_env("api_key"), help="API key (not needed in dev mode)")
    g.add_argument("--timeout", type=positive_float, default=300.0, help="deadline of the call in seconds")
    add_tls_flags(g, "client", dials="the gateway")
    _add_engine_flags(g)
    g.set_defaults(func=run_generate)


def add_cpu_flags(w: argparse.ArgumentParser) -> None:
    """--threads and --cpus: the worker's compute threads and the CPUs it runs on (kvserve/worker/cpu_binding.py)."""
    from kvserve.services.cli_flags import positive_int

    w.add_argument("--threads", type=positive_int, default=_env("threads"),
                   help="intra-op threads the model's torch ops and the cpu backend's kernels run on (default: "
                        "torch's choice, one per CPU the worker may use; with --cpus, one per listed CPU)")
    w.add_argument("--cpus", type=cpu_list, default=_env("cpus"),
                   help="bind the worker process and all its threads to these CPUs, a list like taskset's "
                        "0-3,6 (default: no binding). kvserve up picks both for its workers")


def cpu_list(text: str) -> frozenset[int]:
    """--cpus's value: a CPU list this process may use, or a usage error naming the bad value."""
    from kvserve.worker.cpu_binding import check_cpus, parse_cpu_list

    try:
        cpus = parse_cpu_list(text)
        check_cpus(cpus)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return cpus


def _bind_cpus(args):
    """--threads and --cpus applied before the model loads (before torch starts its thread pool); what the
    worker runs with (a CpuBinding)."""
    from kvserve.worker.cpu_binding import CpuBinding, apply

    return apply(CpuBinding(int(args.threads) if args.threads is not None else None, args.cpus))


def _role(text: str) -> str:
    """--role's value, or a usage error naming the allowed ones."""
    from kvserve.common.wire.transfer import check_role

    try:
        return check_role(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _runner_config(args, **extra):
    from kvserve.services.model_store import resolve_model
    from kvserve.worker.runner import RunnerConfig

    kv_bytes = int(args.kv_cache_bytes) if args.kv_cache_bytes is not None else None
    num_pages = int(args.num_pages) if args.num_pages is not None else None
    group_pages = int(args.sliding_group_pages) if args.sliding_group_pages is not None else None
    return RunnerConfig(model_dir=resolve_model(args.model, args.cache_dir), device=args.device, dtype=args.dtype,
                        page_size=args.page_size, kv_cache_bytes=kv_bytes, num_pages=num_pages,
                        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                        kv_scales=args.kv_scales, sliding_window=args.sliding_window,
                        attention_sinks=args.attention_sinks, cuda_graphs=args.cuda_graphs,
                        cuda_graph_max_seqs=int(args.cuda_graph_max_seqs), page_groups=args.page_groups,
                        sliding_group_pages=group_pages, **extra)


def _make_runner(args, **extra):
    """The ModelRunner the flags describe, or None after printing why not (no model folder, bad pool size)."""
    from kvserve.services.model_store import ModelNotFound
    from kvserve.worker.runner import ModelRunner

    try:
        return ModelRunner(_runner_config(args, **extra))
    except (ModelNotFound, ValueError) as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return None


def run_worker(args) -> int:
    from kvserve.common.grpc_server import install_stop_signals
    from kvserve.common.metrics import WorkerMetrics, serve_metrics
    from kvserve.common.telemetry import setup_tracing, shutdown_tracing
    from kvserve.services.cli_flags import metrics_note, tls_note
    from kvserve.worker.server import start_worker_server

    if not _kvmanager_flag_ok(args):
        return 2
    tls = _tls(args, server=True)
    if tls is False:
        return 2
    binding = _bind_cpus(args)
    runner = _make_runner(args, worker_id=args.worker_id, kv_store_url=args.kv_store_url, role=args.role)
    if runner is None:
        return 2
    stop = install_stop_signals()  # before the ready line: a SIGTERM right after it still drains, exits 0
    setup_tracing("kvserve-worker", args.worker_id)
    tier_stats = runner.tier.stats if runner.tier is not None else None
    metrics = WorkerMetrics(tier_stats) if args.metrics_port is not None else None
    metrics_port = serve_metrics(metrics.registry, args.host, int(args.metrics_port)) if metrics else None
    try:
        ws = start_worker_server(runner, args.host, args.port, metrics=metrics, tls=tls,
                                 peer_server_name=args.peer_tls_server_name)
    except OSError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 1
    from kvserve.worker.cpu_binding import describe
    from kvserve.worker.model import describe_weights

    keeper = _join(args, runner, ws, stop, tls)
    i = runner.info
    scales = f", {i.kv_scales} scales" if i.kv_scales else ""
    print(f"kvserve worker {i.worker_id} ready on {args.host}:{ws.port}: model {i.model_name} on {i.device}, "
          f"{i.num_pages} pages x {i.page_size} tokens x {i.bytes_per_token} B/token = {i.pool_bytes} B "
          f"({i.kv_dtype}{scales}); linear weights: {describe_weights(runner.model.weights)}; {describe(binding)}"
          f"{metrics_note(args.host, metrics_port)}{tls_note(tls)}{_member_note(keeper)}{_store_note(runner)}"
          f"{'; role ' + i.role if i.role != 'both' else ''}"
          f"{'; ' + runner.page_groups_note if runner.page_groups_note else ''}",
          flush=True)
    code = _serve(args, runner, ws, stop, keeper)
    shutdown_tracing()
    return code


def _kvmanager_flag_ok(args) -> bool:
    """--kvmanager names at least one address (checked before the model loads); says why not."""
    from kvserve.common.channels import kvmanager_addresses

    try:
        if args.kvmanager:
            kvmanager_addresses(args.kvmanager)
    except ValueError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return False
    return True


def _tls(args, server: bool):
    """The TLS files of the flags (common.tls.Tls), None for plaintext, or False after printing why they are
    wrong (checked before the model loads)."""
    from kvserve.common.tls import TlsError
    from kvserve.services.cli_flags import tls_from_args

    try:
        return tls_from_args(args, server=server)
    except TlsError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return False


JOIN_WAIT_S = 10.0  # the ready line waits this long for the join, so that a gateway started next sees the worker


def _join(args, runner, ws, stop, tls):
    """With --kvmanager: the lease keeper, started, once it joined (or JOIN_WAIT_S passed); else None. With
    ``tls`` it dials the kvmanager with TLS, its certificate as the client certificate."""
    if not args.kvmanager:
        return None
    from kvserve.worker.membership import LeaseKeeper

    address = args.advertise_address or f"{args.host}:{ws.port}"
    keeper = LeaseKeeper(runner, args.kvmanager, address, on_failed=stop.set, tls=tls)
    if runner.tier is not None:
        runner.tier.set_report(keeper.report_tier)
    keeper.start().joined.wait(JOIN_WAIT_S)
    return keeper


def _member_note(keeper) -> str:
    if keeper is None:
        return ""
    if keeper.joined.is_set():
        return f"; joined the kvmanager as {keeper.address}"
    return "; not joined yet (the kvmanager does not answer; still trying)"


def _store_note(runner) -> str:
    if runner.tier is None:
        return ""
    return "; kv store " + ("read and written" if runner.tier.reporter.report is not None else "read only")


def _serve(args, runner, ws, stop, keeper) -> int:
    """Serves until SIGTERM: as a worker the gateway's --workers names, or with --kvmanager as a member of the
    kvmanager's membership, which drains and leaves before the server stops. Then the KV tier's queued writes
    are written and reported (bounded). The exit code."""
    if keeper is None:
        from kvserve.common.grpc_server import serve_until_signal

        serve_until_signal(ws, stop, "worker")
        runner.close_tier(TIER_FLUSH_S)
        return 0
    from kvserve.worker.membership import serve_as_member

    serve_as_member(ws, keeper, stop, args.drain_timeout, on_stopped=lambda: runner.close_tier(TIER_FLUSH_S))
    return 1 if keeper.failed else 0


def run_info(args) -> int:
    import grpc
    from google.protobuf import json_format

    from kvserve.common.tls import open_channel
    from kvserve.v1 import worker_pb2, worker_pb2_grpc

    tls = _tls(args, server=False)
    if tls is False:
        return 2
    with open_channel(args.worker, tls) as channel:
        try:
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
        except grpc.RpcError as e:
            print(f"kvserve: worker {args.worker}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(info, always_print_fields_with_no_presence=True,
                                  preserving_proto_field_name=True))
    return 0


def run_generate(args) -> int:
    if args.local:
        return run_generate_local(args)
    from kvserve.services.client import Client, KVServeError

    tls = _tls(args, server=False)
    if tls is False:
        return 2
    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed)
    try:
        with Client(args.gateway, api_key=args.api_key, timeout_s=args.timeout, **_client_tls(tls, args.gateway)) \
                as client:
            stream = client.generate(prompt=None if args.chat else args.prompt, messages=messages, **sampling)
            for delta in stream:
                print(delta.text, end="", flush=True)
    except KVServeError as e:
        print(f"\nkvserve: gateway {args.gateway}: {e.code.name}: {e.details}", file=sys.stderr)
        return 2 if e.code.name == "INVALID_ARGUMENT" else 1
    except ValueError as e:  # a flag's value that does not fit the request (build_request names it)
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the stream is cancelled on the way out, which frees its pages
        print(file=sys.stderr)
        return 130
    print()
    return 0


def _client_tls(tls, address: str) -> dict:
    """The SDK Client's credentials and channel options for ``tls`` ({} for plaintext)."""
    if tls is None:
        return {}
    from kvserve.common.tls import channel_credentials, channel_options
    from kvserve.services.client.client import DEFAULT_CHANNEL_OPTIONS

    return {"credentials": channel_credentials(tls),
            "channel_options": (*DEFAULT_CHANNEL_OPTIONS, *channel_options(tls, address))}


def run_generate_local(args) -> int:
    from kvserve.common.errors import DomainError
    from kvserve.common.request_checks import check_sampling
    from kvserve.common.tokenizer import ChatTemplateError, Tokenizer
    from kvserve.common.wire.worker import SamplingParams
    from kvserve.services.gateway.llm import LLM

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    try:
        check_sampling("sampling flags", sampling)
        runner = _make_runner(args)
        if runner is None:
            return 2
        tok = Tokenizer(runner.cfg.model_dir)
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        for piece in LLM(runner, tokenizer=tok).stream(tok.encode(text), args.max_tokens, sampling):
            print(piece, end="", flush=True)
    except (DomainError, ChatTemplateError) as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    print()
    return 0
