"""The in-process OTLP collector, fed by the real OpenTelemetry SDK and OTLP/gRPC exporter."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanKind, StatusCode
from otlp_collector import CollectedSpan, OtlpCollector

pytestmark = pytest.mark.timeout(30)


def _provider(collector: OtlpCollector, service_name: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=collector.endpoint, insecure=True, timeout=5)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
    return provider


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def _by_name(spans: list[CollectedSpan]) -> dict[str, CollectedSpan]:
    return {s.name: s for s in spans}


@pytest.fixture
def collector():
    with OtlpCollector() as c:
        yield c


def test_endpoint_is_insecure_http_on_loopback(collector):
    assert collector.endpoint == f"http://127.0.0.1:{collector.port}"
    assert collector.port > 0
    # The exporter infers an insecure channel from the http:// scheme, with no insecure= argument.
    exporter = OTLPSpanExporter(endpoint=collector.endpoint)
    try:
        assert exporter._insecure is True
        assert exporter._endpoint == f"127.0.0.1:{collector.port}"
    finally:
        exporter.shutdown()


def test_sdk_exporter_spans_arrive_with_ids_links_attributes_events(collector):
    provider = _provider(collector, "svc-a")
    try:
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("parent", kind=SpanKind.SERVER) as parent:
            parent.set_attribute("tenant", "t1")
            with tracer.start_as_current_span("child") as child:
                child.set_attribute("pages", 3)
                child.set_attribute("ratio", 0.5)
                child.set_attribute("hit", True)
                child.set_attribute("tags", ["a", "b"])
                child.set_attribute("sizes", [1, 2, 3])
                child.add_event("cache-hit", {"n": 1})
                child.add_event("done")
                child.set_status(StatusCode.ERROR, "boom")
        linked = tracer.start_span("linked", links=[Link(parent.get_span_context()), Link(child.get_span_context())])
        linked.end()
        assert provider.force_flush(5_000)

        spans = collector.wait_for(lambda s: {"parent", "child", "linked"} <= {x.name for x in s}, timeout_s=5)
    finally:
        provider.shutdown()

    got = _by_name(spans)
    assert len(spans) == 3
    p, c, ln = got["parent"], got["child"], got["linked"]
    pctx, cctx, lctx = parent.get_span_context(), child.get_span_context(), linked.get_span_context()

    assert {s.service_name for s in spans} == {"svc-a"}
    assert p.trace_id == _hex(pctx.trace_id, 32) and len(p.trace_id) == 32 and p.trace_id == p.trace_id.lower()
    assert p.span_id == _hex(pctx.span_id, 16) and len(p.span_id) == 16
    assert p.parent_span_id == "" and p.is_root
    assert c.trace_id == p.trace_id and c.span_id == _hex(cctx.span_id, 16)
    assert c.parent_span_id == p.span_id and not c.is_root

    assert ln.parent_span_id == "" and ln.trace_id == _hex(lctx.trace_id, 32) and ln.trace_id != p.trace_id
    assert ln.links == ((p.trace_id, p.span_id), (c.trace_id, c.span_id))
    assert p.links == () and c.links == ()

    assert p.attributes == {"tenant": "t1"}
    assert c.attributes == {"pages": 3, "ratio": 0.5, "hit": True, "tags": ["a", "b"], "sizes": [1, 2, 3]}
    assert c.events == ("cache-hit", "done") and p.events == ()
    assert p.kind == "SPAN_KIND_SERVER" and c.kind == "SPAN_KIND_INTERNAL"
    assert c.status_code == "STATUS_CODE_ERROR" and p.status_code == "STATUS_CODE_UNSET"
    for s in spans:
        assert 0 < s.start_ns <= s.end_ns
    assert p.start_ns <= c.start_ns <= c.end_ns <= p.end_ns

    assert collector.spans() == spans
    collector.clear()
    assert collector.spans() == []


def test_wait_for_wakes_on_a_later_export_and_keeps_services_apart(collector):
    results: list = []
    waiter = threading.Thread(
        target=lambda: results.append(
            collector.wait_for(lambda s: {x.service_name for x in s} >= {"svc-a", "svc-b"}, timeout_s=5)
        )
    )
    waiter.start()
    providers = [_provider(collector, "svc-a"), _provider(collector, "svc-b")]
    try:
        for provider in providers:
            provider.get_tracer("test").start_span(f"op-{provider.resource.attributes['service.name']}").end()
            assert provider.force_flush(5_000)
        waiter.join(5)
    finally:
        for provider in providers:
            provider.shutdown()
    assert not waiter.is_alive()
    (spans,) = results
    assert sorted((s.service_name, s.name) for s in spans) == [("svc-a", "op-svc-a"), ("svc-b", "op-svc-b")]


def test_wait_for_times_out_quickly_with_a_summary(collector):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="nothing received"):
        collector.wait_for(lambda s: bool(s), timeout_s=0.1)
    assert time.monotonic() - t0 < 1.0

    provider = _provider(collector, "svc-a")
    try:
        provider.get_tracer("test").start_span("only-span").end()
        assert provider.force_flush(5_000)
        collector.wait_for(lambda s: len(s) == 1, timeout_s=5)
    finally:
        provider.shutdown()

    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        collector.wait_for(lambda s: any(x.name == "never" for x in s), timeout_s=0.2, what="span 'never'")
    assert time.monotonic() - t0 < 1.0
    message = str(info.value)
    assert "span 'never'" in message and "svc-a: only-span" in message and "1 span(s)" in message


_CHILD = """
import sys
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

provider = TracerProvider(resource=Resource.create())  # service.name from OTEL_SERVICE_NAME
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # everything else from the environment
provider.get_tracer("child").start_span("from-child").end()
sys.stdout.write("ended\\n")
sys.stdout.flush()
sys.stdin.read()  # stay alive (no shutdown flush) until the parent has seen the span
provider.shutdown()
"""


def test_separate_process_exports_by_environment_alone(collector):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,  # http:// => insecure channel
        OTEL_BSP_SCHEDULE_DELAY="50",  # ms; the default 5000 would make the test wait 5 s
        OTEL_SERVICE_NAME="svc-child",
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "ended\n"
        t0 = time.monotonic()
        (span,) = collector.wait_for(lambda s: len(s) >= 1, timeout_s=5)
        assert time.monotonic() - t0 < 2.0  # arrived on the batch schedule, not at shutdown
        assert (span.service_name, span.name, span.parent_span_id) == ("svc-child", "from-child", "")
    finally:
        child.communicate(timeout=10)
    assert child.returncode == 0
