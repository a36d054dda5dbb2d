"""k8s/grafana-dashboard.json: valid, and every query reads only series that kvserve/common/metrics.py exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from kvserve.common.metrics import (
    GATEWAY_METRICS,
    KVMANAGER_METRICS,
    TIER_COUNTERS,
    WORKER_METRICS,
    GatewayMetrics,
    KVManagerMetrics,
    WorkerMetrics,
)
from kvserve.kvmanager.admin import StoreStats, TenantStats, TransferStats

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana-dashboard.json"
METRIC_TOKEN = re.compile(r"kvserve:[a-zA-Z0-9_:]+")
PANEL_KINDS = {"timeseries", "stat", "gauge"}


def _read_stats() -> SimpleNamespace:
    """A stand-in for kvmanager.admin.ClusterStats with one pool, one tenant and the store, so every labelled
    family has samples."""
    pool = SimpleNamespace(worker_id="w0", kv_dtype="int8", num_used_pages=3, num_pages=8, num_cached_pages=2,
                           num_window_released_pages=5, used_bytes=300, cached_bytes=200, pool_bytes=800)
    tenant = TenantStats("t0", 3, 1, 0, 10, 4, store_hits=2)
    store = StoreStats(1000, 2, 200, 2, 3, 1, 0, 2, 200, 0.1, 0, 0, 3, 300, 0)
    transfers = TransferStats(3, 12, 1, 1, 1, 4096, 0.5, 1, 0)
    return SimpleNamespace(pools=[pool], tenants=[tenant], num_evicted_blocks=1, store=store, transfers=transfers)


def _call_log() -> SimpleNamespace:
    """A stand-in for kvmanager.call_log.CallLog, the default store, whose call log the kvmanager exports."""
    return SimpleNamespace(num_logged=5, num_logged_bytes=900, gen=2, last_snapshot_s=0.2,
                           num_snapshots={"forked": 1, "inline": 0, "failed": 0})


def _with_children(metrics: object) -> object:
    """Creates one child of every labelled metric: prometheus_client exports no sample for a bare parent."""
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*("x" for _ in metric._labelnames))
    return metrics


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name the three services' registries expose, from generate_latest of the real classes."""
    names: set[str] = set()
    for metrics in (GatewayMetrics(), WorkerMetrics(), KVManagerMetrics(_read_stats, _call_log())):
        text = generate_latest(_with_children(metrics).registry).decode()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])]


def _all_queries(dashboard: dict) -> list[tuple[str, str]]:
    """Panel exprs plus the template variables' queries (label_values over a metric)."""
    out = list(_exprs(dashboard))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"${var['name']}", query))
    return out


def _histogram_quantile_args(expr: str) -> list[str]:
    """The text between the parentheses of each histogram_quantile(...) call in expr."""
    args = []
    for match in re.finditer(r"histogram_quantile\s*\(", expr):
        depth, i = 1, match.end()
        while depth:
            assert i < len(expr), f"unbalanced parentheses in {expr!r}"
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        args.append(expr[match.end():i - 1])
    return args


def test_the_exported_set_covers_the_declared_metric_names(exported: set[str]) -> None:
    # Guards the fixture: if a labelled family exported nothing, the subset check below would be too strict.
    for name in GATEWAY_METRICS + KVMANAGER_METRICS + WORKER_METRICS:
        assert name in exported or f"{name}_bucket" in exported, name
    assert "kvserve:num_preemptions_total" in exported and "kvserve:num_preemptions" not in exported


def test_the_dashboard_is_valid_json_with_a_title_uid_and_unique_panels(dashboard: dict) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    panels = _panels(dashboard)
    assert len(panels) >= 10
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = [p["title"] for p in panels]
    assert all(titles) and len(titles) == len(set(titles)), "empty or duplicate panel titles"
    for panel in panels:
        assert panel.get("description"), f"panel {panel['title']!r} has no description"
        if panel["type"] == "row":
            continue
        assert panel["type"] in PANEL_KINDS, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no queries"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_template_variables_datasource_worker_id_and_tenant(dashboard: dict) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("worker_id", "tenant"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == "${datasource}"
        assert re.fullmatch(rf"label_values\(kvserve:[a-z_:]+, {name}\)", var["query"]["query"]), var["query"]


def test_every_query_reads_only_exported_series(dashboard: dict, exported: set[str]) -> None:
    for where, expr in _all_queries(dashboard):
        tokens = METRIC_TOKEN.findall(expr)
        assert tokens, f"{where}: {expr!r} reads no kvserve metric"
        unknown = sorted(set(tokens) - exported)
        assert not unknown, f"{where}: {unknown} are not exported by kvserve/common/metrics.py"


