"""The gateway's scheduler against the real kvmanager domain on tiny pools: chunked prefill, decode, prefix hits,
preemption by recompute, and that every page comes back. The worker is replaced by a rule (next token =
f(position)) because what is tested here is which tokens get computed where, not the model."""

from __future__ import annotations

from scheduler_steps import drain, request, run_step

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.wire.pages import PageAllocation, PoolSpec, StepOps, StepResults
from kvserve.common.wire.worker import SampledToken, StepBatch, StepOutput, WorkerInfo
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.services.gateway.core import EngineCore
from kvserve.services.gateway.inprocess import InProcessKVManager
from kvserve.services.gateway.request import FinishReason, RequestStatus
from kvserve.services.gateway.scheduler import SchedulerConfig

PS = 4


def setup(num_pages=16, budget=8, max_num_seqs=8, prefix_caching=True, long_prefill=0, reserve_ahead=False):
    mgr = KVManager()
    mgr.register_worker(PoolSpec("w0", 1, num_pages, PS, "fp", "float32", 1))
    cfg = SchedulerConfig("w0", PS, num_pages, max_model_len=1000, eos_token_ids=(0,), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, prefix_caching=prefix_caching,
                          long_prefill_token_threshold=long_prefill, reserve_ahead=reserve_ahead)
    return mgr, core_over(mgr, cfg)


class PositionWorker:
    """The fake model: the token sampled at a position is 100 + that position. Keeps the last batch it was sent."""

    address = "in-process"

    def __init__(self, info: WorkerInfo):
        self._info, self.batch = info, StepBatch(())

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        return self._info

    def step(self, batch: StepBatch, traceparents=None) -> StepOutput:
        self.batch = batch
        sampled = [SampledToken(i.req_id, 100 + i.end_pos, 0.0) for i in batch.items if i.sample]
        return StepOutput(sampled, sum(len(i.token_ids) for i in batch.items), 0.0)

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


def core_over(mgr: KVManager, cfg: SchedulerConfig) -> EngineCore:
    info = WorkerInfo("w0", 1, "position", "fp", PS, cfg.num_pages, "float32", 1, 1, 1, 1, 1, 1, 49152,
                      cfg.max_model_len, cfg.eos_token_ids, "cpu", "position")
    return EngineCore(PositionWorker(info), info, InProcessKVManager(mgr), cfg)


def test_chunked_prefill_then_decode_exact_chunks_and_pages():
    mgr, core = setup(budget=4)
    req = request("a", range(1, 11), max_tokens=2)  # 10 prompt tokens, 3 pages
    core.add(req)
    out, step = run_step(core)
    assert [a.token_ids for a in out.ops.allocations] == [tuple(range(1, 11))]
    assert [(i.start_pos, i.token_ids, i.sample) for i in step.items] == [(0, (1, 2, 3, 4), False)]
    assert req.page_table == [0, 1, 2]
    out, step = run_step(core)
    assert [(c.start_pos, c.token_ids) for c in out.ops.commits] == [(0, (1, 2, 3, 4))]  # page 0 became full
    assert [(i.start_pos, i.token_ids, i.sample) for i in step.items] == [(4, (5, 6, 7, 8), False)]
    out, step = run_step(core)
    assert [(c.start_pos, c.token_ids) for c in out.ops.commits] == [(4, (5, 6, 7, 8))]
    assert [(i.start_pos, i.token_ids, i.sample) for i in step.items] == [(8, (9, 10), True)]
    assert req.output_token_ids == [110]
    out, step = run_step(core)  # decode the sampled token at position 10
    assert [(i.start_pos, i.token_ids) for i in step.items] == [(10, (110,))]
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == [110, 111]
    out, _ = run_step(core)  # frees it
    assert [f.req_id for f in out.ops.frees] == ["a"]
    assert mgr.pools["w0"].num_used == 0


