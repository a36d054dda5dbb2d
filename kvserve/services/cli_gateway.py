"""``kvserve gateway``: run the gateway (public API, continuous batching) in front of a kvmanager and workers.

API keys: ``--api-keys-file`` (JSON ``{"key": "tenant"}`` or lines of ``key=tenant``) or ``KVSERVE_API_KEYS``
(``key=tenant,key2=tenant2``). Without either the gateway runs in dev mode: no key needed, one tenant
(``default``), and it says so in its ready line.

TLS: ``--tls-cert``/``--tls-key`` serve gRPC and HTTPS with that certificate and dial the kvmanager and the
workers with TLS, presenting it as the client certificate; ``--tls-ca`` verifies those services with that CA and
requires client certificates it signed on both front-ends (mutual TLS; ``--no-tls-client-auth``: only between
the services, API clients need TLS alone); kvserve/common/tls.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

DEFAULT_GATEWAY_PORT = 50050
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible API (vLLM's and SGLang's default port too)
# The cap on a prefill chunk in steps that also decode (README, "Long prompts": measured with bench/bench_long.py)
DEFAULT_LONG_PREFILL_THRESHOLD = "0"


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


def add_gateway_flags(p) -> None:
    """Scheduling and API flags, shared by ``kvserve gateway`` and ``kvserve up``."""
    from kvserve.services.cli_flags import non_negative_int, positive_float, positive_int

    p.add_argument("--max-num-seqs", type=positive_int, default=_env("max_num_seqs", "64"),
                   help="requests running at once per worker")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=_env("max_num_batched_tokens", "512"),
                   help="tokens computed per step per worker (decodes + prefill chunks)")
    p.add_argument("--long-prefill-token-threshold", type=non_negative_int,
                   default=_env("long_prefill_token_threshold", DEFAULT_LONG_PREFILL_THRESHOLD),
                   help="in a step that also decodes, a prefill chunk computes at most this many tokens, so that "
                        "a long prompt does not stall the running requests (0 = no cap)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=_env("no_prefix_caching", "") not in ("", "0", "false"),
                   help="never reuse cached prefixes (for comparisons)")
    p.add_argument("--no-overlap-page-ops", action="store_true",
                   default=_env("no_overlap_page_ops", "") not in ("", "0", "false"),
                   help="wait for every kvmanager call before the worker computes (for comparisons)")
    p.add_argument("--no-reserve-ahead", action="store_true",
                   default=_env("no_reserve_ahead", "") not in ("", "0", "false"),
                   help="admit and free only in calls answered before the worker computes, not in the call that "
                        "runs while it computes (for comparisons)")
    p.add_argument("--no-pull-peers", action="store_true",
                   default=_env("no_pull_peers", "") not in ("", "0", "false"),
                   help="never pull a prefix from another worker's pool: recompute it (for comparisons); prefill "
                        "workers then get no prompts to prefill for others (they serve as workers of both roles "
                        "only when no other worker is live)")
    p.add_argument("--max-local-prefill", type=non_negative_int, default=_env("max_local_prefill", "256"),
                   help="with prefill workers (--role prefill) live: a prompt with more uncached tokens than this "
                        "prefills on one and decodes on a decode worker that pulls its pages; shorter ones "
                        "prefill where they decode")
    p.add_argument("--default-max-tokens", type=positive_int, default=_env("default_max_tokens", "256"))
    p.add_argument("--max-tokens-limit", type=positive_int, default=_env("max_tokens_limit", "4096"))
    p.add_argument("--api-keys-file", type=Path, default=_env("api_keys_file"),
                   help="API key -> tenant map (default: KVSERVE_API_KEYS, else dev mode)")
    p.add_argument("--max-queued-requests", type=positive_int, default=_env("max_queued_requests", "1024"),
                   help="requests waiting for pages, over all workers; one more is refused (gRPC "
                        "RESOURCE_EXHAUSTED, HTTP 429)")
    p.add_argument("--http-port", type=non_negative_int, default=_env("http_port", str(DEFAULT_HTTP_PORT)),
                   help="port of the OpenAI-compatible HTTP API (0 = a free port)")
    p.add_argument("--served-model-name", default=_env("served_model_name"),
                   help="the model id the HTTP API serves and answers to (default: the model folder's name)")
    p.add_argument("--worker-timeout", type=positive_float, default=_env("worker_timeout", "5"),
                   help="seconds a worker's steps may fail before it is declared dead and its requests are "
                        "recomputed on live workers (default 5)")


def add_commands(sub) -> None:
    from kvserve.services.cli_flags import add_observability_flags, add_tls_flags, env_switch

    g = sub.add_parser("gateway", help="run the gateway: public API and continuous batching")
    g.add_argument("--host", default=_env("host", "127.0.0.1"))
    g.add_argument("--port", type=int, default=_env("port", str(DEFAULT_GATEWAY_PORT)), help="0 = a free port")
    g.add_argument("--kvmanager", default=_env("kvmanager", "127.0.0.1:50051"),
                   help="kvmanager host:port, or a comma-separated list (a leader and its standbys)")
    g.add_argument("--workers", default=_env("workers"),
                   help="a static comma-separated host:port list (default: follow the workers that join the "
                        "kvmanager, as they come and go)")
    g.add_argument("--model", default=_env("model"), help="model folder (default: the prepared SmolLM2)")
    g.add_argument("--cache-dir", type=Path, default=_env("cache_dir"))
    add_gateway_flags(g)
    add_observability_flags(g)
    add_tls_flags(g, "both", dials="the kvmanager")
    g.add_argument("--tls-client-auth", action=argparse.BooleanOptionalAction,
                   default=env_switch("tls_client_auth", True),
                   help="with --tls-ca, require client certificates from the gateway's own API clients, gRPC and "
                        "HTTP (default on); --no-tls-client-auth lets them in with TLS alone (and API keys), while "
                        "the kvmanager and the workers are still dialled with the gateway's certificate")
    g.set_defaults(func=run_gateway)


def gateway_config(args):
    from kvserve.services.gateway.app import GatewayConfig
    from kvserve.services.model_store import resolve_model

    return GatewayConfig(model_dir=resolve_model(args.model, args.cache_dir),
                         max_num_seqs=int(args.max_num_seqs), max_num_batched_tokens=int(args.max_num_batched_tokens),
                         prefix_caching=not args.no_prefix_caching, overlap_page_ops=not args.no_overlap_page_ops,
                         reserve_ahead=not args.no_reserve_ahead,
                         long_prefill_token_threshold=int(args.long_prefill_token_threshold),
                         pull_peers=not args.no_pull_peers, max_local_prefill=int(args.max_local_prefill),
                         default_max_tokens=int(args.default_max_tokens),
                         max_tokens_limit=int(args.max_tokens_limit),
                         max_queued_requests=int(args.max_queued_requests),
                         worker_timeout_s=float(args.worker_timeout))


def describe_keys(keys) -> str:
    from kvserve.services.gateway.auth import DEV_TENANT

    if keys.dev_mode:
        return f"dev mode: no API key needed, every request is tenant {DEV_TENANT!r}"
    return f"{len(keys.keys)} API keys, {len({t for _, t in keys.keys})} tenants"


def start_http(gateway, args, metrics, tls=None):
    """The OpenAI-compatible front-end on --http-port, over the same gateway core as gRPC (HTTPS with ``tls``)."""
    from kvserve.services.gateway.http.app import HttpFrontEnd
    from kvserve.services.gateway.http.server import HttpServer

    model_name = args.served_model_name or gateway.cfg.model_dir.name
    return HttpServer(HttpFrontEnd(gateway, model_name, metrics).app, args.host, int(args.http_port), tls=tls)


def run_gateway(args) -> int:
    from kvserve.common.grpc_server import install_stop_signals
    from kvserve.common.metrics import GatewayMetrics, serve_metrics
    from kvserve.common.telemetry import setup_tracing, shutdown_tracing
    from kvserve.services.cli_flags import metrics_note, tls_from_args, tls_note
    from kvserve.services.gateway.auth import load_keys
    from kvserve.services.gateway.errors import BackendFailure
    from kvserve.services.gateway.rpc.connect import connect_gateway
    from kvserve.services.gateway.rpc.server import start_gateway_server
    from kvserve.services.model_store import ModelNotFound

    stop = install_stop_signals()
    setup_tracing("kvserve-gateway")
    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip()) if args.workers else None
    metrics = GatewayMetrics() if args.metrics_port is not None else None
    try:
        tls = tls_from_args(args, server=True)  # TlsError is a ValueError: exit 2 before anything is dialled
        keys = load_keys(args.api_keys_file, _env("api_keys"))
        gateway = connect_gateway(args.kvmanager, workers, gateway_config(args), keys, metrics, tls=tls)
    except (ValueError, OSError, ModelNotFound) as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    except BackendFailure as e:
        print(f"kvserve: cannot reach the kvmanager or a worker: {e}", file=sys.stderr)
        return 1
    try:
        served = replace(tls, client_auth=args.tls_client_auth) if tls is not None else None
        server = start_gateway_server(gateway, args.host, args.port, tls=served)
        http = start_http(gateway, args, metrics, served)
    except OSError as e:
        gateway.close(drain_s=0.0)
        print(f"kvserve: {e}", file=sys.stderr)
        return 1
    metrics_port = serve_metrics(metrics.registry, args.host, int(args.metrics_port)) if metrics else None
    print(f"kvserve gateway ready on {args.host}:{server.port} (HTTP {http.base_url}, {len(gateway.engines)} workers, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'}, {describe_keys(keys)}"
          f"{metrics_note(args.host, metrics_port)}{tls_note(served)})", flush=True)
    stop.wait()
    server.health.enter_graceful_shutdown()
    gateway.close(drain_s=5.0)  # stop admitting (HTTP: 503), finish or cancel in-flight work, free its pages
    http.stop()
    server.server.stop(2.0).wait()
    shutdown_tracing()
    return 0
