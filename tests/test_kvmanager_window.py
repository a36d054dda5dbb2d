"""Sliding-window KV and attention sinks in the kvmanager: a windowed pool's spec on the wire, window releases
(holes in a request's page table) with exact pages, ref_cnts, LRU and free-list order, their validation, and
their persistence (call log replay, snapshots, recovery).

    sliding_window = 8, attention_sinks = 4, page_size = 4: page 0 holds the sinks and is never released
    page_table  [ 0 | 1 | 2 | 3 | 4 ]   -- release (1, 2) -->   [ 0 | HOLE | HOLE | 3 | 4 ]
"""

from __future__ import annotations

from kvserve.common.convert import pages as page_cv
from kvserve.common.convert import worker as worker_cv
from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.worker import WorkerInfo

PS = 4  # page size


def test_a_windowed_pools_spec_crosses_the_wire_from_worker_info_to_registration():
    info = WorkerInfo("w0", 3, "mistral", "fp", PS, 16, "float32", 100, 100 * PS * 16, 2, 2, 4, 8, 1000, 4096,
                      (2,), "cpu", "reference", "", 1024, 4)
    back = worker_cv.info_from_proto(worker_cv.info_to_proto(info))
    assert back == info and (back.sliding_window, back.attention_sinks) == (1024, 4)
    spec = PoolSpec.of(back)
    assert spec == PoolSpec("w0", 3, 16, PS, "fp", "float32", 100, "", 1024, 4)
    msg = page_cv.spec_to_proto(spec)
    assert (msg.sliding_window, msg.attention_sinks) == (1024, 4)
    assert page_cv.spec_from_proto(msg) == spec
    # a dense worker's Info (the fields unset) is a pool without a window
    dense = WorkerInfo("w1", 1, "llama", "fp", PS, 16, "float32", 100, 100 * PS * 16, 2, 2, 4, 8, 1000, 4096,
                       (2,), "cpu", "reference")
    assert page_cv.spec_from_proto(page_cv.spec_to_proto(PoolSpec.of(dense))).sliding_window == 0
