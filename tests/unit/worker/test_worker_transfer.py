"""Page transfers between two real workers (tiny random-weight Llamas, each on its own gRPC server on port 0): the
receiver's PullPages reads the source's ReadPages, so a prompt prefilled on the source is decoded on the receiver
with the tokens the source would sample, for float32 and int8 pools (scales included), plaintext and mutual TLS.
Every failure of the source (another epoch, its lease in the margin, another layout, stopped mid-stream, not
there) is an answer with an error, after which the request recomputes on the receiver and samples the same; a
malformed order is INVALID_ARGUMENT and an order for another receiver epoch FAILED_PRECONDITION. The pull is a
child span of the request's, the source's read a child of the pull.

    PAGE=16, 20 full pages (320 tokens) + 1 token; a float32 page value is 64 KiB: 15 pages a frame, 2 frames
    source table: pages 20..40              receiver table: pages 0..20 (0..19 pulled, 20 computed)
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import grpc
import pytest
import torch
import xxhash
from free_ports import free_port
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tls_certs import make_ca

from kvserve.common.convert.transfer import pull_order_to_proto, pull_result_from_proto
from kvserve.common.convert.worker import batch_to_proto, info_from_proto, output_from_proto
from kvserve.common.grpc_server import start_grpc_server
from kvserve.common.metrics import WorkerMetrics
from kvserve.common.tls import load_tls, open_channel
from kvserve.common.wire.transfer import LEASE_MARGIN_MS, PeerLoad, PullOrder
from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem
from kvserve.v1 import worker_pb2, worker_pb2_grpc
from kvserve.worker.page_codec import value_size
from kvserve.worker.peer_client import GrpcPageReader
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.server import SERVICE_NAME, start_worker_server
from kvserve.worker.servicer import WorkerServicer
from kvserve.worker.transfer import PeerTransfers
from kvserve.worker.weights import random_weights

PAGE, NUM_PULLED = 16, 20
CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# A DeepSeek-V3 with MLA (dense MLPs): a page holds one latent plane, and is pulled the same way.
MLA_CONFIG = {**CONFIG, "model_type": "deepseek_v3", "kv_lora_rank": 32, "qk_rope_head_dim": 16,
              "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": None, "first_k_dense_replace": 2,
              "n_routed_experts": 0}
PROMPT = tuple((7 * i + 3) % 256 for i in range(NUM_PULLED * PAGE + 1))
SRC_TABLE, DST_TABLE = tuple(range(20, 41)), tuple(range(21))
NS = xxhash.xxh3_128_digest(b"tenant model")
HASHES = [xxhash.xxh3_128_digest(NS + i.to_bytes(2, "little")) for i in range(NUM_PULLED)]
TOP = SamplingParams(top_logprobs=3)
TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE}-b7ad6b7169203331-01"


@dataclasses.dataclass
class Worker:
    runner: ModelRunner
    server: object
    address: str
    stub: worker_pb2_grpc.WorkerServiceStub

    def step(self, *items: StepItem):
        return output_from_proto(self.stub.Step(batch_to_proto(StepBatch(items, self.runner.epoch)), timeout=60))

    def pull(self, order: PullOrder):
        return pull_result_from_proto(self.stub.PullPages(pull_order_to_proto(order), timeout=60))


@pytest.fixture
def make_worker(tmp_path):
    """``make(kv_cache_dtype=..., tls=..., reader=..., transfers=..., tracer=..., role=..., metrics=...,
    config=...) -> Worker``, stopped after."""
    made: list[tuple[Worker, grpc.Channel]] = []

    def make(kv_cache_dtype="auto", tls=None, reader=None, transfers=None, tracer=None, role="both",
             metrics=None, config=CONFIG) -> Worker:
        model_dir = tmp_path / config["model_type"]
        if not model_dir.exists():
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(config))
        cfg = RunnerConfig(model_dir=model_dir, num_pages=48, page_size=PAGE, device="cpu", dtype="float32",
                           attention_backend="reference", kv_cache_dtype=kv_cache_dtype, role=role)
        runner = ModelRunner(cfg, make_weights=lambda m, dtype, device: random_weights(m, dtype, device, std=0.1))
        if transfers is None and tracer is None:
            server = start_worker_server(runner, tls=tls, reader=reader, metrics=metrics)
        else:  # wired by hand, as start_worker_server does, to give the servicer its transfers or tracer
            servicer = WorkerServicer(runner, transfers=transfers(runner) if transfers else None)
            if reader is not None:
                servicer.transfers.reader = reader
            servicer.tracer = tracer or servicer.tracer
            server = start_grpc_server("127.0.0.1", 0, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
                servicer, s), (SERVICE_NAME,), max_threads=32)
        address = f"127.0.0.1:{server.port}"
        channel = open_channel(address, tls)
        made.append((Worker(runner, server, address, worker_pb2_grpc.WorkerServiceStub(channel)), channel))
        return made[-1][0]

    yield make
    for worker, channel in made:
        channel.close()
        worker.server.stop(0)


def prefill(source: Worker):
    """The prompt's first 320 tokens on the source; returns what the source samples for its last token."""
    source.step(StepItem("r", PROMPT[:-1], 0, SRC_TABLE, sample=False))
    return source.step(StepItem("r", PROMPT[-1:], len(PROMPT) - 1, SRC_TABLE, sampling=TOP)).sampled


