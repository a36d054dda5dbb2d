"""The worker's spans of the shared KV tier (kvserve/worker/spans.py), through the servicer's Step on real runners (a
tiny random-weight Llama, a real embedded redis-server): a traced request's store loads are a child span of its own
(its pages, whether they loaded, the step's pages, bytes and failures); a step's write snapshot is one span linked
to the step's traced requests (pages queued or dropped). Untraced steps record nothing.

    PAGE=4: a 13-token prompt, its 12 first positions in 3 full pages written to the store and loaded back
"""

from __future__ import annotations

import pytest
import xxhash
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tier_runners import tier_runners

from kvserve.common.convert.worker import batch_to_proto
from kvserve.common.wire.tier import StoreLoad, StoreWrite, TierCounters
from kvserve.common.wire.worker import StepBatch, StepItem
from kvserve.worker.runner import ModelRunner, TierPart, TierStep
from kvserve.worker.servicer import WorkerServicer
from kvserve.worker.spans import record_tier_spans

PROMPT = tuple(range(7, 20))
NS = xxhash.xxh3_128_digest(b"tenant model")
HASHES = [xxhash.xxh3_128_digest(NS + bytes([i])) for i in range(3)]
WRITES = tuple(StoreWrite(p, h, NS, "t") for p, h in zip((5, 6, 7), HASHES, strict=True))
LOADS = tuple(StoreLoad(p, h, NS) for p, h in zip((1, 2, 3), HASHES, strict=True))
ABSENT = (StoreLoad(9, xxhash.xxh3_128_digest(b"never written"), NS),)
TRACE_R, TRACE_X = "0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736"
PARENTS = {"r": f"00-{TRACE_R}-b7ad6b7169203331-01", "x": f"00-{TRACE_X}-00f067aa0ba902b7-01"}


