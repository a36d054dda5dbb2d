"""The gateway's scheduler against the real kvmanager domain on tiny pools: chunked prefill, decode, prefix hits,
preemption by recompute, and that every page comes back. The worker is replaced by a rule (next token =
f(position)) because what is tested here is which tokens get computed where, not the model."""

from __future__ import annotations

from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.types import Allocate, PoolSpec, StepOps
from kvserve.services.gateway.request import FinishReason, Request, RequestParams, RequestStatus
from kvserve.services.gateway.scheduler import Scheduler, SchedulerConfig
from kvserve.worker.batch import SampledToken

PS = 4


def setup(num_pages=16, budget=8, max_num_seqs=8, prefix_caching=True):
    mgr = KVManager()
    mgr.register_worker(PoolSpec("w0", 1, num_pages, PS, "fp", "float32", 1))
    cfg = SchedulerConfig("w0", PS, num_pages, max_model_len=1000, eos_token_ids=(0,), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, prefix_caching=prefix_caching)
    return mgr, Scheduler(cfg)


def request(req_id, prompt, max_tokens=3, tenant="t"):
    return Request(req_id, tenant, list(prompt), RequestParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(mgr, sched):
    """One step with a fake model whose next token is 100 + the position it is sampled at."""
    out = sched.schedule()
    batch = sched.assign(out, mgr.step(out.ops))
    step = batch.to_step(epoch=1)
    sampled = [SampledToken(i.req_id, 100 + i.end_pos, 0.0) for i in step.items if i.sample]
    sched.update(batch, sampled)
    return out, step


def drain(mgr, sched, max_steps=100):
    steps = []
    while sched.has_work() and len(steps) < max_steps:
        steps.append(run_step(mgr, sched))
        check_invariants(mgr)
    assert not sched.has_work()
    return steps


def test_chunked_prefill_then_decode_exact_chunks_and_pages():
    mgr, sched = setup(budget=4)
    req = request("a", range(1, 11), max_tokens=2)  # 10 prompt tokens, 3 pages
    sched.add(req)
    out, step = run_step(mgr, sched)
    assert [a.token_ids for a in out.ops.allocations] == [tuple(range(1, 11))]
    assert [(i.start_pos, i.token_ids, i.sample) for i in step.items] == [(0, (1, 2, 3, 4), False)]
    assert req.page_table == [0, 1, 2]
    out, step = run_step(mgr, sched)
    assert [(c.start_pos, c.token_ids) for c in out.ops.commits] == [(0, (1, 2, 3, 4))]  # page 0 became full
    assert [(i.start_pos, i.token_ids, i.sample) for i in step.items] == [(4, (5, 6, 7, 8), False)]
    out, step = run_step(mgr, sched)
    assert [(c.start_pos, c.token_ids) for c in out.ops.commits] == [(4, (5, 6, 7, 8))]
    assert [(i.start_pos, i.token_ids, i.sample) for i in step.items] == [(8, (9, 10), True)]
    assert req.output_token_ids == [110]
    out, step = run_step(mgr, sched)  # decode the sampled token at position 10
    assert [(i.start_pos, i.token_ids) for i in step.items] == [(10, (110,))]
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == [110, 111]
    out, _ = run_step(mgr, sched)  # frees it
    assert [f.req_id for f in out.ops.frees] == ["a"]
    assert mgr.pools["w0"].num_used == 0


def test_second_request_hits_the_first_ones_cached_pages():
    mgr, sched = setup()
    sched.add(request("a", range(1, 11), max_tokens=1))
    drain(mgr, sched)
    b = request("b", list(range(1, 11)) + [50, 51], max_tokens=1)
    sched.add(b)
    _, step = run_step(mgr, sched)
    assert b.num_cached_tokens == 8  # two full pages of a's prompt
    assert [(i.start_pos, i.token_ids) for i in step.items] == [(8, (9, 10, 50, 51))]
    other_tenant = request("c", range(1, 11), max_tokens=1, tenant="u")
    sched.add(other_tenant)
    run_step(mgr, sched)
    assert other_tenant.num_cached_tokens == 0
    drain(mgr, sched)


def test_prefix_caching_off_commits_nothing_and_never_hits():
    mgr, sched = setup(prefix_caching=False)
    sched.add(request("a", range(1, 11), max_tokens=1))
    steps = drain(mgr, sched)
    assert all(not out.ops.commits for out, _ in steps)
    b = request("b", range(1, 11), max_tokens=1)
    sched.add(b)
    drain(mgr, sched)
    assert b.num_cached_tokens == 0


def test_decodes_run_before_new_prefills_and_budget_caps_the_step():
    mgr, sched = setup(budget=6)
    a = request("a", range(1, 5), max_tokens=5)
    sched.add(a)
    run_step(mgr, sched)  # a prefilled (4 tokens), sampled one
    sched.add(request("b", range(20, 30), max_tokens=1))
    _, step = run_step(mgr, sched)
    assert [(i.req_id, len(i.token_ids)) for i in step.items] == [("a", 1), ("b", 5)]
    drain(mgr, sched)


def test_out_of_pages_preempts_the_newest_and_it_resumes_identically():
    # 6 pages: a and b need 3 pages each at the end (8 prompt + 4 generated = 12 tokens), but b's prompt
    # arrives while a runs, so b's growth runs out and b (the newest) is preempted, then recomputed.
    mgr, sched = setup(num_pages=5, budget=16)
    a, b = request("a", range(1, 9), max_tokens=5), request("b", range(11, 19), max_tokens=5)
    sched.add(a)
    sched.add(b)
    drain(mgr, sched)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1
    expected = [100 + p for p in range(8, 13)]  # the fake model's tokens do not depend on who ran when
    assert a.output_token_ids == expected and b.output_token_ids == expected
    assert mgr.pools["w0"].num_used == 0


def test_abort_of_a_running_request_frees_its_pages_next_step():
    mgr, sched = setup()
    a = request("a", range(1, 11), max_tokens=50)
    sched.add(a)
    run_step(mgr, sched)
    assert mgr.pools["w0"].num_used == 3
    sched.finish(a, FinishReason.CANCELLED)
    out, step = run_step(mgr, sched)
    assert [f.req_id for f in out.ops.frees] == ["a"] and not step.items
    assert mgr.pools["w0"].num_used == 0 and not sched.has_work()


def test_a_request_that_can_never_fit_fails_instead_of_waiting_forever():
    mgr, sched = setup(num_pages=4)
    mgr.step(StepOps(allocations=(Allocate("elsewhere", "t", tuple(range(50, 58)), "w0"),)))  # holds 2 pages
    big = request("big", range(1, 11), max_tokens=1)  # needs 3 pages; nothing of this scheduler will free any
    sched.add(big)
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