def test_every_histogram_quantile_aggregates_buckets_by_le(dashboard: dict) -> None:
    found = 0
    for title, expr in _exprs(dashboard):
        for arg in _histogram_quantile_args(expr):
            found += 1
            tokens = METRIC_TOKEN.findall(arg)
            assert tokens and all(t.endswith("_bucket") for t in tokens), f"{title}: {expr!r}"
            assert "rate(" in arg, f"{title}: quantile over raw counters: {expr!r}"
            by_clauses = re.findall(r"\bby\s*\(([^)]*)\)", arg)
            assert by_clauses and all("le" in {label.strip() for label in c.split(",")} for c in by_clauses), (
                f"{title}: {expr!r} does not keep le")
    assert found >= 6


@pytest.mark.parametrize("needed", [
    "kvserve:kv_cache_usage_perc",
    "kvserve:prefix_cache_hits_total",
    "kvserve:prefix_cache_queries_total",
    "kvserve:time_to_first_token_seconds_bucket",
    "kvserve:time_per_output_token_seconds_bucket",
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:num_preemptions_total",
    "kvserve:evicted_blocks_total",
    # the shared KV tier
    "kvserve:prefix_cache_tier_hits_total",
    "kvserve:kv_tier_bytes",
    "kvserve:kv_tier_capacity_bytes",
    "kvserve:kv_tier_loaded_bytes_total",
    "kvserve:kv_tier_load_seconds_total",
    "kvserve:kv_tier_written_pages_total",
    "kvserve:kv_tier_dropped_writes_total",
    "kvserve:kv_tier_failed_loads_total",
    "kvserve:kv_tier_verify_failures_total",
])
def test_the_dashboard_covers(dashboard: dict, needed: str) -> None:
    assert any(needed in METRIC_TOKEN.findall(expr) for _, expr in _exprs(dashboard)), needed


def test_hit_rate_divides_hits_by_queries_and_ttft_tpot_have_p50_p90_p99(dashboard: dict) -> None:
    exprs = [expr for _, expr in _exprs(dashboard)]
    assert any(re.search(r"prefix_cache_hits_total.*\)\s*/\s*.*prefix_cache_queries_total", e) for e in exprs)
    assert any("sum by (tenant)" in e and "prefix_cache_hits_total" in e for e in exprs), "no per-tenant hit rate"
    for metric in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        quantiles = {m for e in exprs if f"kvserve:{metric}_bucket" in e
                     for m in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)}
        assert {"0.5", "0.9", "0.99"} <= quantiles, (metric, quantiles)


def test_tier_panels_split_hits_by_tier_and_rate_loads_by_their_own_seconds(dashboard: dict) -> None:
    exprs = [expr for _, expr in _exprs(dashboard)]
    # pool vs store: each tier's hit tokens over every prompt token looked up (the two sum to the hit rate)
    assert any(re.search(r"sum by \(tier\) \(rate\(kvserve:prefix_cache_tier_hits_total.*\)\s*/\s*ignoring \(tier\) "
                         r"group_left sum\(rate\(kvserve:prefix_cache_queries_total", e) for e in exprs)
    # MB/s while loading: bytes over the seconds the loads took, not over wall time
    assert any(re.search(r"kv_tier_loaded_bytes_total.*\)\s*/\s*sum\(rate\(kvserve:kv_tier_load_seconds_total", e)
               for e in exprs)
    assert any("kv_tier_bytes{tier=\"store\"}" in e for e in exprs)
    assert any("kv_tier_capacity_bytes{tier=\"store\"}" in e for e in exprs)


def test_tier_panels_read_the_workers_counters_never_the_kvmanagers_sums_of_them(dashboard: dict) -> None:
    """The kvmanager exports the workers' tier counters summed (kv_tier_reported_*): a query over both would
    count every load twice, so the dashboard reads the workers' own (live, and by instance)."""
    worker_counters = {f"{name}_total" for name, _ in TIER_COUNTERS.values()}
    read = set()
    for title, expr in _exprs(dashboard):
        tokens = set(METRIC_TOKEN.findall(expr))
        assert not any("kv_tier_reported_" in t for t in tokens), title
        if tokens & worker_counters:
            read |= tokens & worker_counters
            assert 'tier="store"' in expr, f"{title}: {expr!r}"
    assert read, "no panel reads the workers' tier counters"