def test_a_long_prompt_is_chunked_at_the_threshold_only_while_others_decode():
    """long_prefill_token_threshold caps a prefill chunk in steps that also decode (so that the decodes' time
    per token stays near a decode step's), and not when the prompt has the worker to itself."""
    mgr, core = setup(num_pages=32, budget=16, long_prefill=3)
    alone = request("alone", range(1, 21), max_tokens=2)
    core.add(alone)
    _, step = run_step(core)
    assert [len(i.token_ids) for i in step.items] == [16]  # nothing decodes: the whole budget
    drain(core)
    short = request("short", range(1, 3), max_tokens=6)
    core.add(short)
    run_step(core)  # its prompt; it decodes from the next step on
    long = request("long", range(30, 50), max_tokens=2)  # 20 prompt tokens
    core.add(long)
    chunks = []
    while long.num_computed_tokens < 20:
        _, step = run_step(core)
        by_id = {i.req_id: len(i.token_ids) for i in step.items}
        decoding = "short" in by_id
        chunks.append((by_id.get("long"), decoding))
    assert all(n <= 3 for n, decoding in chunks if decoding)  # capped while "short" decodes
    assert any(n > 3 for n, decoding in chunks if not decoding)  # the rest in full-budget chunks once it is done
    assert sum(n for n, _ in chunks) == 20
    drain(core)
    assert long.output_token_ids == [100 + 20, 100 + 21] and mgr.pools["w0"].num_used == 0


def test_second_request_hits_the_first_ones_cached_pages():
    mgr, core = setup()
    core.add(request("a", range(1, 11), max_tokens=1))
    drain(core)
    b = request("b", list(range(1, 11)) + [50, 51], max_tokens=1)
    core.add(b)
    _, step = run_step(core)
    assert b.num_cached_tokens == 8  # two full pages of a's prompt
    assert [(i.start_pos, i.token_ids) for i in step.items] == [(8, (9, 10, 50, 51))]
    other_tenant = request("c", range(1, 11), max_tokens=1, tenant="u")
    core.add(other_tenant)
    run_step(core)
    assert other_tenant.num_cached_tokens == 0
    drain(core)


def test_prefix_caching_off_commits_nothing_and_never_hits():
    mgr, core = setup(prefix_caching=False)
    core.add(request("a", range(1, 11), max_tokens=1))
    steps = drain(core)
    assert all(out.ops is None or not out.ops.commits for out, _ in steps)
    b = request("b", range(1, 11), max_tokens=1)
    core.add(b)
    drain(core)
    assert b.num_cached_tokens == 0


def test_decodes_run_before_new_prefills_and_budget_caps_the_step():
    mgr, core = setup(budget=6)
    a = request("a", range(1, 5), max_tokens=5)
    core.add(a)
    run_step(core)  # a prefilled (4 tokens), sampled one
    core.add(request("b", range(20, 30), max_tokens=1))
    _, step = run_step(core)
    assert [(i.req_id, len(i.token_ids)) for i in step.items] == [("a", 1), ("b", 5)]
    drain(core)


def test_out_of_pages_preempts_the_newest_and_it_resumes_identically():
    # 6 pages: a and b need 3 pages each at the end (8 prompt + 4 generated = 12 tokens), but b's prompt
    # arrives while a runs, so b's growth runs out and b (the newest) is preempted, then recomputed.
    mgr, core = setup(num_pages=5, budget=16)
    sched = core.scheduler
    a, b = request("a", range(1, 9), max_tokens=5), request("b", range(11, 19), max_tokens=5)
    core.add(a)
    core.add(b)
    drain(core)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1
    expected = [100 + p for p in range(8, 13)]  # the fake model's tokens do not depend on who ran when
    assert a.output_token_ids == expected and b.output_token_ids == expected
    assert mgr.pools["w0"].num_used == 0