def order_for(source: Worker, receiver: Worker, lease_ms: float = 30_000, **changes) -> PullOrder:
    pages = zip(DST_TABLE[:NUM_PULLED], SRC_TABLE[:NUM_PULLED], HASHES, strict=True)
    loads = tuple(PeerLoad(d, s, h, NS) for d, s, h in pages)
    order = PullOrder("r", receiver.runner.epoch, "w-src", source.runner.epoch, source.address,
                      int(time.time() * 1000 + lease_ms), loads)
    return dataclasses.replace(order, **changes)


def pages_equal(source: Worker, receiver: Worker) -> bool:
    """The pulled pages hold the source's bytes, and scales."""
    s, r = source.runner, receiver.runner
    src, dst = list(SRC_TABLE[:NUM_PULLED]), list(DST_TABLE[:NUM_PULLED])
    same = s.kv_cache[:, :, src].view(torch.uint8).equal(r.kv_cache[:, :, dst].view(torch.uint8))
    return same and (s.kv_scales is None or s.kv_scales[:, :, src].equal(r.kv_scales[:, :, dst]))


def decode_on(receiver: Worker, recompute: bool):
    """The prompt's last token on the receiver, over the pulled pages or after recomputing them."""
    if recompute:
        receiver.step(StepItem("r", PROMPT[:-1], 0, DST_TABLE, sample=False))
    return receiver.step(StepItem("r", PROMPT[-1:], len(PROMPT) - 1, DST_TABLE, sampling=TOP)).sampled


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_pulled_prompt_decodes_on_the_receiver_as_on_the_source(make_worker, kv_cache_dtype):
    metrics = WorkerMetrics(), WorkerMetrics()
    source = make_worker(kv_cache_dtype, role="prefill", metrics=metrics[0])
    receiver = make_worker(kv_cache_dtype, role="decode", metrics=metrics[1])
    roles = [info_from_proto(w.stub.Info(worker_pb2.InfoRequest(), timeout=10)).role for w in (source, receiver)]
    assert roles == ["prefill", "decode"]
    expected = prefill(source)
    result = receiver.pull(order_for(source, receiver))
    assert result.ok and result.num_pages == NUM_PULLED and result.seconds > 0
    assert result.num_bytes == NUM_PULLED * value_size(source.runner.kv_cache, source.runner.kv_scales)
    assert (source.runner.kv_scales is not None) == (kv_cache_dtype == "int8")
    assert pages_equal(source, receiver)
    assert decode_on(receiver, recompute=False) == expected  # token, logprob and top logprobs, exactly
    served, pulled = (m.registry.get_sample_value for m in metrics)
    assert (pulled("kvserve:worker_pulls_total", {"result": "ok"}), pulled("kvserve:worker_pull_seconds_count"),
            pulled("kvserve:worker_pulled_bytes_total")) == (1, 1, result.num_bytes)
    assert served("kvserve:worker_served_bytes_total") == result.num_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_mla_latent_pages_are_pulled_and_decode_as_on_the_source(make_worker, kv_cache_dtype):
    source = make_worker(kv_cache_dtype, role="prefill", config=MLA_CONFIG)
    receiver = make_worker(kv_cache_dtype, role="decode", config=MLA_CONFIG)
    assert source.runner.kv_cache.shape[1] == 1  # one latent plane, not K and V
    expected = prefill(source)
    result = receiver.pull(order_for(source, receiver))
    assert result.ok and result.num_pages == NUM_PULLED
    assert result.num_bytes == NUM_PULLED * value_size(source.runner.kv_cache, source.runner.kv_scales)
    assert pages_equal(source, receiver)
    assert decode_on(receiver, recompute=False) == expected


