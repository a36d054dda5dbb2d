"""One request's trace across the three services, and their metrics, with the services as separate processes
exporting to an OTLP collector of the test's own (opentelemetry-proto's TraceService on a free port)."""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from otlp_collector import OtlpCollector
from prometheus_client.parser import text_string_to_metric_families
from service_process import service_process
from test_cli_process import cli_env

from kvserve.services.client import Client

PROMPT = "The railway timetable for the summer season lists every train from Paris to Lyon. " * 3
READY = re.compile(r"^kvserve \S+(?: \S+)? ready on (?P<host>[\d.]+):(?P<port>\d+).*metrics on [\d.]+:(?P<metrics>\d+)")
SPAN_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as c:
        yield c


@pytest.fixture(scope="module")
def stack(tmp_path_factory, collector, model_dir):
    """kvmanager, worker and gateway as three processes, tracing to the collector, metrics on free ports."""
    tmp = tmp_path_factory.mktemp("observability")
    env = cli_env(OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint, OTEL_BSP_SCHEDULE_DELAY="50")
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a"}))
    with contextlib.ExitStack() as stack:
        def start(name, *args):
            _, match = stack.enter_context(service_process([*args, "--port", "0", "--metrics-port", "0"], READY, env,
                                                           tmp / f"{name}.stderr", 120.0))
            http = re.search(r"\(HTTP (\S+),", match.string)  # the gateway's OpenAI API
            return f"{match['host']}:{match['port']}", f"http://{match['host']}:{match['metrics']}/metrics", http

        kvmanager, kv_metrics, _ = start("kvmanager", "kvmanager", "--data-dir", str(tmp / "data"))
        worker, worker_metrics, _ = start("worker", "worker", "--num-pages", "128")
        gateway, gateway_metrics, http = start("gateway", "gateway", "--kvmanager", kvmanager, "--workers", worker,
                                               "--api-keys-file", str(keys), "--http-port", "0")
        yield {"gateway": gateway, "http": http[1], "metrics": {"gateway": gateway_metrics, "kvmanager": kv_metrics,
                                               "worker": worker_metrics}}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_one_request_is_one_trace_across_gateway_kvmanager_and_worker(stack, collector):
    client_tracer = TracerProvider(resource=Resource.create({"service.name": "test-client"})).get_tracer("test")
    with Client(stack["gateway"], api_key="key-a", timeout_s=60) as client:
        with client_tracer.start_as_current_span("client-call") as client_span:
            result = client.complete(prompt=PROMPT, max_tokens=4)
    trace_id = f"{client_span.get_span_context().trace_id:032x}"

    def complete(spans):
        names = {(s.service_name, s.name) for s in spans if s.trace_id == trace_id}
        decode_links = [s for s in spans if s.name == "worker.decode_step" and any(t == trace_id for t, _ in s.links)]
        return {("kvserve-gateway", "gateway.request"), ("kvserve-kvmanager", "kvmanager.allocate"),
                ("kvserve-kvmanager", "kvmanager.free"), ("kvserve-worker", "worker.prefill_chunk")} <= names \
            and decode_links

    spans = collector.wait_for(complete, SPAN_TIMEOUT_S, what=f"trace {trace_id}")
    (request,) = [s for s in spans if s.trace_id == trace_id and s.name == "gateway.request"]
    assert request.parent_span_id == f"{client_span.get_span_context().span_id:016x}"  # SDK -> gateway
    assert request.attributes["kvserve.req_id"] == result.req_id
    assert request.attributes["kvserve.tenant"] == "tenant-a"
    assert request.attributes["kvserve.prompt_tokens"] == result.usage.prompt_tokens
    assert request.attributes["kvserve.num_cached_tokens"] == result.usage.cached_tokens
    assert request.attributes["kvserve.finish_reason"] == "length"
    assert "admitted" in request.events
    in_trace = [s for s in spans if s.trace_id == trace_id and s.service_name != "kvserve-gateway"]
    assert {s.service_name for s in in_trace} == {"kvserve-kvmanager", "kvserve-worker"}
    assert all(s.parent_span_id == request.span_id for s in in_trace)  # children of the request span
    (allocate,) = [s for s in in_trace if s.name == "kvmanager.allocate"]
    assert allocate.attributes["kvserve.tenant"] == "tenant-a"
    assert allocate.attributes["kvserve.num_cached_tokens"] == result.usage.cached_tokens
    decodes = [s for s in spans if s.name == "worker.decode_step" and (trace_id, request.span_id) in s.links]
    assert decodes and all(s.service_name == "kvserve-worker" for s in decodes)  # linked, not children


