"""reference/metrics.md: every Prometheus metric of the three services, read from kvserve/common/metrics.py's
registries.

Run by mkdocs-gen-files at build time. Each registry is built as its service builds it (the kvmanager's over an
empty manager, as a standby's, and a call log that has written nothing) and walked: name, type, labels, help.
"""

from __future__ import annotations

from types import SimpleNamespace

import mkdocs_gen_files
from prometheus_client.metrics import MetricWrapperBase

from kvserve.common import metrics
from kvserve.kvmanager import admin
from kvserve.kvmanager.manager import KVManager

PAGE = "reference/metrics.md"
SUFFIXES = {"counter": "_total"}  # a counter's samples are named <name>_total; a histogram's <name>_bucket, ...


def services():
    """(title, the flag that serves it, the service's metrics object)."""
    call_log = SimpleNamespace(num_logged=0, num_logged_bytes=0, gen=0, last_snapshot_s=0.0,
                               num_snapshots={"forked": 0, "inline": 0, "failed": 0})
    yield "Gateway", "kvserve gateway", metrics.GatewayMetrics()
    yield "kvmanager", "kvserve kvmanager", metrics.KVManagerMetrics(lambda: admin.stats(KVManager()), call_log)
    yield "Worker", "kvserve worker", metrics.WorkerMetrics()


def rows(service) -> list[str]:
    """One table row per metric family the service's registry exports."""
    wrappers = {w._name: w for w in vars(service).values() if isinstance(w, MetricWrapperBase)}
    out = []
    for family in service.registry.collect():
        wrapper = wrappers.get(family.name)
        labels = getattr(wrapper or family, "_labelnames", None)
        if labels is None:
            raise RuntimeError(f"{family.name}: no label names found (prometheus_client changed?)")
        exported = f"`{family.name}{SUFFIXES.get(family.type, '')}`"
        buckets = getattr(wrapper, "_upper_bounds", None)
        help_text = family.documentation.replace("|", "\\|")
        if buckets:
            bounds = ", ".join(f"{b:g}" for b in buckets if b != float("inf"))
            help_text += f" Buckets: {bounds}."
        label_text = ", ".join(f"`{name}`" for name in labels) or "none"
        out.append(f"| {exported} | {family.type} | {label_text} | {help_text} |")
    return out


def render() -> str:
    lines = ["# Metrics", "",
             "Every Prometheus metric the services export, generated from `kvserve/common/metrics.py` when this "
             "site is built. Each service serves its own registry as text on `http://HOST:PORT/metrics` when started "
             "with `--metrics-port`; names follow vLLM's `vllm:*` conventions under `kvserve:`. "
             "[Observability](../deploy/observability.md) says how to scrape, trace and chart them "
             "(`k8s/grafana-dashboard.json`). A histogram is exported as its `_bucket`, `_sum` and `_count` "
             "series.", ""]
    for title, command, service in services():
        lines += [f"## {title}", "", f"`{command} --metrics-port PORT`", "",
                  "| metric | type | labels | help |", "|---|---|---|---|", *rows(service), ""]
    return "\n".join(lines)


with mkdocs_gen_files.open(PAGE, "w") as f:
    f.write(render())