@pytest.fixture
def make_runner(tmp_path):
    with tier_runners(tmp_path) as make:
        yield make


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def served(runner: ModelRunner, exporter: InMemorySpanExporter) -> WorkerServicer:
    """The runner's servicer, its spans going to ``exporter`` (not the process' provider)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    servicer = WorkerServicer(runner)
    servicer.tracer = provider.get_tracer("test")
    return servicer


def step(servicer: WorkerServicer, batch: StepBatch, traced=("r", "x")):
    return servicer.Step(batch_to_proto(batch, {r: PARENTS[r] for r in traced}), None)


def last_token(table, loads=(), req_id="r") -> StepItem:
    return StepItem(req_id, PROMPT[12:], 12, table, store_loads=tuple(loads))


def spans_named(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def written_store(make_runner) -> ModelRunner:
    """A worker that computed the prompt and wrote its 3 full pages to the store (acknowledged)."""
    a = make_runner()
    a.tier.set_report(lambda report: None)
    a.step(StepBatch((StepItem("w", PROMPT[:12], 0, (5, 6, 7, 8), sample=False),)))
    a.step(StepBatch((), store_writes=WRITES))
    assert a.tier.flush(10.0) and a.tier.stats().num_written_pages == 3
    return a


def test_a_traced_requests_loads_are_a_child_span_with_its_pages_and_the_steps_figures(make_runner, exporter):
    a = written_store(make_runner)
    b = served(make_runner(), exporter)
    out = step(b, StepBatch((last_token((1, 2, 3, 4), LOADS), last_token((9, 10, 11, 12), ABSENT, "x"))))
    assert list(out.unloaded) == ["x"] and out.num_loaded_pages == 3
    assert b.runner.take_tier_step() is None  # the servicer took the step's
    loads = {s.attributes["kvserve.req_id"]: s for s in spans_named(exporter, "worker.store_load")}
    assert sorted(loads) == ["r", "x"]
    step_figures = {"kvserve.step_num_loaded_pages": 3,
                    "kvserve.step_num_loaded_bytes": a.tier.stats().num_written_bytes,  # the same 3 values
                    "kvserve.step_num_failed_requests": 1, "kvserve.step_num_verify_failures": 0}
    assert dict(loads["r"].attributes) == {"kvserve.req_id": "r", "kvserve.num_pages": 3, "kvserve.loaded": True,
                                           **step_figures}
    assert dict(loads["x"].attributes) == {"kvserve.req_id": "x", "kvserve.num_pages": 1, "kvserve.loaded": False,
                                           **step_figures}
    for req_id, span in loads.items():
        _, trace_id, parent_id, _ = PARENTS[req_id].split("-")
        assert span.context.trace_id == int(trace_id, 16) and span.parent.span_id == int(parent_id, 16)
        assert 0 < span.end_time - span.start_time
    # the step's own span is there as before (one token fed and sampled: a decode step), over the whole step
    (whole,) = spans_named(exporter, "worker.decode_step")
    assert whole.start_time <= loads["r"].start_time and loads["r"].end_time <= whole.end_time


def test_a_write_snapshot_is_one_span_linked_to_the_steps_traced_requests(make_runner, exporter):
    a = make_runner()
    a.tier.set_report(lambda report: None)
    servicer = served(a, exporter)
    step(servicer, StepBatch((StepItem("r", PROMPT[:12], 0, (5, 6, 7, 8), sample=False),)))
    step(servicer, StepBatch((last_token((5, 6, 7, 8)), last_token((9, 10, 11, 12), req_id="x")), store_writes=WRITES))
    (snapshot,) = spans_named(exporter, "worker.store_snapshot")
    assert dict(snapshot.attributes) == {"kvserve.num_pages": 3, "kvserve.num_queued": 3, "kvserve.num_dropped": 0,
                                         "kvserve.batch_size": 2}
    assert snapshot.parent is None
    assert sorted(link.context.trace_id for link in snapshot.links) == sorted([int(TRACE_R, 16), int(TRACE_X, 16)])
    assert a.tier.flush(10.0) and a.tier.stats().num_written_pages == 3


def test_a_snapshot_the_tier_drops_says_so(make_runner, exporter):
    servicer = served(make_runner(), exporter)  # no kvmanager to report to: every write is dropped
    step(servicer, StepBatch((last_token((9, 10, 11, 12)),), store_writes=WRITES))
    (snapshot,) = spans_named(exporter, "worker.store_snapshot")
    assert (snapshot.attributes["kvserve.num_queued"], snapshot.attributes["kvserve.num_dropped"]) == (0, 3)


def test_untraced_steps_and_workers_without_a_store_record_no_tier_spans(make_runner, exporter):
    written_store(make_runner)
    b = served(make_runner(), exporter)
    step(b, StepBatch((last_token((1, 2, 3, 4), LOADS),), store_writes=WRITES), traced=())
    plain = served(make_runner(kv_store_url=""), exporter)
    out = step(plain, StepBatch((last_token((1, 2, 3, 4), LOADS),), store_writes=WRITES))
    assert list(out.unloaded) == ["r"]
    assert not [s.name for s in exporter.get_finished_spans() if s.name.startswith("worker.store_")]


def test_spans_take_their_times_and_counts_from_the_step_s_tier_parts(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    request = batch_to_proto(StepBatch((last_token((1, 2, 3, 4), LOADS),), store_writes=WRITES), PARENTS)
    # the writer thread dropped 2 pages of an earlier snapshot meanwhile: fewer than this one's 3, so it queued
    seen = TierStep(snapshot=TierPart(100, 200, TierCounters(num_dropped_writes=5), TierCounters(num_dropped_writes=7)),
                    load=TierPart(200, 900, TierCounters(num_loaded_pages=4, num_loaded_bytes=40, num_failed_loads=1),
                                  TierCounters(num_loaded_pages=7, num_loaded_bytes=70, num_failed_loads=1,
                                               num_verify_failures=0)))
    record_tier_spans(provider.get_tracer("test"), request, [], seen)
    (snapshot,) = spans_named(exporter, "worker.store_snapshot")
    (load,) = spans_named(exporter, "worker.store_load")
    assert (snapshot.start_time, snapshot.end_time, load.start_time, load.end_time) == (100, 200, 200, 900)
    assert snapshot.attributes["kvserve.num_dropped"] == 0 and snapshot.attributes["kvserve.num_queued"] == 3
    assert (load.attributes["kvserve.step_num_loaded_pages"], load.attributes["kvserve.step_num_loaded_bytes"],
            load.attributes["kvserve.step_num_failed_requests"]) == (3, 30, 0)