def test_a_pull_over_mutual_tls_uses_the_workers_own_certificate(make_worker, tmp_path):
    ca = make_ca(tmp_path / "tls")
    issued = [ca.issue(tmp_path / "tls", name, server=True) for name in ("src", "dst")]
    tls = [load_tls(i.cert, i.key, ca.cert, server=True) for i in issued]
    source, receiver = make_worker(tls=tls[0]), make_worker(tls=tls[1])
    expected = prefill(source)
    assert receiver.pull(order_for(source, receiver)).ok
    assert decode_on(receiver, recompute=False) == expected
    stranger = make_worker()  # no certificate: the source's handshake refuses it
    result = stranger.pull(order_for(source, stranger))
    assert not result.ok and "UNAVAILABLE" in result.error, result


def assert_failed_then_recomputes(receiver: Worker, result, expected, why: str) -> None:
    assert not result.ok and why in result.error, result
    assert decode_on(receiver, recompute=True) == expected


def test_a_source_that_refuses_or_is_not_there_fails_the_pull_and_the_request_recomputes(make_worker):
    source, receiver = make_worker(), make_worker()
    expected = prefill(source)
    cases = {"FAILED_PRECONDITION: read of pages of epoch": order_for(source, receiver,
                                                                      source_epoch=source.runner.epoch + 1),
             "under the 2000 ms margin": order_for(source, receiver, lease_ms=LEASE_MARGIN_MS - 500),
             "lease was over": order_for(source, receiver, lease_ms=-1),
             "UNAVAILABLE": order_for(source, receiver, source_address=f"127.0.0.1:{free_port()}")}
    for why, order in cases.items():
        result = receiver.pull(order)
        assert result.num_pages == 0
        assert_failed_then_recomputes(receiver, result, expected, why)


def test_a_source_of_another_layout_fails_verification_and_the_request_recomputes(make_worker):
    source, receiver = make_worker("int8"), make_worker()
    prefill(source)
    expected = prefill(make_worker())  # what a float32 worker samples
    result = receiver.pull(order_for(source, receiver))
    assert_failed_then_recomputes(receiver, result, expected, "failed verification: layout")


def test_a_source_stopped_mid_stream_fails_the_pull_and_the_request_recomputes(make_worker):
    checks, holder = [0], {}

    def clock_that_stops_the_server():  # the source's clock, read before each frame (and once before them)
        checks[0] += 1
        if checks[0] == 3:  # the second frame: the server goes away under it
            holder["server"].server.stop(0).wait(5)
        return time.time() * 1000

    source = make_worker(transfers=lambda r: PeerTransfers(r.kv_cache, r.kv_scales, lambda: r.epoch,
                                                           wall_ms=clock_that_stops_the_server))
    holder["server"] = source.server
    receiver = make_worker()
    expected = prefill(source)
    result = receiver.pull(order_for(source, receiver))
    assert result.num_pages <= 15 and checks[0] == 3
    assert_failed_then_recomputes(receiver, result, expected, "source w-src")