def test_abort_of_a_running_request_frees_its_pages_next_step():
    mgr, core = setup()
    sched = core.scheduler
    a = request("a", range(1, 11), max_tokens=50)
    core.add(a)
    run_step(core)
    assert mgr.pools["w0"].num_used == 3
    sched.finish(a, FinishReason.CANCELLED)
    out, step = run_step(core)
    assert [f.req_id for f in out.ops.frees] == ["a"] and not step.items
    assert mgr.pools["w0"].num_used == 0 and not sched.has_work()


def test_finish_says_whether_the_request_still_has_pages_to_free():
    """The engine sends a finished request's last delta once its pages are freed; one that holds none (queued,
    or preempted with its free already sent) must not wait for a free that never comes."""
    for free_sent in (False, True):
        mgr, core = setup(num_pages=5, budget=16)
        sched = core.scheduler
        a, b, queued = (request("a", range(1, 9), max_tokens=5), request("b", range(11, 19), max_tokens=5),
                        request("q", range(21, 25)))
        for req in (a, b, queued):
            core.add(req)
        while not b.num_preemptions:
            run_step(core)
        assert queued.status is RequestStatus.WAITING and sched.finish(queued, FinishReason.CANCELLED) is False
        assert b.status is RequestStatus.WAITING and "b" in sched.pending_frees  # preempted: its free goes next
        if free_sent:
            run_step(core)
            assert b.status is RequestStatus.WAITING and "b" not in sched.pending_frees
        assert sched.finish(b, FinishReason.CANCELLED) is (not free_sent)
        assert a.status is RequestStatus.RUNNING and sched.finish(a, FinishReason.CANCELLED) is True
        drain(core)
        assert mgr.pools["w0"].num_used == 0 and not mgr.requests


def test_a_request_that_can_never_fit_fails_instead_of_waiting_forever():
    mgr, core = setup(num_pages=4)
    sched = core.scheduler
    mgr.step(StepOps(1, allocations=(PageAllocation("elsewhere", "t", tuple(range(50, 58)), "w0"),)))  # holds 2 pages
    big = request("big", range(1, 11), max_tokens=1)  # needs 3 pages; nothing of this scheduler will free any
    core.add(big)
    out = sched.schedule()
    batch = sched.assign(out, mgr.step(out.ops))
    assert batch.failed == [big] and big.finish_reason is FinishReason.ERROR
    assert "needs 3 pages" in str(big.error)
    assert not sched.has_work() and mgr.pools["w0"].num_used == 2


def test_token_ids_slices_prompt_and_outputs_as_one_sequence():
    req = request("a", [1, 2, 3])
    req.output_token_ids = [7, 8]
    for start, end in [(0, 2), (1, 3), (2, 4), (3, 5), (0, 5), (4, 5), (3, 3)]:
        assert req.token_ids(start, end) == tuple(req.all_token_ids[start:end])


def test_decode_steps_call_the_kvmanager_only_when_a_request_runs_out_of_headroom():
    mgr, core = setup(num_pages=32)
    a = request("a", range(1, 5), max_tokens=30)  # computes positions 0..32
    core.add(a)
    steps = drain(core)
    assert len(steps) == 31 and a.output_token_ids == [100 + p for p in range(4, 34)]
    calls = {i: out.ops for i, (out, _) in enumerate(steps) if out.ops is not None}
    # the admission; then, whenever a runs out of slots, the page it needs plus one page of headroom, with the
    # commit of the pages filled since the call before; the last pages' commit goes with the free
    assert list(calls) == [0, 1, 9, 17, 25, 30]
    assert [[e.num_tokens for e in ops.extensions] for ops in calls.values()] == [[], [9], [17], [25], [33], []]
    assert [[(c.start_pos, len(c.token_ids)) for c in ops.commits] for ops in calls.values()] == [
        [], [(0, 4)], [(4, 8)], [(12, 8)], [(20, 8)], [(28, 4)]]
    assert [f.req_id for f in calls[30].frees] == ["a"]
    assert len(mgr.pools["w0"].index) == 8 and mgr.pools["w0"].num_used == 0  # every full page it computed


