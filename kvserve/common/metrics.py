"""Prometheus metrics of the three services, named ``kvserve:*`` after the conventions of vLLM's ``vllm:*``.

Each service builds its own CollectorRegistry (no process-global registry: tests run several services in
one process) and serves it on ``--metrics-port``. Counters of state the kvmanager already keeps (pool usage,
prefix-cache tokens per tenant, evictions) are read at scrape time by a collector, never double-counted.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RPC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Every metric name the services export, for the dashboard and its test.
GATEWAY_METRICS = (
    "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:num_preemptions_total",
    "kvserve:time_to_first_token_seconds", "kvserve:time_per_output_token_seconds",
    "kvserve:e2e_request_latency_seconds", "kvserve:scheduler_step_seconds", "kvserve:kvmanager_wait_fraction",
    "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total", "kvserve:request_success_total",
    "kvserve:http_requests_total", "kvserve:http_request_duration_seconds", "kvserve:page_pulls_total",
    "kvserve:page_pull_bytes_total", "kvserve:page_pull_seconds", "kvserve:prefill_handoffs_total",
)
# The shared KV tier's counters of a worker (KVTier.stats()), by TierCounters field: (metric, help).
TIER_COUNTERS = {
    "num_loaded_pages": ("kvserve:kv_tier_loaded_pages", "Pages filled from the tier and verified."),
    "num_loaded_bytes": ("kvserve:kv_tier_loaded_bytes", "Bytes of the values of those pages."),
    "load_s": ("kvserve:kv_tier_load_seconds", "Wall time of the loads (round trips, verification, copy in)."),
    "num_failed_loads": ("kvserve:kv_tier_failed_loads", "Requests whose loads failed (absent, damaged, tier down): "
                         "recomputed."),
    "num_verify_failures": ("kvserve:kv_tier_verify_failures", "Values that were there but failed verification."),
    "num_written_pages": ("kvserve:kv_tier_written_pages", "Pages the tier acknowledged writing."),
    "num_written_bytes": ("kvserve:kv_tier_written_bytes", "Bytes of the values of those pages."),
    "num_dropped_writes": ("kvserve:kv_tier_dropped_writes", "Pages not written: the queue was full, the tier down, "
                           "or no kvmanager to report them to."),
}
WORKER_METRICS = ("kvserve:worker_step_seconds", "kvserve:worker_batch_size", "kvserve:worker_batch_tokens",
                  *(f"{name}_total" for name, _ in TIER_COUNTERS.values()),
                  "kvserve:worker_pulls_total", "kvserve:worker_pulled_bytes_total", "kvserve:worker_pull_seconds",
                  "kvserve:worker_served_bytes_total")
# The same counters on the kvmanager, summed over the workers' reports (ReportTier): kept across worker restarts,
# and named apart so that a sum over every scraped series never counts a load twice.
REPORTED_TIER_COUNTERS = {field: (name.replace("kvserve:kv_tier_", "kvserve:kv_tier_reported_"), doc)
                          for field, (name, doc) in TIER_COUNTERS.items()}
TENANT_GAUGES = {  # TenantStats field -> (metric, help): a tenant's holdings against its share and limits
    "num_pages": ("kvserve:tenant_pages", "Pages a tenant holds over all pools (used, cached, pinned)."),
    "share_pages": ("kvserve:tenant_share_pages", "A tenant's fair share of the pools now (0 while inactive)."),
    "floor_pages": ("kvserve:tenant_floor_pages", "A tenant's floor over all pools (0: none)."),
    "cap_pages": ("kvserve:tenant_cap_pages", "A tenant's cap over all pools (0: none)."),
    "store_bytes": ("kvserve:tenant_store_bytes", "Bytes of a tenant's entries in the shared KV tier."),
    "store_floor_bytes": ("kvserve:tenant_store_floor_bytes", "A tenant's floor in the shared KV tier (0: none)."),
    "store_cap_bytes": ("kvserve:tenant_store_cap_bytes", "A tenant's cap in the shared KV tier (0: none)."),
    "num_pin_blocks": ("kvserve:tenant_pinned_blocks", "Blocks under a tenant's pins (soft and operator's)."),
    "num_soft_pin_blocks": ("kvserve:tenant_soft_pinned_blocks", "Blocks under a tenant's soft (TTL) pins."),
    "pin_budget_blocks": ("kvserve:tenant_pin_budget_blocks", "Blocks a tenant's soft pins may hold."),
}
TENANT_COUNTERS = {
    "num_evicted_pages": ("kvserve:tenant_evicted_pages", "A tenant's cached pages evicted from the pools (those "
                          "of pools since dropped included)."),
    "num_evictions_caused": ("kvserve:tenant_evictions_caused", "Cached pages a tenant's allocations evicted (in "
                             "pools since dropped included)."),
    "num_store_evicted": ("kvserve:tenant_store_evicted_blocks", "A tenant's entries the shared tier evicted."),
    "num_store_rejected": ("kvserve:tenant_store_rejected_blocks", "A tenant's values the shared tier could not "
                           "keep (everything else pinned)."),
}
# Pulls of pages between workers as the kvmanager ordered them (admin.TransferStats field -> (metric, help)); how
# each ended is kvserve:transfer_pulls_total{result}.
TRANSFER_COUNTERS = {
    "num_pulls": ("kvserve:transfer_orders", "Pulls the kvmanager ordered: allocations whose peer hits a worker "
                  "pulls from another's pool."),
    "num_pages": ("kvserve:transfer_pages", "Pages those pulls were to move."),
    "num_bytes": ("kvserve:transfer_bytes", "Bytes the reported pulls received."),
    "seconds": ("kvserve:transfer_seconds", "Wall time of the reported pulls (MB/s = bytes / seconds / 1e6)."),
    "num_moved": ("kvserve:transfer_moved_requests", "Requests whose prefill ran on a prefill worker, taken over "
                  "by their decode worker."),
}
TRANSFER_RESULTS = {"ok": "num_ok", "failed": "num_failed", "expired": "num_expired"}  # result label -> field


KVMANAGER_METRICS = (
    "kvserve:kv_cache_usage_perc", "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
    "kvserve:evicted_blocks_total", "kvserve:kvmanager_rpc_seconds", "kvserve:redis_write_seconds",
    "kvserve:num_cached_pages", "kvserve:call_log_records", "kvserve:call_log_bytes", "kvserve:call_log_generation",
    "kvserve:call_log_snapshots_total", "kvserve:call_log_last_snapshot_seconds",
    "kvserve:window_released_pages_total",
    "kvserve:kv_tier_blocks", "kvserve:kv_tier_bytes", "kvserve:kv_tier_capacity_bytes",
    "kvserve:prefix_cache_tier_hits_total", "kvserve:kv_tier_added_blocks_total",
    "kvserve:kv_tier_evicted_blocks_total", "kvserve:kv_tier_dropped_missing_total",
    *(f"{name}_total" for name, _ in REPORTED_TIER_COUNTERS.values()),
    *(name for name, _ in TENANT_GAUGES.values()), *(f"{name}_total" for name, _ in TENANT_COUNTERS.values()),
    "kvserve:transfer_pulls_total", "kvserve:transfer_holds",
    *(f"{name}_total" for name, _ in TRANSFER_COUNTERS.values()),
)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serves ``registry`` as text on http://host:port/metrics (0 = a free port); returns the port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("kvserve:num_requests_running", "Requests holding pages on a worker.", ["worker_id"],
                             registry=r)
        self.waiting = Gauge("kvserve:num_requests_waiting", "Requests queued for pages.", ["worker_id"], registry=r)
        self.preemptions = Counter("kvserve:num_preemptions", "Requests preempted (recomputed later).",
                                   registry=r)
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("kvserve:time_per_output_token_seconds", "Mean gap between generated tokens.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to last delta.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.step = Histogram("kvserve:scheduler_step_seconds", "Wall time of one scheduler step.", ["worker_id"],
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.kv_wait_fraction = Gauge("kvserve:kvmanager_wait_fraction",
                                      "Share of step wall time spent waiting on the kvmanager since start.",
                                      ["worker_id"], registry=r)
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of finished requests.", ["tenant"],
                                     registry=r)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Generated tokens.", ["tenant"], registry=r)
        self.finished = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.http_requests = Counter("kvserve:http_requests", "HTTP requests by endpoint and status code.",
                                     ["endpoint", "status"], registry=r)
        self.http_latency = Histogram("kvserve:http_request_duration_seconds",
                                      "HTTP request to its last byte (a stream: to data: [DONE]).", ["endpoint"],
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.pulls = Counter("kvserve:page_pulls", "Pulls of a request's pages from another worker, by result "
                             "(ok, or failed: the request recomputes them).", ["result"], registry=r)
        self.pull_bytes = Counter("kvserve:page_pull_bytes", "KV bytes pulled between workers.", registry=r)
        self.pull_seconds = Histogram("kvserve:page_pull_seconds", "Wall time of one pull, order to last page "
                                      "verified.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.handoffs = Counter("kvserve:prefill_handoffs", "Requests whose prefill ran on a prefill worker and "
                                "moved to a decode worker.", registry=r)


class WorkerMetrics:
    """Step latencies and sizes; the shared KV tier's counters, read from ``tier_stats`` (KVTier.stats) at
    scrape time (zeros without a tier), labelled ``tier="store"``; and page transfers between workers."""

    def __init__(self, tier_stats: Callable[[], object] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.step = Histogram("kvserve:worker_step_seconds", "Forward pass and sampling of one step.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.batch_size = Histogram("kvserve:worker_batch_size", "Sequences per step.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.batch_tokens = Histogram("kvserve:worker_batch_tokens", "Tokens computed per step.",
                                      buckets=BATCH_BUCKETS, registry=r)
        r.register(_TierCollector(tier_stats))
        # Pages pulled from other workers (PullPages) and served to them (ReadPages): kvserve/worker/transfer.py.
        self.pulls = Counter("kvserve:worker_pulls", "Pulls of a request's pages from another worker, by result "
                             "(ok: every page verified; failed: the request recomputes).", ["result"], registry=r)
        for result in ("ok", "failed"):
            self.pulls.labels(result)
        self.pulled_bytes = Counter("kvserve:worker_pulled_bytes", "Bytes of the page values pulled and verified.",
                                    registry=r)
        self.pull_seconds = Histogram("kvserve:worker_pull_seconds", "Wall time of one pull, failed ones included.",
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.served_bytes = Counter("kvserve:worker_served_bytes", "Bytes of the page values sent to pulling "
                                    "workers.", registry=r)


class _TierCollector:
    """A worker's tier counters at scrape time: ``read_stats()`` returns common.wire.tier.TierCounters."""

    def __init__(self, read_stats: Callable[[], object] | None):
        self.read_stats = read_stats

    def describe(self):
        return []

    def collect(self):
        stats = self.read_stats() if self.read_stats is not None else None
        for field, (name, doc) in TIER_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["tier"])
            family.add_metric(["store"], getattr(stats, field) if stats is not None else 0)
            yield family


