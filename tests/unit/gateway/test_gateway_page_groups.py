"""The gateway's scheduler on a worker with page groups (a model mixing full-attention and sliding-window layers),
against the real kvmanager domain: each request has a page table per group, its full layers keep every page and
its sliding layers release the pages that fall out of their window, at every step.

The worker is a rule (the token sampled after position p is 100 + p) that keeps the token written at each slot of
both pools and checks, at every step, that every key a query reads is where its page table says: the full table
for every position, the sliding table for the window. A page released too early, or handed to another request
while still read, fails the check.
"""

from __future__ import annotations

from scheduler_steps import drain, request, run_step

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.pages import HOLE
from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.worker import SampledToken, StepBatch, StepOutput, WorkerInfo
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.services.gateway.core import EngineCore, scheduler_config
from kvserve.services.gateway.inprocess import InProcessKVManager

PS = 4
WINDOW = 8  # the sliding layers' window: two pages


class GroupedWorker:
    """Two pools of token ids (slot -> the token written there), one per group."""

    address = "in-process"

    def __init__(self, info: WorkerInfo):
        self._info, self.batch = info, StepBatch(())
        self.full: dict[int, int] = {}
        self.sliding: dict[int, int] = {}

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        return self._info

    def step(self, batch: StepBatch, traceparents=None) -> StepOutput:
        self.batch = batch
        for item in batch.items:
            self._compute(item)
        sampled = [SampledToken(i.req_id, 100 + i.end_pos, 0.0) for i in batch.items if i.sample]
        return StepOutput(sampled, sum(len(i.token_ids) for i in batch.items), 0.0)

    def _compute(self, item) -> None:
        full, sliding = item.page_table, item.group_page_table
        assert len(full) * PS >= item.end_pos and len(sliding) * PS >= item.end_pos, item
        assert HOLE not in full, f"{item.req_id}: a full layers' page was released"
        context = [self.full[slot(full, p)] for p in range(item.start_pos)] + list(item.token_ids)
        for offset, token in enumerate(item.token_ids):
            p = item.start_pos + offset
            self.full[slot(full, p)] = self.sliding[slot(sliding, p)] = token
        # every key the chunk's queries read in the sliding layers: the first query's window through the last
        for p in range(max(0, item.start_pos - WINDOW + 1), item.end_pos):
            assert sliding[p // PS] != HOLE, f"{item.req_id}: position {p} read from a released sliding page"
            assert self.sliding[slot(sliding, p)] == context[p], f"{item.req_id}: sliding page of {p} overwritten"

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


def slot(page_table, position: int) -> int:
    return page_table[position // PS] * PS + position % PS


def grouped_setup(num_pages=40, sliding_pages=10, budget=8, max_num_seqs=8):
    mgr = KVManager()
    info = WorkerInfo("w0", 1, "position", "fp", PS, num_pages, "float32", 1, 1, 1, 1, 1, 1, 49152, 1000, (0,),
                      "cpu", "position", sliding_group_pages=sliding_pages, sliding_group_window=WINDOW,
                      sliding_group_bytes_per_token=1)
    mgr.register_worker(PoolSpec.of(info))
    cfg = scheduler_config(info, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    assert cfg.group_window == AttentionWindow(WINDOW) and not cfg.window.slides
    return mgr, EngineCore(GroupedWorker(info), info, InProcessKVManager(mgr), cfg)


def held(table) -> list[int]:
    return [p for p in table if p != HOLE]


def test_page_group_bounds_at_every_step_of_a_request_longer_than_the_sliding_pool():
    """60 prompt and 40 new tokens, pages of 4: 25 pages in the full layers' pool, while the sliding layers' pool
    has 10. At every step the full table holds every page (no hole, as the kvmanager has it) and the sliding
    table at most the window of the step's chunk; both copies of the gateway agree with the kvmanager's."""
    mgr, core = grouped_setup()
    req = request("a", range(1, 61), max_tokens=40)
    core.add(req)
    bound = AttentionWindow(WINDOW).max_pages_held(req.num_tokens, PS, chunk=8)
    most = 0
    while core.has_work():
        run_step(core, overlap=True)
        check_invariants(mgr)
        live = mgr.requests.get("a")
        if live is None:
            continue
        assert live.page_table == req.page_table and HOLE not in live.page_table
        assert len(live.page_table) * PS >= req.num_computed_tokens
        assert live.group.page_table == req.group_page_table
        most = max(most, len(held(live.group.page_table)))
        assert len(held(live.group.page_table)) <= bound
    assert req.output_token_ids == [100 + p for p in range(60, 100)]
    assert 25 > 10 >= most and most <= bound
    pool = mgr.pools["w0"]
    assert pool.num_used == 0 and pool.group.num_used == 0
    assert pool.group.num_window_released >= 25 - bound and pool.num_window_released == 0


def test_a_grouped_prefix_hit_holds_every_full_page_and_only_the_sliding_pages_its_first_chunk_reads():
    mgr, core = grouped_setup(num_pages=40, sliding_pages=24)
    core.add(request("a", range(1, 42), max_tokens=1))
    drain(core)
    core.add(request("b", range(1, 42), max_tokens=1))
    out, step = run_step(core)
    (item,) = step.items
    assert item.start_pos == 40  # 10 full pages hit in both groups; the last token is computed
    assert out.ops.allocations[0].chunk_tokens > 0
    assert HOLE not in item.page_table and len(item.page_table) == 11
    assert [k for k, p in enumerate(item.group_page_table) if p != HOLE] == [8, 9, 10]  # 33..40
    drain(core)


def test_a_sliding_page_evicted_inside_the_window_shortens_the_hit_and_the_tokens_stay_right():
    """A token counts as cached only where every group holds what reading it needs: with the sliding layers'
    block 9 (positions 36..39) gone, a hit at 40 tokens cannot be read, so the hit is shorter and those
    positions are recomputed."""
    mgr, core = grouped_setup(num_pages=40, sliding_pages=24)
    core.add(request("a", range(1, 42), max_tokens=1))
    drain(core)
    group = mgr.pools["w0"].group
    (block,) = [b for b in group.index.values() if b.block_index == 9]
    group.evict(block.page_id)
    b = request("b", range(1, 42), max_tokens=3)
    core.add(b)
    _, step = run_step(core)
    (item,) = step.items
    assert item.start_pos < 40 and item.start_pos % PS == 0
    drain(core)
    assert b.output_token_ids == [100 + p for p in range(41, 44)]


def test_requests_that_outgrow_the_sliding_pool_wait_or_are_preempted_and_finish_right():
    """Four requests whose windows do not all fit the 8-page sliding pool at once: the kvmanager answers out of
    pages for that pool (the full one has room), the gateway waits or preempts, and every token is right."""
    mgr, core = grouped_setup(num_pages=80, sliding_pages=8, budget=16)
    reqs = [request(f"r{i}", range(10 * i + 1, 10 * i + 31), max_tokens=20) for i in range(4)]
    for r in reqs:
        core.add(r)
    drain(core, overlap=True)
    for r in reqs:
        assert r.output_token_ids == [100 + p for p in range(30, 50)]
    pool = mgr.pools["w0"]
    assert pool.num_used == 0 and pool.group.num_used == 0
