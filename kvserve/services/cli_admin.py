"""``kvserve admin stats|tenants|inspect|probe|evict|pin|unpin|page-table|reset|forget-worker``: the kvmanager's
admin RPCs.

Readable tables by default; ``--json`` prints the answer as JSON: proto3's mapping with snake_case field names,
every count a number (64-bit ones too). The admin token comes from ``--admin-token``, else
``KVSERVE_ADMIN_TOKEN``, else the ``admin_token`` file a local ``kvserve kvmanager`` wrote under its data dir.
Errors print ``kvserve: <STATUS>: <details>`` and exit 1; bad flags exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvserve.common.errors import InvalidRequest
from kvserve.common.tokens import check_token_ids
from kvserve.services.cli_kvmanager import ADMIN_TOKEN_FILE, DEFAULT_KVMANAGER_PORT, default_data_dir


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


def token_list(text: str) -> tuple[int, ...]:
    """'1,2,3' -> (1, 2, 3). Raises argparse.ArgumentTypeError on anything else."""
    try:
        ids = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token ids: {text!r}") from None
    try:
        check_token_ids("", ids)
    except InvalidRequest as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return ids


def _common_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kvmanager", default=_env("kvmanager", f"127.0.0.1:{DEFAULT_KVMANAGER_PORT}"),
                        help="address of the kvmanager (host:port), or of several separated by commas (a leader and "
                        "its standbys)")
    common.add_argument("--admin-token", default=_env("admin_token"),
                        help="admin token (default: KVSERVE_ADMIN_TOKEN, else <data-dir>/admin_token)")
    common.add_argument("--data-dir", type=Path, default=_env("data_dir"),
                        help="data dir of a local kvmanager, for its admin_token file (default: <cache dir>/kvmanager)")
    common.add_argument("--json", action="store_true", help="print the answer as JSON")
    common.add_argument("--timeout", type=float, default=10.0, help="deadline of the call in seconds")
    from kvserve.services.cli_flags import add_tls_flags

    add_tls_flags(common, "client", dials="the kvmanager")
    return common


def _add_prefix_input(p: argparse.ArgumentParser) -> None:
    p.add_argument("tenant")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--tokens", type=token_list, help="token ids, e.g. 1,2,3")
    given.add_argument("--text", help="text, tokenised by the kvmanager (it needs --model)")
    p.add_argument("--worker", default="", help="only this worker's pool")


def add_commands(sub) -> None:
    admin = sub.add_parser("admin", help="inspect and manage the kvmanager's cache (needs the admin token)")
    cmds = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")
    common = _common_flags()

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, parents=[common], help=help)
        p.set_defaults(func=run_admin)
        return p

    cmd("stats", "per pool and per tenant counters")
    cmd("tenants", "every known tenant with its counters")
    p = cmd("inspect", "a tenant's cached blocks and longest prefixes")
    p.add_argument("tenant")
    p.add_argument("--max-blocks", type=int, default=0, help="default 100")
    p.add_argument("--max-prefixes", type=int, default=0, help="default 10")
    _add_prefix_input(cmd("probe", "how many tokens of a prompt would hit, per worker (no side effect)"))
    p = cmd("evict", "evict a tenant's cached blocks that no request holds")
    p.add_argument("tenant")
    p.add_argument("--worker", default="", help="only this worker's pool")
    p.add_argument("--include-pinned", action="store_true", help="also unpin and evict pinned blocks")
    pin = cmd("pin", "pin the cached blocks of a prefix (kept until unpinned, or --ttl after its last hit)")
    _add_prefix_input(pin)
    pin.add_argument("--ttl", type=_duration_s, default=0,
                     help="a soft pin: lapses this long after its last hit (90s, 5m, 1h, 24h), within the tenant's "
                          "pin budget; default: an operator's pin, kept until unpinned")
    _add_prefix_input(cmd("unpin", "unpin the blocks of a prefix"))
    cmd("page-table", "a request's pages with ref_cnts and block hashes").add_argument("req_id")
    reset = cmd("reset", "drop every cached block and counter (refused while requests run, unless --force)")
    reset.add_argument("--yes", action="store_true", help="confirm the reset")
    reset.add_argument("--force", action="store_true",
                       help="drop live requests too: only for requests no gateway serves any more (their pages "
                            "go to new requests while a worker may still write them)")
    forget = cmd("forget-worker", "remove the pool of a worker that is gone for good (scaled down)")
    forget.add_argument("worker_id")
    forget.add_argument("--force", action="store_true", help="even with requests live on it (forgotten with it)")


# -- requests ----------------------------------------------------------------------------------------------
def _prefix_fields(args) -> dict:
    from kvserve.v1 import kvmanager_pb2 as pb

    given = {"token_ids": pb.TokenIds(token_ids=args.tokens)} if args.tokens else {"text": args.text}
    return {"tenant": args.tenant, "worker_id": args.worker, **given}


def _request(args):
    """(rpc name, request message) for the parsed command."""
    from kvserve.v1 import kvmanager_pb2 as pb

    c = args.admin_command
    if c == "stats":
        return "Stats", pb.StatsRequest()
    if c == "tenants":
        return "ListTenants", pb.ListTenantsRequest()
    if c == "inspect":
        return "InspectTenant", pb.InspectTenantRequest(tenant=args.tenant, max_blocks=args.max_blocks,
                                                        max_prefixes=args.max_prefixes)
    if c == "evict":
        return "EvictTenant", pb.EvictTenantRequest(tenant=args.tenant, worker_id=args.worker,
                                                    include_pinned=args.include_pinned)
    if c == "page-table":
        return "GetPageTable", pb.GetPageTableRequest(req_id=args.req_id)
    if c == "reset":
        return "Reset", pb.ResetRequest(confirm=True, force=args.force)
    if c == "forget-worker":
        return "ForgetWorker", pb.ForgetWorkerRequest(worker_id=args.worker_id, force=args.force)
    rpc = {"probe": "Probe", "pin": "Pin", "unpin": "Unpin"}[c]
    ttl = {"ttl_s": args.ttl} if c == "pin" else {}
    return rpc, pb.PrefixRequest(**_prefix_fields(args), **ttl)


def _duration_s(text: str) -> int:
    """'90s', '5m', '1h', '24h' or plain seconds -> seconds (> 0)."""
    import argparse

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    s = text.strip().lower()
    scale = units.get(s[-1:], 1)
    try:
        value = float(s[:-1] if s[-1:] in units else s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 300, 5m or 1h)") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"a pin's ttl must be at least 1 second, got {text!r}")
    return int(value)


def _token_file(args) -> Path:
    return (args.data_dir or default_data_dir()).expanduser() / ADMIN_TOKEN_FILE


def _client_token(args) -> str | None:
    if args.admin_token:
        return args.admin_token
    try:
        return _token_file(args).read_text().strip() or None
    except OSError:
        return None  # the server answers UNAUTHENTICATED, with a hint


def _token_hint(args, code, token: str | None) -> str:
    """Where a refused token came from, when kvserve admin read it from a data dir: a kvmanager started with
    another --data-dir (kvserve up --data-dir D) wrote its token there, not here."""
    import grpc

    if args.admin_token or code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return ""
    path = _token_file(args)
    where = f"the token was read from {path}" if token else f"no token file at {path}"
    return f" ({where}; for a kvmanager started with another --data-dir, pass that --data-dir, or --admin-token)"


def _leader_hint(e) -> str:
    """For a refusal because no kvmanager named leads (each one's health says NOT_SERVING: standbys)."""
    return (" (the kvmanagers named report NOT_SERVING: standbys, none of them leads now; name the leader, or "
            "all of them separated by commas)") if "backend unhealthy" in (e.details() or "") else ""


def run_admin(args) -> int:
    import grpc

    from kvserve.common.channels import kvmanager_channel
    from kvserve.services.cli_flags import tls_from_args
    from kvserve.v1 import kvmanager_pb2_grpc

    if args.admin_command == "reset" and not args.yes:
        print("kvserve: reset drops every cached block and counter; confirm with --yes", file=sys.stderr)
        return 2
    rpc, request = _request(args)
    token = _client_token(args)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    try:
        channel = kvmanager_channel(args.kvmanager, tls=tls_from_args(args, server=False))
    except ValueError as e:  # a --kvmanager that is not host:port, a TLS file missing or wrong (TlsError)
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    with channel:
        try:
            stub = kvmanager_pb2_grpc.KVAdminServiceStub(channel)
            response = getattr(stub, rpc)(request, metadata=metadata, timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"kvserve: {e.code().name}: {e.details()}{_token_hint(args, e.code(), token)}"
                  f"{_leader_hint(e)}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(as_json(response), indent=2))
    else:
        print(RENDER[args.admin_command](response, args))
    return 0


# -- output ------------------------------------------------------------------------------------------------
def as_json(message) -> dict:
    """The answer as proto3 JSON with snake_case names and every field present, but with 64-bit counts as
    numbers: the proto3 JSON mapping writes int64 as strings, which would make pool_bytes a string beside
    num_pages a number."""
    from google.protobuf import json_format

    data = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, data)


def _numbers(descriptor, data: dict) -> dict:
    for field in descriptor.fields:
        if field.name in data and not (field.message_type and field.message_type.GetOptions().map_entry):
            value = data[field.name]
            data[field.name] = [_number(field, v) for v in value] if field.is_repeated else _number(field, value)
    return data


def _number(field, value):
    from google.protobuf.descriptor import FieldDescriptor as F

    if field.message_type is not None:
        return _numbers(field.message_type, value)
    wide = (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64)
    return int(value) if field.type in wide else value


# -- tables ------------------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _rate(hit: int, query: int) -> str:
    return f"{100 * hit / query:.1f}%" if query else "-"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _when(ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _tenants_table(tenants) -> str:
    if not tenants:
        return "(no tenants)"
    return table(["TENANT", "BLOCKS", "PINNED", "STORE_BLOCKS", "REQUESTS", "QUERY_TOKENS", "HIT_TOKENS", "POOL_HITS",
                  "STORE_HITS", "HIT_RATE"],
                 [[t.tenant, t.num_blocks, t.num_pinned_blocks, t.num_store_blocks, t.num_requests,
                   t.prefix_cache_queries, t.prefix_cache_hits, t.prefix_cache_hits - t.store_hits, t.store_hits,
                   _rate(t.prefix_cache_hits, t.prefix_cache_queries)] for t in tenants])


def _limit(n) -> str:
    return str(n) if n else "-"


def _quotas_table(tenants) -> str:
    """Each tenant's holdings against its share, floor and cap (pools, then the store), pins and evictions."""
    if not tenants:
        return "(no tenants)"
    return table(["TENANT", "WEIGHT", "ACTIVE", "PAGES", "SHARE", "FLOOR", "CAP", "STORE_MB", "STORE_FLOOR_MB",
                  "STORE_CAP_MB", "PINS", "SOFT_PINS", "PIN_BUDGET", "EVICTED", "CAUSED", "STORE_EVICTED",
                  "STORE_REJECTED"],
                 [[t.tenant, f"{t.weight:g}", _yes(t.active), t.num_pages, t.share_pages, _limit(t.floor_pages),
                   _limit(t.cap_pages), f"{t.store_bytes / 1e6:.1f}", _limit(round(t.store_floor_bytes / 1e6)),
                   _limit(round(t.store_cap_bytes / 1e6)), t.num_pin_blocks, t.num_soft_pin_blocks,
                   t.pin_budget_blocks, t.num_evicted_pages, t.num_evictions_caused, t.num_store_evicted,
                   t.num_store_rejected] for t in tenants])


def _tiers_table(r) -> str:
    """Per tier: the pools (summed) and the shared KV store."""
    s = r.kv_store
    pool_blocks = sum(t.num_blocks for t in r.tenants)
    pool_hits = r.prefix_cache_hits - sum(t.store_hits for t in r.tenants)
    rows = [["pool", pool_blocks, sum(p.cached_bytes + p.used_bytes for p in r.pools), pool_hits, "-", "-", "-",
             "-", "-", "-"]]
    if s.capacity_bytes:
        mb_s = f"{s.num_loaded_bytes / s.load_s / 1e6:.0f}" if s.load_s else "-"
        page_size = r.pools[0].page_size if r.pools else 0
        rows.append(["store", s.num_blocks, f"{s.num_bytes} of {s.capacity_bytes}", s.num_hit_pages * page_size,
                     s.num_loaded_pages, mb_s, s.num_failed_loads, s.num_written_pages, s.num_dropped_writes,
                     s.num_verify_failures])
    return table(["TIER", "BLOCKS", "BYTES", "HIT_TOKENS", "LOADED_PAGES", "LOAD_MB/S", "FAILED_LOADS",
                  "WRITTEN_PAGES", "DROPPED_WRITES", "VERIFY_FAILURES"], rows)


def _transfers_table(r) -> str:
    """Pulls of pages between workers' pools: how they ended, what they moved, and the holds live now."""
    x = r.transfers
    mb_s = f"{x.num_bytes / x.seconds / 1e6:.1f}" if x.seconds else "-"
    return table(["PULLS", "OK", "FAILED", "EXPIRED", "MOVED", "PAGES", "MB", "MB/S", "HOLDS"],
                 [[x.num_pulls, x.num_ok, x.num_failed, x.num_expired, x.num_moved, x.num_pages,
                   f"{x.num_bytes / 1e6:.1f}", mb_s, x.num_holds]])


def _pools_and_groups(pools):
    """Each pool, then its sliding layers' group if it has page groups (a row "<worker>/sliding")."""
    for p in pools:
        yield p, p.worker_id
        if p.HasField("sliding_group"):
            yield p.sliding_group, f"{p.worker_id}/sliding"


def _pool_row(p, name: str) -> list:
    return [name, p.epoch, p.role or "both", p.kv_dtype, p.kv_scales or "-", p.page_size, p.num_pages,
            p.num_used_pages, p.num_cached_pages, p.num_free_pages, p.num_pinned_pages, p.num_requests,
            p.pool_bytes, p.used_bytes, p.cached_bytes, p.sliding_window or "-", p.attention_sinks or "-",
            p.num_window_released_pages]


def _render_stats(r, args) -> str:
    pools = table(["WORKER", "EPOCH", "ROLE", "KV_DTYPE", "KV_SCALES", "PAGE_SIZE", "PAGES", "USED", "CACHED",
                   "FREE", "PINNED", "REQUESTS", "POOL_BYTES", "USED_BYTES", "CACHED_BYTES", "WINDOW", "SINKS",
                   "WINDOW_RELEASED"],
                  [_pool_row(p, name) for p, name in _pools_and_groups(r.pools)]
                  ) if r.pools else "(no pools registered)"
    total = (f"prefix cache: {r.prefix_cache_hits} of {r.prefix_cache_queries} query tokens hit "
             f"({_rate(r.prefix_cache_hits, r.prefix_cache_queries)}), {r.num_evicted_blocks} blocks evicted, "
             f"store {'ok' if r.store_ok else 'FAILING'}")
    return (f"pools\n{pools}\n\ntiers\n{_tiers_table(r)}\n\ntransfers\n{_transfers_table(r)}\n\n"
            f"tenants\n{_tenants_table(r.tenants)}\n\n"
            f"tenant quotas\n{_quotas_table(r.tenants)}\n\n{total}")


def _render_inspect(r, args) -> str:
    s = r.stats
    head = (f"tenant {s.tenant}: {s.num_blocks} cached blocks ({s.num_pinned_blocks} pinned), {s.num_requests} "
            f"requests, {s.prefix_cache_hits} of {s.prefix_cache_queries} query tokens hit")
    prefixes = table(["WORKER", "BLOCKS", "TOKENS", "LAST_BLOCK_HASH"],
                     [[p.worker_id, p.num_blocks, p.num_tokens, p.last_block_hash] for p in r.prefixes])
    blocks = table(["WORKER", "EPOCH", "INDEX", "PAGE", "REF_CNT", "PINNED", "LAST_USED", "BLOCK_HASH"],
                   [[b.worker_id, b.epoch, b.block_index, b.page_id, b.ref_cnt, _yes(b.pinned), b.last_used,
                     b.block_hash] for b in r.blocks])
    return f"{head}\n\nlongest prefixes\n{prefixes}\n\nblocks, most recently used first\n{blocks}"


def _render_probe(r, args) -> str:
    best = f" (best: {r.worker_id})" if r.worker_id else ""
    hits = table(["WORKER", "EPOCH", "HIT_TOKENS"], [[h.worker_id, h.epoch, h.num_cached_tokens] for h in r.hits])
    return f"tenant {args.tenant}: {r.num_cached_tokens} of {r.num_query_tokens} tokens hit{best}\n{hits}"


def _render_page_table(r, args) -> str:
    """One row per page table index; a page its window released shows as "-", of kind "released"."""
    num_released = sum(p.kind == "released" for p in [*r.pages, *r.group_pages])
    released = f" ({num_released} released by its window)" if num_released else ""
    head = (f"request {r.req_id} (tenant {r.tenant}) on {r.worker_id} epoch {r.epoch}: {len(r.page_table)} pages "
            f"of {r.page_size} tokens{released}, {r.num_prompt_tokens} prompt tokens, {r.num_committed_tokens} "
            f"committed, last step {r.last_step_id}")
    if not r.group_pages:
        return f"{head}\n{_pages_table(r.pages)}"
    return (f"{head}\nfull layers\n{_pages_table(r.pages)}\n\nsliding layers (their own pool; \"-\": released by "
            f"the window, or a hit the first chunk did not read)\n{_pages_table(r.group_pages)}")


def _pages_table(pages) -> str:
    return table(["INDEX", "PAGE", "KIND", "REF_CNT", "PINNED", "BLOCK_HASH"],
                 [[i, "-" if p.kind == "released" else p.page_id, p.kind or "held", p.ref_cnt, _yes(p.pinned),
                   p.block_hash or "-"] for i, p in enumerate(pages)])


RENDER = {
    "stats": _render_stats,
    "tenants": lambda r, args: f"{_tenants_table(r.tenants)}\n\n{_quotas_table(r.tenants)}",
    "inspect": _render_inspect,
    "probe": _render_probe,
    "evict": lambda r, args: (f"evicted {r.num_evicted_blocks} blocks of tenant {args.tenant}; kept "
                              f"{r.num_kept_blocks} (held by requests or pinned)"),
    "pin": lambda r, args: (f"pinned {r.num_pinned_blocks} blocks of tenant {args.tenant} "
                            f"({r.num_pinned_tokens} tokens on the best pool)"
                            + (f", the first until {_when(r.expires_ms)} unless hit again"
                               if r.expires_ms and r.num_pinned_blocks else "")
                            + (f"; {r.num_over_budget_blocks} blocks left unpinned: the tenant's pin budget is spent"
                               if r.num_over_budget_blocks else "")
                            + ("" if r.num_pinned_blocks else "; nothing of this prefix is cached yet: a pin "
                               "applies to cached blocks, so pin it after a request has cached it")),
    "unpin": lambda r, args: f"unpinned {r.num_unpinned_blocks} blocks of tenant {args.tenant}",
    "page-table": _render_page_table,
    "reset": lambda r, args: (f"reset: dropped {r.num_dropped_requests} requests and {r.num_dropped_blocks} "
                              f"cached blocks"),
    "forget-worker": lambda r, args: (f"forgot worker {args.worker_id}: dropped its pool, "
                                      f"{r.num_dropped_requests} requests and {r.num_dropped_blocks} cached blocks"),
}