class KVManagerMetrics:
    """RPC and Redis latencies, plus a collector over the manager's own state (read under its lock)."""

    def __init__(self, read_stats: Callable[[], object], call_log: object | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.rpc = Histogram("kvserve:kvmanager_rpc_seconds", "Server-side time of a kvmanager RPC.", ["method"],
                             buckets=RPC_BUCKETS_S, registry=r)
        self.redis_write = Histogram("kvserve:redis_write_seconds", "A call's write to Redis (log or snapshot).",
                                     buckets=RPC_BUCKETS_S, registry=r)
        r.register(_StateCollector(read_stats))
        if call_log is not None:
            r.register(_CallLogCollector(call_log))


class _StateCollector:
    """kvmanager state as metrics at scrape time: ``read_stats()`` returns kvmanager.admin.ClusterStats (read once
    a scrape: pools, tenants, and the two KV tiers)."""

    def __init__(self, read_stats: Callable[[], object]):
        self.read_stats = read_stats

    def describe(self):
        return []

    def collect(self):
        stats = self.read_stats()
        labels = ["worker_id", "kv_dtype"]
        usage = GaugeMetricFamily("kvserve:kv_cache_usage_perc", "Used pages / pages, per worker pool (0-1).",
                                  labels=labels)
        cached = GaugeMetricFamily("kvserve:num_cached_pages", "Cached evictable-or-pinned pages, per pool.",
                                   labels=labels)
        released = CounterMetricFamily("kvserve:window_released_pages", "Pages requests released past their "
                                       "sliding window, per pool.", labels=labels)
        for p in stats.pools:
            pool = [p.worker_id, p.kv_dtype]
            usage.add_metric(pool, p.num_used_pages / p.num_pages if p.num_pages else 0.0)
            cached.add_metric(pool, p.num_cached_pages)
            released.add_metric(pool, p.num_window_released_pages)
        queries = CounterMetricFamily("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "index, per tenant.", labels=["tenant"])
        hits = CounterMetricFamily("kvserve:prefix_cache_hits", "Prompt tokens found cached, per tenant.",
                                   labels=["tenant"])
        for t in stats.tenants:
            queries.add_metric([t.tenant], t.prefix_cache_queries)
            hits.add_metric([t.tenant], t.prefix_cache_hits)
        evicted = CounterMetricFamily("kvserve:evicted_blocks", "Cached blocks evicted to make room.")
        evicted.add_metric([], stats.num_evicted_blocks)
        yield from (usage, cached, released, queries, hits, evicted)
        yield from _tier_families(stats)
        yield from _tenant_families(stats.tenants)
        yield from _transfer_families(stats.transfers)


def _transfer_families(transfers):
    """Pulls between workers (admin.TransferStats; None: no sample)."""
    pulls = CounterMetricFamily("kvserve:transfer_pulls", "Pulls the kvmanager ordered, by how they ended: ok "
                                "(every page verified), failed (the request recomputed them), expired (its lease "
                                "passed unreported).", labels=["result"])
    holds = GaugeMetricFamily("kvserve:transfer_holds", "Pulls holding their source pages now.")
    counters = [CounterMetricFamily(name, doc) for name, doc in TRANSFER_COUNTERS.values()]
    if transfers is not None:
        for result, field in TRANSFER_RESULTS.items():
            pulls.add_metric([result], getattr(transfers, field))
        holds.add_metric([], transfers.num_holds)
        for family, field in zip(counters, TRANSFER_COUNTERS, strict=True):
            family.add_metric([], getattr(transfers, field))
    yield from (pulls, holds, *counters)


def _tenant_families(tenants):
    for kind, table in ((GaugeMetricFamily, TENANT_GAUGES), (CounterMetricFamily, TENANT_COUNTERS)):
        for field, (name, doc) in table.items():
            family = kind(name, doc, labels=["tenant"])
            for t in tenants:
                family.add_metric([t.tenant], getattr(t, field))
            yield family


def _tier_families(stats):
    """The two tiers of KV, ``tier="pool"`` (the workers' pools, summed) and ``tier="store"`` (the shared KV tier),
    from the ClusterStats the state's families read. Without a store (``stats.store`` None) the pool's alone."""
    store = stats.store
    yield from _tier_gauges(stats, store)
    hits = CounterMetricFamily("kvserve:prefix_cache_tier_hits", "Prompt tokens found cached, per tenant and tier: "
                               "on the pool of the worker that ran the request, or loaded from the store. They sum "
                               "to prefix_cache_hits.", labels=["tenant", "tier"])
    for t in stats.tenants:
        hits.add_metric([t.tenant, "pool"], t.prefix_cache_hits - t.store_hits)
        if store is not None:
            hits.add_metric([t.tenant, "store"], t.store_hits)
    yield hits
    yield from _store_counters(stats.num_evicted_blocks, store)
    for field, (name, doc) in REPORTED_TIER_COUNTERS.items():
        family = CounterMetricFamily(name, f"{doc} Summed over the workers' reports to the kvmanager.",
                                     labels=["tier"])
        if store is not None:
            family.add_metric(["store"], getattr(store, field))
        yield family


def _tier_gauges(stats, store):
    """Blocks, bytes and capacity per tier. The pool's bytes are those of its pages in use or cached (what the
    admin stats' tiers table shows), its capacity the pools' bytes."""
    blocks = GaugeMetricFamily("kvserve:kv_tier_blocks", "Cached blocks per tier: in the pools' prefix indexes, "
                               "or in the store's index.", labels=["tier"])
    num_bytes = GaugeMetricFamily("kvserve:kv_tier_bytes", "Bytes per tier: the pools' pages in use or cached, or "
                                  "the store's values (headers included).", labels=["tier"])
    capacity = GaugeMetricFamily("kvserve:kv_tier_capacity_bytes", "Bytes the tier may hold: the pools' pages, or "
                                 "--kv-store-bytes (0: the tier is off).", labels=["tier"])
    blocks.add_metric(["pool"], sum(t.num_blocks for t in stats.tenants))
    num_bytes.add_metric(["pool"], sum(p.used_bytes + p.cached_bytes for p in stats.pools))
    capacity.add_metric(["pool"], sum(p.pool_bytes for p in stats.pools))
    if store is not None:
        blocks.add_metric(["store"], store.num_blocks)
        num_bytes.add_metric(["store"], store.num_bytes)
        capacity.add_metric(["store"], store.capacity_bytes)
    return blocks, num_bytes, capacity


def _store_counters(num_evicted_pool_blocks: int, store):
    """The store's own counters; evictions for the pool too (the pools' LRU)."""
    for name, doc, field in (
            ("added_blocks", "Blocks recorded in the store: values a worker reported written.", "num_added_blocks"),
            ("evicted_blocks", "Blocks evicted to make room: by the pools' LRU, or the store's within "
             "--kv-store-bytes.", "num_evicted_blocks"),
            ("dropped_missing", "Store entries dropped because a load found the value absent or damaged.",
             "num_dropped_missing")):
        family = CounterMetricFamily(f"kvserve:kv_tier_{name}", doc, labels=["tier"])
        if field == "num_evicted_blocks":
            family.add_metric(["pool"], num_evicted_pool_blocks)
        if store is not None:
            family.add_metric(["store"], getattr(store, field))
        yield family


class _CallLogCollector:
    """The Redis call log (kvserve/kvmanager/call_log.py CallLog) at scrape time: how much a restart would replay, and
    its snapshots. A growing log with failed snapshots is the thing to alert on. Plain attribute reads, no lock."""

    def __init__(self, store):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        s = self.store
        for name, doc, value in (
                ("records", "Calls in the Redis call log, all a restart would replay.", s.num_logged),
                ("bytes", "Bytes of those calls.", s.num_logged_bytes),
                ("generation", "The snapshot generation a restart loads.", s.gen),
                ("last_snapshot_seconds", "The last snapshot: fork to the child reaped, or the inline write.",
                 s.last_snapshot_s)):
            gauge = GaugeMetricFamily(f"kvserve:call_log_{name}", doc)
            gauge.add_metric([], value)
            yield gauge
        snapshots = CounterMetricFamily("kvserve:call_log_snapshots", "Snapshots of the state, by how they were "
                                        "written (forked, inline) or that a child failed.", labels=["result"])
        for result, count in s.num_snapshots.items():
            snapshots.add_metric([result], count)
        yield snapshots
