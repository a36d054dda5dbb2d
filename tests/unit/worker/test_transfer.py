"""Page transfers between workers (kvserve/worker/transfer.py) over plain pool tensors, the two sides joined by an
in-process link (the gRPC one is tests/unit/worker/test_worker_transfer.py): pages come across byte for byte, scales
too, in frames of the size asked; the source refuses another epoch, a lease within its margin and pages out of range,
also mid-stream; the receiver refuses a malformed order or another epoch, and answers every failure of the source (a
refusal, a stream cut short or too long, a value that does not verify, its own new epoch) with an error.

    pools of PAGES pages; source pages 1, 3, 4 hold blocks B0, B1, B2; the receiver's pages 6, 2, 0 take them
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash

from kvserve.common.errors import InvalidRequest, StaleEpoch
from kvserve.common.wire.transfer import LEASE_MARGIN_MS, PeerLoad, PullOrder, ReadOrder
from kvserve.worker.page_codec import value_size
from kvserve.worker.transfer import LeaseOver, PeerTransfers, TransferCounters, TransferFailed

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 8, 4, 2, 8
NOW_MS = 1_000_000.0
NS = xxhash.xxh3_128_digest(b"tenant model")
BLOCKS = [xxhash.xxh3_128_digest(NS + bytes([i])) for i in range(3)]
SRC_PAGES, DST_PAGES = (1, 3, 4), (6, 2, 0)
SRC_EPOCH, DST_EPOCH = 11, 22


def pool_of(dtype: torch.dtype, with_scales: bool, seed: int | None):
    shape = (LAYERS, 2, PAGES, PAGE, HEADS, DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype), (torch.ones(shape[:-1]) if with_scales else None)
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) if dtype == torch.int8 else
            torch.randn(shape, generator=g).to(dtype))
    return pool, (torch.rand(shape[:-1], generator=g) + 0.5 if with_scales else None)


class Link:
    """A PageReader that calls the source in-process; a refusal becomes TransferFailed, as over gRPC. ``tamper``
    may change each frame on the way."""

    def __init__(self, source: PeerTransfers, tamper=None):
        self.source, self.tamper, self.calls = source, tamper, []

    def read(self, address, order, timeout_s, traceparent=""):
        self.calls.append((address, order, timeout_s, traceparent))
        try:
            for frame in self.source.read(order):
                yield self.tamper(frame) if self.tamper else frame
        except (StaleEpoch, LeaseOver, InvalidRequest) as e:
            raise TransferFailed(f"FAILED_PRECONDITION: {e}") from None


def pair(dtype=torch.float32, with_scales=False, tamper=None, frame_bytes=None):
    src_pool, src_scales = pool_of(dtype, with_scales, seed=1)
    dst_pool, dst_scales = pool_of(dtype, with_scales, seed=None)
    kw = {"frame_bytes": frame_bytes} if frame_bytes else {}
    source = PeerTransfers(src_pool, src_scales, lambda: SRC_EPOCH, wall_ms=lambda: NOW_MS, **kw)
    receiver = PeerTransfers(dst_pool, dst_scales, lambda: DST_EPOCH, Link(source, tamper), wall_ms=lambda: NOW_MS)
    return source, receiver


def order(lease_ms: float = 30_000, **changes) -> PullOrder:
    loads = tuple(PeerLoad(d, s, b, NS) for d, s, b in zip(DST_PAGES, SRC_PAGES, BLOCKS, strict=True))
    o = PullOrder("r", DST_EPOCH, "w-src", SRC_EPOCH, "127.0.0.1:1", int(NOW_MS + lease_ms), loads, "tp")
    return dataclasses.replace(o, **changes)


def same_pages(source: PeerTransfers, receiver: PeerTransfers) -> bool:
    for s, d in zip(SRC_PAGES, DST_PAGES, strict=True):
        if not torch.equal(source.pool[:, :, s].view(torch.uint8), receiver.pool[:, :, d].view(torch.uint8)):
            return False
        if source.scales is not None and not torch.equal(source.scales[:, :, s], receiver.scales[:, :, d]):
            return False
    return True


@pytest.mark.parametrize(("dtype", "with_scales"), [(torch.float32, False), (torch.bfloat16, False),
                                                    (torch.int8, True), (torch.float8_e4m3fn, True)])
def test_pages_come_across_byte_for_byte_with_their_scales(dtype, with_scales):
    source, receiver = pair(dtype, with_scales)
    result = receiver.pull(order())
    assert result.ok and result.num_pages == 3 and result.seconds > 0
    assert result.num_bytes == 3 * value_size(source.pool, source.scales)
    assert same_pages(source, receiver)
    untouched = [p for p in range(PAGES) if p not in DST_PAGES]
    assert not receiver.pool[:, :, untouched].view(torch.uint8).any()
    link = receiver.reader
    (address, read, timeout_s, traceparent), = link.calls
    assert (address, read.epoch, read.lease_expires_ms, traceparent) == ("127.0.0.1:1", SRC_EPOCH, NOW_MS + 30_000,
                                                                         "tp")
    assert [p[0] for p in read.pages] == list(SRC_PAGES) and timeout_s == pytest.approx(30.0)
    assert receiver.stats() == TransferCounters(num_pulls_ok=1, num_pulled_pages=3, num_pulled_bytes=result.num_bytes,
                                                pull_s=result.seconds)
    assert source.stats() == TransferCounters(num_served_pages=3, num_served_bytes=result.num_bytes)


def test_frames_hold_as_many_pages_as_fit_and_at_least_one():
    source, _ = pair()
    size = value_size(source.pool, source.scales)
    pages = tuple((x.src_page_id, x.block_hash, x.namespace) for x in order().loads)
    o = ReadOrder(SRC_EPOCH, int(NOW_MS + 30_000), pages)
    for frame_bytes, sizes in ((2 * size, [2, 1]), (size // 2, [1, 1, 1]), (10 * size, [3])):
        s = PeerTransfers(source.pool, None, lambda: SRC_EPOCH, frame_bytes=frame_bytes, wall_ms=lambda: NOW_MS)
        assert [len(f) for f in s.read(o)] == sizes


def test_the_source_refuses_another_epoch_a_lease_in_its_margin_and_pages_out_of_range():
    source, receiver = pair()
    for bad, why in ((order(source_epoch=SRC_EPOCH + 1), "epoch 12, but this worker is epoch 11"),
                     (order(lease_ms=LEASE_MARGIN_MS - 1), "under the 2000 ms margin"),
                     (order(lease_ms=-5_000), "before the pull began"),
                     (order(loads=(PeerLoad(0, PAGES, BLOCKS[0], NS),)), "src_page_id 8 is out of range [0, 8)")):
        result = receiver.pull(bad)
        assert not result.ok and why in result.error and result.num_pages == 0, result
    assert not receiver.pool.any()
    assert source.stats().num_refused_reads == 3 and source.stats().num_served_pages == 0
    assert receiver.stats().num_pulls_failed == 4


def test_a_lease_that_runs_into_its_margin_mid_stream_stops_the_stream():
    clock = [NOW_MS]
    source, receiver = pair(frame_bytes=1)  # a page per frame
    source.wall_ms = lambda: clock[0]

    def late(frame):
        clock[0] += 15_000  # 30 s of lease: the second frame is sent with 15 s left, the third not
        return frame

    receiver.reader.tamper = late
    result = receiver.pull(order())
    assert not result.ok and "under the 2000 ms margin" in result.error and result.num_pages == 2
    assert source.stats() == TransferCounters(num_served_pages=2, num_served_bytes=result.num_bytes,
                                              num_refused_reads=1)


@pytest.mark.parametrize(("tamper", "why"), [
    (lambda f: f[::-1], "failed verification: the value holds another block"),
    (lambda f: [f[0][:-1] + bytes([f[0][-1] ^ 1]), *f[1:]], "does not match its checksum"),
    (lambda f: f[:2], "the stream ended after 2 of 3 pages"),
    (lambda f: [*f, f[0]], "sent more than the 3 pages asked for"),
])
def test_a_value_that_does_not_verify_or_a_wrong_count_fails_the_pull(tamper, why):
    _, receiver = pair(tamper=tamper)
    result = receiver.pull(order())
    assert not result.ok and why in result.error and "source w-src (127.0.0.1:1)" in result.error
    assert receiver.stats().num_pulls_failed == 1 and receiver.stats().num_pulls_ok == 0


def test_a_source_of_another_layout_fails_verification():
    source, _ = pair(torch.int8, with_scales=True)
    dst_pool, _ = pool_of(torch.float32, False, seed=None)
    receiver = PeerTransfers(dst_pool, None, lambda: DST_EPOCH, Link(source), wall_ms=lambda: NOW_MS)
    result = receiver.pull(order())
    assert not result.ok and "failed verification: layout" in result.error
    assert not dst_pool.any()


def test_the_receiver_refuses_another_epoch_and_a_malformed_order_before_reading():
    _, receiver = pair()
    with pytest.raises(StaleEpoch, match="pull for epoch 23, but this worker is epoch 22"):
        receiver.pull(order(epoch=DST_EPOCH + 1))
    bad_loads = {
        "page_id 8 is out of range": (PeerLoad(PAGES, 1, BLOCKS[0], NS),),
        "page_id 2 is filled twice": (PeerLoad(2, 1, BLOCKS[0], NS), PeerLoad(2, 3, BLOCKS[1], NS)),
        "src_page_id -1 is negative": (PeerLoad(2, -1, BLOCKS[0], NS),),
        "16 bytes, got 3 and 16": (PeerLoad(2, 1, b"abc", NS),),
        "no loads": (),
    }
    for why, loads in bad_loads.items():
        with pytest.raises(InvalidRequest, match=why) as e:
            receiver.pull(order(loads=loads))
        assert e.value.req_id == "r"
    with pytest.raises(InvalidRequest, match="no source address"):
        receiver.pull(order(source_address=""))
    assert receiver.reader.calls == [] and receiver.stats() == TransferCounters()


def test_a_receiver_that_becomes_a_new_incarnation_mid_pull_writes_no_more_pages():
    epoch = [DST_EPOCH]
    source, receiver = pair(frame_bytes=1)  # a page per frame

    def renew(frame):
        if source.stats().num_served_pages == 2:  # after the first page was filled
            epoch[0] = DST_EPOCH + 1
        return frame

    receiver.epoch = lambda: epoch[0]
    receiver.reader.tamper = renew
    result = receiver.pull(order())
    assert not result.ok and "became epoch 23 during the pull" in result.error and result.num_pages == 1
    assert receiver.pool[:, :, DST_PAGES[0]].any() and not receiver.pool[:, :, list(DST_PAGES[1:])].any()


def test_pulls_past_the_limit_are_refused_and_a_worker_without_a_link_fails_every_pull():
    source, receiver = pair()
    busy = PeerTransfers(receiver.pool, None, lambda: DST_EPOCH, Link(source), max_pulls=1, wall_ms=lambda: NOW_MS)
    busy._slots.acquire()
    assert "1 pulls are running on this worker already" in busy.pull(order()).error
    busy._slots.release()
    assert busy.pull(order()).ok
    lonely = PeerTransfers(receiver.pool, None, lambda: DST_EPOCH, wall_ms=lambda: NOW_MS)
    assert "no transport" in lonely.pull(order()).error


def test_the_role_flag_takes_the_three_roles_from_the_command_line_or_the_environment(monkeypatch, capsys):
    from kvserve.services.cli import build_parser

    assert build_parser().parse_args(["worker"]).role == "both"
    assert build_parser().parse_args(["worker", "--role", "prefill"]).role == "prefill"
    monkeypatch.setenv("KVSERVE_ROLE", "decode")
    assert build_parser().parse_args(["worker"]).role == "decode"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--role", "prefil"])
    assert "argument --role: role 'prefil' is not one of both, prefill, decode" in capsys.readouterr().err
    monkeypatch.setenv("KVSERVE_ROLE", "Decode")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])
    assert "role 'Decode' is not one of" in capsys.readouterr().err


def test_a_pull_whose_caller_went_away_writes_no_more_pages():
    source, receiver = pair(frame_bytes=1)  # a page per frame
    result = receiver.pull(order(), wanted=lambda: source.stats().num_served_pages < 2)
    assert not result.ok and "the pull's caller went away" in result.error and result.num_pages == 1
    assert receiver.pool[:, :, DST_PAGES[0]].any() and not receiver.pool[:, :, list(DST_PAGES[1:])].any()
