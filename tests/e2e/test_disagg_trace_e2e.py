"""One disaggregated request is one trace: the gateway's request span, the prefill chunks on the prefill worker,
the decode worker's pull with the prefill worker's read under it, the kvmanager's page ops, and the decode
worker's last chunk and decode steps; the services are separate processes exporting to the test's own OTLP
collector, each worker naming itself (service.instance.id)."""

from __future__ import annotations

import contextlib
import json
import re

from otlp_collector import OtlpCollector
from polling import wait_for
from service_process import service_process
from test_cli_process import cli_env

from kvserve.services.client import Client

READY = re.compile(r"^kvserve \S+(?: \S+)? ready on (?P<host>[\d.]+):(?P<port>\d+)")
SPAN_TIMEOUT_S = 30.0
PAGE_SIZE = 16
PROMPT = "The railway timetable for the summer season lists every train from Paris to Lyon. " * 6


def test_a_request_prefilled_on_one_worker_and_decoded_on_another_is_one_trace(tmp_path):
    with OtlpCollector() as collector, contextlib.ExitStack() as stack:
        env = cli_env(OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint, OTEL_BSP_SCHEDULE_DELAY="50")
        env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"key-a": "tenant-a"}))

        def start(name, *args):
            _, match = stack.enter_context(service_process([*args, "--port", "0"], READY, env,
                                                           tmp_path / f"{name}.stderr", 120.0))
            return f"{match['host']}:{match['port']}"

        kvmanager = start("kvmanager", "kvmanager", "--data-dir", str(tmp_path / "data"))
        for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            start(worker_id, "worker", "--worker-id", worker_id, "--role", role, "--num-pages", "64",
                  "--kvmanager", kvmanager)
        gateway = start("gateway", "gateway", "--kvmanager", kvmanager, "--api-keys-file", str(keys),
                        "--max-local-prefill", "16")
        log = tmp_path / "gateway.stderr"
        for worker_id in ("prefill-0", "decode-0"):  # the gateway follows the membership: both served first
            wait_for(lambda w=worker_id: f"membership: worker {w} joined at" in log.read_text(),
                     f"the gateway serves {worker_id}", SPAN_TIMEOUT_S)
        with Client(gateway, api_key="key-a", timeout_s=120) as client:
            result = client.complete(prompt=PROMPT, max_tokens=4)
        req_id = result.req_id

        def complete(spans):  # every span the asserts read, the decode steps exported in a later batch included
            mine = [s for s in spans if s.attributes.get("kvserve.req_id") == req_id]
            requests = [(s.trace_id, s.span_id) for s in mine if s.name == "gateway.request"]
            return {"gateway.request", "worker.pull", "worker.prefill_chunk"} <= {s.name for s in mine} and \
                any(s.name == "worker.read_pages" for s in spans) and \
                any(s.name == "worker.decode_step" and set(requests) & set(s.links) for s in spans) and \
                any(s.service_name == "kvserve-kvmanager" and s.trace_id in {t for t, _ in requests} for s in spans)

        spans = collector.wait_for(complete, SPAN_TIMEOUT_S, what=f"the spans of {req_id}")
        (request,) = [s for s in spans if s.name == "gateway.request" and s.attributes["kvserve.req_id"] == req_id]
        trace = [s for s in spans if s.trace_id == request.trace_id]
        chunks = sorted((s for s in trace if s.name == "worker.prefill_chunk"), key=lambda s: s.start_ns)
        (pull,) = [s for s in trace if s.name == "worker.pull"]
        (read,) = [s for s in trace if s.name == "worker.read_pages"]
        num_prompt = result.usage.prompt_tokens
        # the whole prompt prefills on prefill-0 (which samples the first token); decode-0 computes none of it
        assert {c.service_instance for c in chunks} == {"prefill-0"}
        assert sum(c.attributes["kvserve.num_tokens"] for c in chunks) == num_prompt
        # the pull: decode-0's, a child of the request span; prefill-0's read, a child of the pull; every page of
        # the prompt, its last partial one included
        assert pull.service_instance == "decode-0" and pull.parent_span_id == request.span_id
        assert read.service_instance == "prefill-0" and read.parent_span_id == pull.span_id
        assert pull.attributes["kvserve.num_filled_pages"] == -(-num_prompt // PAGE_SIZE)
        assert max(c.end_ns for c in chunks if c.service_instance == "prefill-0") <= pull.start_ns
        assert "prefilled" in request.events and "pulled" in request.events
        decodes = [s for s in spans if s.name == "worker.decode_step" and (request.trace_id, request.span_id) in
                   s.links]
        assert decodes and {s.service_instance for s in decodes} == {"decode-0"}
        assert {s.service_name for s in trace} >= {"kvserve-gateway", "kvserve-kvmanager", "kvserve-worker"}