def test_a_finished_requests_last_pages_are_cached_for_the_next_turn():
    mgr, core = setup(num_pages=32)
    a = request("a", range(1, 5), max_tokens=9)  # computes positions 0..11: three full pages
    core.add(a)
    drain(core)
    next_turn = request("b", a.all_token_ids + [70, 71], max_tokens=1)
    core.add(next_turn)
    drain(core)
    assert next_turn.num_cached_tokens == 12  # prompt and reply, up to the last page a filled


def test_headroom_takes_at_most_half_the_spare_pages():
    mgr, core = setup(num_pages=8, budget=32)
    sched = core.scheduler
    for name in "abc":
        core.add(request(name, range(1, 8), max_tokens=20))  # 7 tokens: 2 pages each
    run_step(core)
    assert mgr.pools["w0"].num_free == 2
    out, _ = run_step(core)  # the prompts' first pages are committed; every request has a slot for now
    assert [(e.req_id, e.num_tokens) for e in out.ops.extensions] == [("a", 12)]  # 2 spare pages: 1 for headroom
    assert out.headroom_only == {"a"} and len(sched.requests["a"].page_table) == 3


def test_headroom_the_pool_cannot_give_preempts_nothing():
    mgr, core = setup(num_pages=4, budget=16)
    sched = core.scheduler
    a = request("a", range(1, 7), max_tokens=20)  # 6 tokens: 2 pages
    core.add(a)
    run_step(core)
    mgr.step(StepOps(1, allocations=(PageAllocation("other", "u", tuple(range(50, 58)), "w0"),)))  # the 2 other pages
    out, step = run_step(core)  # a's first page is committed; the scheduler still counts 2 spare pages
    assert out.headroom_only == {"a"} and [(e.req_id, e.num_tokens) for e in out.ops.extensions] == [("a", 11)]
    assert [i.req_id for i in step.items] == ["a"] and sched.num_preemptions == 0 and len(a.page_table) == 2


def test_a_preempted_request_commits_what_it_computed_and_hits_it_on_resume():
    mgr, core = setup(num_pages=32)
    sched = core.scheduler
    b = request("b", range(1, 5), max_tokens=30)
    core.add(b)
    for _ in range(9):  # positions 0..11 computed; only the first page committed (the next call is at step 9)
        run_step(core)
    assert b.num_computed_tokens == 12 and b.num_committed_tokens == 4
    sched.preempt(b)
    out, _ = run_step(core)
    assert [(c.req_id, c.start_pos, len(c.token_ids)) for c in out.ops.commits] == [("b", 4, 8)]
    assert [f.req_id for f in out.ops.frees] == ["b"]
    run_step(core)  # readmitted: recomputes only what its committed pages do not hold
    assert mgr.tenants["t"].prefix_cache_hits == 12
    drain(core)
    assert b.output_token_ids == [100 + p for p in range(4, 34)]
    assert b.num_cached_tokens == 0  # usage reports its first admission's hit, not its readmission's 12


def test_headroom_never_asks_past_the_pool():
    mgr, core = setup(num_pages=8, budget=32)  # 32 slots
    sched = core.scheduler
    core.add(request("a", range(1, 29), max_tokens=100))  # 28 prompt tokens: 7 pages (the gateway would refuse)
    run_step(core)
    sched.num_available_pages = 100  # a stale count: headroom looks free (the half-the-spare rule stops it else)
    out, _ = run_step(core)  # position 28 needs the 8th page; a page of headroom would be a 9th, and the
    assert [(e.req_id, e.num_tokens) for e in out.ops.extensions] == [("a", 29)]  # kvmanager refuses such a call