def test_an_http_request_joins_the_traceparent_it_sent_and_is_counted(stack, collector):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    reply = httpx.post(stack["http"] + "/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                       headers={"authorization": "Bearer key-a", "traceparent": f"00-{trace_id}-{parent_id}-01"},
                       timeout=60)
    assert reply.status_code == 200
    spans = collector.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "gateway.request"
                                                 for s in spans), SPAN_TIMEOUT_S, what=f"trace {trace_id}")
    (request,) = [s for s in spans if s.trace_id == trace_id and s.name == "gateway.request"]
    assert request.parent_span_id == parent_id  # the HTTP client's span is its parent
    assert f"cmpl-{request.attributes['kvserve.req_id']}" == reply.json()["id"]
    assert httpx.post(stack["http"] + "/completions", json={"prompt": "x"}, timeout=60).status_code == 401
    gw = scrape(stack["metrics"]["gateway"])
    assert value(gw, "kvserve:http_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert value(gw, "kvserve:http_requests_total", endpoint="/v1/completions", status="401") >= 1


def test_metrics_move_with_traffic(stack):
    urls = stack["metrics"]
    before = scrape(urls["kvmanager"])
    with Client(stack["gateway"], api_key="key-a", timeout_s=60) as client:
        prompt = "A different prompt about night trains and sleeping cars, " * 4
        client.complete(prompt=prompt, max_tokens=2)
        client.complete(prompt=prompt, max_tokens=2)  # hits the first one's pages
        stream = client.generate(prompt="Count slowly:", max_tokens=200, ignore_eos=True)
        next(iter(stream))
        stream.cancel()
        client.complete(prompt="Hi", max_tokens=1)  # its last delta comes after the cancelled one's free
    kv, gw, worker = (scrape(urls[k]) for k in ("kvmanager", "gateway", "worker"))
    hits = "kvserve:prefix_cache_hits_total"
    assert value(kv, hits, tenant="tenant-a") > value(before, hits, tenant="tenant-a")
    assert value(kv, "kvserve:prefix_cache_queries_total", tenant="tenant-a") > 0
    assert value(kv, "kvserve:kv_cache_usage_perc", worker_id="worker-0", kv_dtype="float32") == 0.0  # everything freed
    assert value(kv, "kvserve:kvmanager_rpc_seconds_count", method="StepPages") > 0
    assert value(kv, "kvserve:redis_write_seconds_count") > 0
    assert value(kv, "kvserve:call_log_records") > 0  # the default store: calls since the last snapshot
    assert value(gw, "kvserve:num_requests_running", worker_id="worker-0") == 0
    assert value(gw, "kvserve:num_requests_waiting", worker_id="worker-0") == 0
    assert value(gw, "kvserve:time_to_first_token_seconds_count") >= 4
    assert value(gw, "kvserve:request_success_total", finish_reason="cancelled") == 1
    assert value(gw, "kvserve:generation_tokens_total", tenant="tenant-a") >= 5
    assert 0 < value(gw, "kvserve:kvmanager_wait_fraction", worker_id="worker-0") < 1
    assert value(worker, "kvserve:worker_step_seconds_count") > 0
    assert value(worker, "kvserve:worker_batch_tokens_sum") > 0