def test_a_malformed_order_is_invalid_argument_and_another_epoch_failed_precondition(make_worker):
    source, receiver = make_worker(), make_worker()
    bad = order_for(source, receiver)
    bad = dataclasses.replace(bad, loads=(dataclasses.replace(bad.loads[0], page_id=48),))
    with pytest.raises(grpc.RpcError) as e:
        receiver.pull(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_id 48 is out of range" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        receiver.pull(order_for(source, receiver, epoch=receiver.runner.epoch + 1))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "this worker is epoch" in e.value.details()
    assert dict(e.value.trailing_metadata()).get("kvserve-req-id") == "r"


def test_the_pull_is_a_child_span_of_the_request_and_the_read_a_child_of_the_pull(make_worker):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    source = make_worker(tracer=provider.get_tracer("source"))
    receiver = make_worker(tracer=provider.get_tracer("receiver"), reader=GrpcPageReader(None, 1 << 20))
    prefill(source)
    result = receiver.pull(order_for(source, receiver, traceparent=PARENT))
    assert result.ok
    spans = {s.name: s for s in exporter.get_finished_spans()}
    pull, read = spans["worker.pull"], spans["worker.read_pages"]
    assert format(pull.context.trace_id, "032x") == TRACE and format(pull.parent.span_id, "016x") == "b7ad6b7169203331"
    assert read.parent.span_id == pull.context.span_id and read.context.trace_id == pull.context.trace_id
    assert pull.attributes["kvserve.source_worker_id"] == "w-src" and pull.attributes["kvserve.ok"]
    assert pull.attributes["kvserve.num_pages"] == NUM_PULLED
    assert pull.attributes["kvserve.num_bytes"] == result.num_bytes
    assert pull.attributes["kvserve.mb_per_s"] > 0 and "kvserve.error" not in pull.attributes
    assert read.attributes["kvserve.num_sent_pages"] == NUM_PULLED


def test_pulls_run_beside_a_step_in_both_directions(make_worker):
    """Each worker pulls from the other while the other steps: no thread of either waits on the other's."""
    a, b = make_worker(), make_worker()
    prefill(a)
    prefill(b)
    results = {}

    def pull(name, src, dst):
        results[name] = dst.pull(order_for(src, dst))

    threads = [threading.Thread(target=pull, args=("ab", a, b)), threading.Thread(target=pull, args=("ba", b, a))]
    for t in threads:
        t.start()
    a.step(StepItem("x", PROMPT[:64], 0, (41, 42, 43, 44), sample=False))
    for t in threads:
        t.join(30)
    assert results["ab"].ok and results["ba"].ok


def test_a_runner_of_an_unknown_role_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match="role 'mixed' is not one of both, prefill, decode"):
        ModelRunner(RunnerConfig(model_dir=tmp_path, num_pages=4, device="cpu", role="mixed"))


def test_a_pull_verifies_the_source_by_the_peer_server_name_when_one_is_given(make_worker, tmp_path):
    """--peer-tls-server-name: the source is dialled at 127.0.0.1 but verified by the name given (on Kubernetes
    the pod IP it advertises, against the name the shared certificate carries). A name its certificate does
    not carry fails the pull; one it carries succeeds."""
    ca = make_ca(tmp_path / "tls")
    issued = [ca.issue(tmp_path / "tls", name, server=True) for name in ("src", "dst", "dst2")]
    tls = [load_tls(i.cert, i.key, ca.cert, server=True) for i in issued]
    source = make_worker(tls=tls[0])
    expected = prefill(source)
    value_bytes = value_size(source.runner.kv_cache, source.runner.kv_scales)
    wrong = make_worker(tls=tls[1], reader=GrpcPageReader(tls[1], value_bytes, "kvserve-worker"))
    result = wrong.pull(order_for(source, wrong))
    assert not result.ok and "UNAVAILABLE" in result.error, result
    named = make_worker(tls=tls[2], reader=GrpcPageReader(tls[2], value_bytes, "localhost"))
    assert named.pull(order_for(source, named)).ok
    assert decode_on(named, recompute=False) == expected