def test_only_a_call_that_commits_and_tops_up_headroom_can_overlap_compute():
    mgr, core = setup(num_pages=32, budget=4)
    core.add(request("a", range(1, 11), max_tokens=6))  # 10 prompt tokens in chunks of 4, then 5 decodes
    steps = drain(core, overlap=True)
    calls = [out for out, _ in steps if out.ops is not None]
    kinds = [("alloc" if out.ops.allocations else "free" if out.ops.frees else "commit", out.can_overlap)
             for out in calls]
    assert kinds == [("alloc", False), ("commit", True), ("commit", True), ("commit", True), ("free", False)]
    out, _ = steps[2]  # the last prompt chunk's call also tops up a page of headroom, for the decodes after it
    assert out.headroom_only == {"a"} and [len(i.page_table) for i in steps[3][1].items] == [4]
    assert mgr.pools["w0"].num_used == 0 and len(mgr.pools["w0"].index) == 3

    mgr, core = setup(num_pages=32)  # a request that runs out of slots waits for its page: no overlap
    core.add(request("b", range(1, 5), max_tokens=30))
    steps = drain(core, overlap=True)
    needed = [out for out, _ in steps
              if out.ops is not None and {e.req_id for e in out.ops.extensions} - out.headroom_only]
    assert len(needed) == 4 and not any(out.can_overlap for out in needed)


def test_overlapped_calls_compute_the_same_steps_as_calls_waited_for():
    """Prefix hits, chunked prefill, headroom and requests finishing at different steps, run twice: waiting
    for every answer, and applying commit-only answers after the batch is built. The same tokens are computed
    at the same positions in the same pages, every page comes back, and the same blocks are cached."""
    runs = []
    for overlap in (False, True):
        mgr, core = setup(num_pages=40, budget=6, max_num_seqs=3)
        sched = core.scheduler
        shared = list(range(1, 9))  # two pages every prompt starts with
        for i, n in enumerate((11, 7, 14, 9, 5)):
            core.add(request(f"r{i}", shared + list(range(20 + 10 * i, 20 + 10 * i + n)), max_tokens=3 + 2 * i))
        steps = drain(core, overlap=overlap)
        items = [[(i.req_id, i.start_pos, i.token_ids, i.sample, i.page_table[:-(-i.end_pos // PS)])
                  for i in step.items] for _, step in steps]
        overlapped = sum(out.can_overlap for out, _ in steps)
        runs.append((items, {r: list(req.output_token_ids) for r, req in sched.requests.items()},
                     sorted(mgr.pools["w0"].index), mgr.tenants["t"].prefix_cache_hits, overlapped))
        assert mgr.pools["w0"].num_used == 0
    (items, outputs, index, hits, _), (items_o, outputs_o, index_o, hits_o, overlapped) = runs
    assert overlapped >= 5 and hits > 0
    assert items_o == items and outputs_o == outputs and index_o == index and hits_o == hits


def test_reserved_ahead_an_admission_rides_with_the_call_made_while_the_others_compute():
    """With a request decoding, a newcomer's allocation goes out in the call that runs while the worker
    computes that step (it can overlap), and the newcomer computes its first chunk, from its prefix hit, in
    the next step. A free rides along the same way. With nothing running, an admission is answered first."""
    mgr, core = setup(num_pages=40, budget=8, reserve_ahead=True)
    sched = core.scheduler
    a = request("a", range(1, 9), max_tokens=8)
    core.add(a)
    out, step = run_step(core, overlap=True)
    assert out.ops.allocations and not out.can_overlap and [i.req_id for i in step.items] == ["a"]
    run_step(core, overlap=True)  # a decodes
    b = request("b", list(range(1, 9)) + [50, 51, 52], max_tokens=2)  # a's two prompt pages, then its own
    core.add(b)
    out, step = run_step(core, overlap=True)
    assert out.ahead and out.can_overlap and [c.req.req_id for c in out.admitted] == ["b"]
    assert [i.req_id for i in step.items] == ["a"]  # b is not in the step its allocation overlapped
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 8 and b.num_cached_tokens is None
    out, step = run_step(core, overlap=True)
    assert [(i.req_id, i.start_pos, len(i.token_ids)) for i in step.items] == [("a", 10, 1), ("b", 8, 3)]
    assert b.num_cached_tokens == 8  # set once its first chunk computed, as for an in-series admission
    frees = []
    while sched.has_work():
        out, _ = run_step(core, overlap=True)
        if out.ops is not None and out.ops.frees:
            frees.append((out.ops.frees[0].req_id, out.can_overlap))
        check_invariants(mgr)
    assert frees == [("b", True), ("a", False)]  # a's free: nothing else runs, nothing to hide behind
    assert mgr.pools["w0"].num_used == 0
    assert b.output_token_ids == [111, 112] and a.output_token_ids == [100 + p for p in range(8, 16)]


def test_reserved_ahead_the_same_tokens_are_computed_and_few_calls_are_waited_for():
    """The workload of the overlap comparison above, with more requests than run at once so that admissions
    and frees come while others decode: the same tokens as with every call waited for, every page back, the
    same blocks cached; only calls with nothing running beside them (or an extension a step needs) wait."""
    runs = []
    for ahead in (False, True):
        mgr, core = setup(num_pages=60, budget=6, max_num_seqs=3, reserve_ahead=ahead)
        sched = core.scheduler
        shared = list(range(1, 9))
        for i, n in enumerate((11, 7, 14, 9, 5, 12, 3, 8)):
            core.add(request(f"r{i}", shared + list(range(20 + 10 * i, 20 + 10 * i + n)), max_tokens=3 + 2 * i))
        reqs = dict(sched.requests)
        steps = drain(core, max_steps=300, overlap=True)
        waited = sum(out.ops is not None and not out.can_overlap for out, _ in steps)
        ahead_calls = sum(out.ahead and bool(out.admitted) for out, _ in steps)
        runs.append(({r: req.output_token_ids for r, req in reqs.items()}, sorted(mgr.pools["w0"].index),
                     {r: req.num_cached_tokens for r, req in reqs.items()}, waited, ahead_calls))
        assert mgr.pools["w0"].num_used == 0
    (outputs, index, cached, waited, _), (outputs_a, index_a, cached_a, waited_a, ahead_calls) = runs
    assert outputs_a == outputs and index_a == index and cached_a == cached
    assert all(out == [100 + len(reqs[r].prompt_token_ids) + k for k in range(len(out))] for r, out in outputs.items())
    assert ahead_calls >= 4 and waited_a < waited / 2


def test_a_worker_restart_in_an_overlapped_step_leaks_no_page_and_recomputes_identically():
    """The engine applies the late answer, then re-registers: every running request is preempted (its pages,
    headroom included, are freed by the next call) and recomputed to the same tokens."""
    expected = None
    for fail in (False, True):
        mgr, core = setup(num_pages=32, budget=4)
        sched = core.scheduler
        a = request("a", range(1, 11), max_tokens=6)
        core.add(a)
        run_step(core)  # admission
        out = sched.schedule()  # commits the prompt's first page: a call that can overlap
        assert out.can_overlap
        batch = sched.assign(out, StepResults())
        sched.apply_late(out, mgr.step(out.ops))
        if fail:  # the worker answered FAILED_PRECONDITION: nothing of this step was computed
            for req in list(sched.running):
                sched.preempt(req)
        else:
            step = batch.to_step(epoch=1)
            sched.update(batch, [SampledToken(i.req_id, 100 + i.end_pos, 0.0) for i in step.items if i.sample])
        drain(core, overlap=True)
        assert mgr.pools["w0"].num_used == 0
        expected = expected or a.output_token_ids
        assert a.output_token_ids == expected == [100 + p for p in range(10, 16)]


def windowed_setup(num_pages=10, budget=8, window=8, sinks=4):
    mgr = KVManager()
    mgr.register_worker(PoolSpec("w0", 1, num_pages, PS, "fp", "float32", 1, "", window, sinks))
    cfg = SchedulerConfig("w0", PS, num_pages, max_model_len=1 << 20, eos_token_ids=(0,),
                          max_num_batched_tokens=budget, window=AttentionWindow(window, sinks))
    return mgr, core_over(mgr, cfg)


def held(mgr, req_id) -> list[int]:
    return [p for p in mgr.requests[req_id].page_table if p >= 0]


def test_a_windowed_request_longer_than_the_pool_holds_a_window_of_pages_and_computes_every_position():
    """Window 8, sinks 4, pages of 4 on a pool of 10 pages (40 slots): a request of 60 prompt and 40 new tokens
    releases the pages before each step's window (one batched call per step), never holds more than the sink
    page, the chunk's window and the page it fills, and ends with every page back (pool accounting checked
    after every step by drain)."""
    mgr, core = windowed_setup()
    sched = core.scheduler
    req = request("a", range(1, 61), max_tokens=40)
    core.add(req)
    most, starts = 0, []
    while sched.has_work():
        _, step = run_step(core, overlap=True)
        check_invariants(mgr)
        if "a" in mgr.requests:
            most = max(most, len(held(mgr, "a")))
            assert held(mgr, "a") == [p for p in req.page_table if p >= 0]  # the gateway's copy agrees
        starts += [(i.start_pos, len(i.token_ids)) for i in step.items]
    assert most <= AttentionWindow(8, 4).max_pages_held(req.num_tokens, PS, chunk=8) and req.num_tokens == 100 > 10 * PS
    assert sum(n for _, n in starts) == 99 and [s for s, _ in starts] == sorted(s for s, _ in starts)
    assert req.output_token_ids == [100 + p for p in range(60, 100)]
    pool = mgr.pools["w0"]
    assert pool.num_used == 0 and pool.num_window_released > 20


def test_a_windowed_hit_holds_only_the_pages_its_first_chunk_reads():
    mgr, core = windowed_setup(num_pages=24)
    first = request("a", range(1, 42), max_tokens=1)
    core.add(first)
    drain(core)
    again = request("b", range(1, 42), max_tokens=1)
    core.add(again)
    out, step = run_step(core)
    assert out.ops.allocations[0].chunk_tokens == 8
    (item,) = step.items
    assert item.start_pos == 40  # 10 full pages hit; the last token is computed
    assert [k for k, p in enumerate(item.page_table) if p >= 0] == [0, 8, 9, 10]  # sinks' page and 33..40
    drain(core)


def test_at_most_one_request_under_suspicion_computes_per_step_beside_the_others():
    """num_failed_steps > 0 (its last step failed without an answer for it): one such request per step computes,
    beside the others; the other suspects wait their turn, running or queued; an answered step clears one."""
    mgr, core = setup(budget=32, max_num_seqs=8)
    a, b, c = (request(r, range(10 * i + 1, 10 * i + 4), max_tokens=6) for i, r in enumerate("abc"))
    for r in (a, b, c):
        core.add(r)
    run_step(core)  # all three prefill together
    a.num_failed_steps = b.num_failed_steps = 1  # as after a step the worker refused
    d, e = request("d", range(41, 44)), request("e", range(51, 54))
    d.num_failed_steps = 1  # handed over from a worker that was lost in its step
    for r in (d, e):
        core.add(r)
    _, step = run_step(core)
    assert [i.req_id for i in step.items] == ["a", "c"]  # b waits; d, a suspect too, holds the queue (and e)
    assert a.num_failed_steps == 0 and b.num_failed_steps == 1
    _, step = run_step(core)
    assert [i.req_id for i in step.items] == ["a", "b", "c"]
    _, step = run_step(core)
    assert sorted(i.req_id for i in step.items) == ["a", "b", "c", "d", "e"]  # d admitted, the only suspect
    assert d.num_failed_steps == 0
    drain(core)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in (a, b, c, d, e))
