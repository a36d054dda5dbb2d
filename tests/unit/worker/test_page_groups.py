"""Page groups (kvserve/worker/page_groups.py): a model mixing sliding and full layers keeps the sliding layers' K/V
in a pool of their own, each request with a page table there whose pages older than the window are released.
Tiny random Gemma 3 and Qwen2 (max_window_layers) models generate exactly HF's tokens through the runner with
chunked prefill while their sliding tables' pages fall out of the window and are handed to other requests; the
pools' bytes per token per group are kv-mem's; malformed tables are refused by name; the fallbacks keep one pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from family_models import hf_generate, hf_model
from gemma_models import WINDOW, save_gemma2, save_gemma3, save_mixed

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.errors import FailedPrecondition, InvalidRequest
from kvserve.common.pages import HOLE, num_pages_for
from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem
from kvserve.kernels.kv_quant import kv_format
from kvserve.worker import page_groups
from kvserve.worker.config import ModelConfig
from kvserve.worker.layer_windows import LayerGroups
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.validate import SlidingGroupPages, validate_batch

PAGE = 16
NEW_TOKENS = 30
PROMPT_LENGTHS = (100, 37, 70)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("groups")
    return {
        "gemma3": save_gemma3(root / "gemma3", model_dir),  # layers 2 and 5 full, the others window 24
        "gemma2": save_gemma2(root / "gemma2", model_dir),  # layers 1, 3 and 5 full; scores soft-capped
        "qwen2": save_mixed(root / "qwen2", model_dir, "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=2, drop=("layer_types",)),  # layers 2 and 3 slide
    }


def grouped_runner(folder, backend: str = "cpu", **kw) -> ModelRunner:
    kw = dict(num_pages=32, sliding_group_pages=18, page_groups=True) | kw
    return ModelRunner(RunnerConfig(model_dir=folder, page_size=PAGE, device="cpu", dtype="float32",
                                    attention_backend=backend, **kw))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


class Seq:
    """A request of the two-table loop: its page table in each pool, and the sliding page id each index of its
    group table got (kept after the page is released)."""

    def __init__(self, req_id: str, prompt: list[int], table: list[int] | None = None,
                 group_table: list[int] | None = None, computed: int = 0):
        self.req_id, self.prompt, self.output, self.computed = req_id, prompt, [], computed
        self.table, self.group_table = list(table or []), list(group_table or [])
        self.group_ids = list(self.group_table)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def run_grouped(runner: ModelRunner, seqs: list[Seq], budget: int, free: list[int], group_free: list[int],
                reuse: bool = True) -> None:
    """Greedy generation of NEW_TOKENS each through runner.step, decodes first, then prefill chunks under the
    token budget, as the gateway and kvmanager would: before each step a request's sliding pages that no query
    from its next position on reads become holes and go back to the sliding pool's free list. ``reuse``: the
    list hands out the last page freed first (released page ids soon serve other requests), else the first."""
    window = AttentionWindow(runner.info.sliding_group_window)
    while any(len(s.output) < NEW_TOKENS for s in seqs):
        items, used = [], 0
        for s in sorted((s for s in seqs if len(s.output) < NEW_TOKENS), key=lambda s: s.computed < len(s.prompt)):
            n = 1 if s.computed >= len(s.prompt) else min(len(s.prompt) - s.computed, budget - used)
            if n <= 0:
                continue
            for k in window.releasable_pages(s.computed, PAGE):
                if s.group_table[k] != HOLE:
                    group_free.append(s.group_table[k])
                    s.group_table[k] = HOLE
            while len(s.table) < num_pages_for(s.computed + n, PAGE):
                s.table.append(free.pop(0))
                s.group_table.append(group_free.pop() if reuse else group_free.pop(0))
                s.group_ids.append(s.group_table[-1])
            items.append((s, StepItem(s.req_id, tuple(s.tokens[s.computed:s.computed + n]), s.computed,
                                      tuple(s.table), sample=s.computed + n >= len(s.prompt), sampling=GREEDY,
                                      group_page_table=tuple(s.group_table))))
            used += n
        step = runner.step(StepBatch(tuple(it for _, it in items)))
        assert not step.rejected, step.rejected
        out = {o.req_id: o.token_id for o in step.sampled}
        for s, item in items:
            s.computed += len(item.token_ids)
            if item.req_id in out:
                s.output.append(out[item.req_id])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("name", ["gemma3", "gemma2", "qwen2"])
def test_hfs_greedy_tokens_while_the_sliding_pages_fall_out_of_the_window_and_serve_others(tiny, name, backend):
    runner = grouped_runner(tiny[name], backend)
    info, groups = runner.info, runner.groups
    assert (info.sliding_group_pages, info.sliding_group_window, info.sliding_window) == (18, WINDOW, 0)
    assert runner.kv_cache.shape[:3] == (len(groups.full_layers), 2, 32)
    assert runner.group_cache.shape[:3] == (len(groups.sliding_layers), 2, 18)
    seqs = [Seq(f"r{k}", p) for k, p in enumerate(prompts())]
    run_grouped(runner, seqs, budget=48, free=list(range(32)), group_free=list(range(18)))
    hf = hf_model(tiny[name])
    for s in seqs:
        assert s.output == hf_generate(hf, s.prompt, NEW_TOKENS), s.req_id
        last_start = s.computed - 1
        assert HOLE not in s.table
        assert s.group_table.count(HOLE) == AttentionWindow(WINDOW).first_page_read(last_start, PAGE) > 0
    reused = [(a.req_id, b.req_id) for a in seqs for b in seqs if a is not b and set(a.group_ids) & set(b.group_ids)]
    assert reused, "a released sliding page went to another request"


def test_a_prefix_hit_reads_the_cached_sliding_pages_of_its_window_only(tiny):
    """A second request computes only what follows the first one's full pages: its full table shares them all,
    its sliding table only the pages its first chunk's window reads (holes before), as the kvmanager hands them
    out; it still generates HF's tokens."""
    runner, hf = grouped_runner(tiny["gemma3"]), hf_model(tiny["gemma3"])
    free, group_free = list(range(32)), list(range(18))
    first = Seq("a", prompts()[0])  # 100 tokens: pages 0 .. 5 full (positions 0 .. 95)
    run_grouped(runner, [first], budget=40, free=free, group_free=group_free, reuse=False)
    assert first.output == hf_generate(hf, first.prompt, NEW_TOKENS)
    assert AttentionWindow(WINDOW).first_page_read(96, PAGE) == 4  # position 96 reads 73 .. 96: pages 4 .. 6
    hit = [HOLE] * 4 + first.group_ids[4:6]  # released by the first request, cached, not reused
    group_free[:] = [p for p in group_free if p not in hit]
    second = Seq("b", first.prompt[:96] + prompts()[1][:20], first.table[:6], hit, computed=96)
    run_grouped(runner, [second], budget=7, free=free, group_free=group_free, reuse=False)
    assert second.table[:6] == first.table[:6] and second.group_ids[4:6] == first.group_ids[4:6]
    assert second.output == hf_generate(hf, second.prompt, NEW_TOKENS)


# --- sizes -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kv_dtype", "kv_scales"), [("auto", "token_head"), ("int8", "token_head"),
                                                     ("fp8_e4m3", "tensor")])
def test_each_pools_bytes_per_token_are_its_tensors_and_kv_mems_per_group(tiny, kv_dtype, kv_scales):
    from kvserve.common.kvmem import calculate
    from kvserve.common.kvmem_models import load_hf_config

    runner = grouped_runner(tiny["gemma3"], "reference", kv_cache_dtype=kv_dtype, kv_scales=kv_scales)
    info = runner.info
    pools = ((runner.kv_cache, runner.kv_scales, info.num_pages, info.bytes_per_token),
             (runner.group_cache, runner.group_scales, info.sliding_group_pages, info.sliding_group_bytes_per_token))
    for cache, scales, pages, per_token in pools:
        assert cache.nbytes + (0 if scales is None else scales.nbytes) == per_token * pages * PAGE
    assert info.pool_bytes == info.bytes_per_token * info.num_pages * PAGE
    r = calculate(load_hf_config(tiny["gemma3"]), seq_len=1000, kv_dtype="fp32" if kv_dtype == "auto" else kv_dtype,
                  kv_scales=kv_scales, page_size=PAGE)
    g = r.page_groups
    assert (g.full_layers, g.sliding_layers, g.window) == (2, 4, WINDOW)
    # kv-mem's per sequence: full x full_tokens + sliding x sliding_tokens, against (full + sliding) x full_tokens
    sliding = (g.every_page_bytes - g.bytes_per_sequence) // (g.full_tokens - g.sliding_tokens)
    full = g.every_page_bytes // g.full_tokens - sliding
    assert (info.bytes_per_token, info.sliding_group_bytes_per_token) == (full, sliding)
    assert full + sliding == r.per_token.bytes


def gemma_cfg() -> ModelConfig:
    from gemma_models import gemma3_config

    return ModelConfig.from_dict(gemma3_config().to_dict())


def sizes(**kw) -> tuple[int, int, int, int]:
    """(full pages, sliding pages, full page bytes, sliding page bytes) of the tiny Gemma 3 in float32."""
    cfg = gemma_cfg()
    kw = dict(kv_scales="token_head", kv_cache_bytes=None, num_pages=None, sliding_group_pages=None,
              max_model_len=cfg.max_position_embeddings) | kw
    full, sliding = page_groups.size_groups(cfg, LayerGroups.of(cfg.layer_windows), kv_format("float32"), PAGE, **kw)
    return full.num_pages, sliding.num_pages, full.page_bytes, sliding.page_bytes


def test_the_sliding_pool_holds_64_requests_windows_and_never_more_pages_than_the_full_one():
    """Window 24, pages of 16: a request holds at most 4 sliding pages (a page's tokens computed at once), so the
    default cap is 256 pages. fp32: a full page is 2 layers x 256 B x 16 = 8 KiB, a sliding one 16 KiB."""
    assert page_groups.window_pages(WINDOW, 1024, PAGE) == 4
    assert sizes(num_pages=100)[:2] == (100, 100)  # explicit pages: min(P, cap)
    assert sizes(num_pages=5000)[:2] == (5000, 256)
    assert sizes(num_pages=100, sliding_group_pages=7)[:2] == (100, 7)
    full_pages, sliding_pages, f, s = sizes(kv_cache_bytes=1 << 20)  # under the cap: both pools alike
    assert full_pages < 256
    assert (f, s) == (8192, 16384) and full_pages == sliding_pages == (1 << 20) // (f + s)
    budget = 64 << 20
    full_pages, sliding_pages, f, s = sizes(kv_cache_bytes=budget)  # over: the cap, and the full pool the rest
    assert sliding_pages == 256 and full_pages == (budget - 256 * s) // f
    assert full_pages * f + sliding_pages * s <= budget < (full_pages + 1) * f + sliding_pages * s
    assert sizes(kv_cache_bytes=budget, sliding_group_pages=10)[:2] == ((budget - 10 * s) // f, 10)
    with pytest.raises(ValueError, match="more than the full layers' 100 pages"):
        sizes(num_pages=100, sliding_group_pages=101)
    with pytest.raises(ValueError, match="holds no page"):
        sizes(kv_cache_bytes=f + s - 1)
    with pytest.raises(ValueError, match="at least 1"):
        sizes(num_pages=100, sliding_group_pages=0)


def test_a_budget_sized_runner_reports_both_pools(tiny):
    runner = grouped_runner(tiny["gemma3"], "reference", num_pages=None, sliding_group_pages=None,
                            kv_cache_bytes=4 << 20)
    info = runner.info
    assert info.num_pages == info.sliding_group_pages == (4 << 20) // ((512 + 1024) * PAGE)
    assert info.pool_bytes + info.sliding_group_pages * info.sliding_group_bytes_per_token * PAGE <= 4 << 20
    assert "page groups: 2 full layers" in runner.page_groups_note and "window 24" in runner.page_groups_note


# --- when a worker groups --------------------------------------------------------------------------------------

GROUPING = dict(enabled=True, kv_store=False, role="both", sinks=0, page_size=PAGE)


def test_layers_map_to_their_group_and_index():
    groups = LayerGroups.of(gemma_cfg().layer_windows)  # (24, 24, 0, 24, 24, 0)
    assert (groups.window, groups.full_layers, groups.sliding_layers) == (WINDOW, (2, 5), (0, 1, 3, 4))
    assert [groups.place(i) for i in range(6)] == [(True, 0), (True, 1), (False, 0), (True, 2), (True, 3),
                                                   (False, 1)]
    assert page_groups.plan(gemma_cfg(), **GROUPING) == (groups, "")


@pytest.mark.parametrize(("kw", "why"), [
    (dict(enabled=False), "--no-page-groups"),
    (dict(kv_store=True), "--kv-store-url"),
    (dict(role="prefill"), "role prefill"),
    (dict(role="decode"), "role decode"),
    (dict(sinks=4), "attention sinks"),
    (dict(page_size=32), "window 24 is smaller than a page (32 tokens)"),
])
def test_the_fallbacks_keep_one_pool_and_say_why(kw, why):
    groups, why_not = page_groups.plan(gemma_cfg(), **(GROUPING | kw))
    assert groups is None and why in why_not


def test_two_windows_or_no_mix_keep_one_pool():
    two = dataclasses.replace(gemma_cfg(), layer_windows=(24, 32, 0, 24, 32, 0))
    assert page_groups.plan(two, **GROUPING)[1] == "2 sliding windows (24, 32)"
    llama = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
    assert page_groups.plan(llama, **GROUPING) == (None, "")


@pytest.mark.parametrize("kw", [dict(page_groups=False), dict(role="prefill")])
def test_a_runner_falling_back_keeps_every_layer_in_one_pool(tiny, kw):
    runner = grouped_runner(tiny["gemma3"], "reference", **kw)
    assert runner.groups is None and runner.group_cache is None and runner.kv_cache.shape[:3] == (6, 2, 32)
    assert (runner.info.sliding_group_pages, runner.info.sliding_group_window) == (0, 0)
    assert runner.transfers_off == "" and "one pool for every layer" in runner.page_groups_note


def test_a_grouped_worker_moves_no_pages_between_workers(tiny):
    from kvserve.common.wire.transfer import PeerLoad, PullOrder, ReadOrder
    from kvserve.worker.transfer import PeerTransfers

    runner = grouped_runner(tiny["gemma3"], "reference")
    assert "page groups" in runner.transfers_off
    transfers = PeerTransfers(runner.kv_cache, runner.kv_scales, lambda: runner.epoch,
                              unavailable=runner.transfers_off)
    with pytest.raises(FailedPrecondition, match="page groups"):
        transfers.read(ReadOrder(runner.epoch, 1 << 62, ((0, b"h" * 16, b"n" * 16),)))
    order = PullOrder("r", runner.epoch, "w1", 1, "127.0.0.1:1", 1 << 62, (PeerLoad(0, 0, b"h" * 16, b"n" * 16),))
    assert "page groups" in transfers.pull(order).error
    assert transfers.stats().num_refused_reads == 1 and transfers.stats().num_pulls_failed == 1


def test_worker_flags_and_their_env_defaults(monkeypatch):
    from kvserve.services.cli import build_parser

    args = build_parser().parse_args(["worker"])
    assert args.page_groups is True and args.sliding_group_pages is None
    args = build_parser().parse_args(["worker", "--no-page-groups", "--sliding-group-pages", "64"])
    assert args.page_groups is False and args.sliding_group_pages == 64
    monkeypatch.setenv("KVSERVE_PAGE_GROUPS", "0")
    monkeypatch.setenv("KVSERVE_SLIDING_GROUP_PAGES", "8")
    args = build_parser().parse_args(["worker"])
    assert args.page_groups is False and args.sliding_group_pages == 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--sliding-group-pages", "0"])


# --- validation ------------------------------------------------------------------------------------------------

SLIDING = SlidingGroupPages(num_pages=8, window=AttentionWindow(WINDOW))


def item(req_id="a", start=64, n=1, table=(0, 1, 2, 3, 4), group=(HOLE, HOLE, 4, 5, 6)) -> StepItem:
    """By default a decode at position 64, whose window (41 .. 64) reads pages 2 .. 4."""
    return StepItem(req_id, (7,) * n, start, tuple(table), group_page_table=tuple(group))


def check(*items: StepItem, group: SlidingGroupPages | None = SLIDING) -> dict[str, str]:
    return validate_batch(StepBatch(items), vocab_size=100, num_pages=16, page_size=PAGE, max_model_len=1024,
                          max_step_tokens=512, sliding_group=group)


@pytest.mark.parametrize(("group", "message"), [
    ((), "group_page_table has 0 pages but positions [0, 65) need 5"),
    ((HOLE, HOLE, 4, 5), "group_page_table has 4 pages"),
    ((HOLE, HOLE, 4, 5, 8), "group_page_table page id 8 is out of range [0, 8)"),
    ((HOLE, HOLE, HOLE, 5, 6), "group_page_table[2] is a hole"),
    ((HOLE, HOLE, 4, 5, HOLE), "group_page_table[4] is a hole"),  # the last page
    ((HOLE, HOLE, 4, 5, 6, HOLE), "group_page_table[5] is a hole"),  # past the positions: no hole either
    ((HOLE, HOLE, 6, 5, 6), "page 6 appears twice in its group_page_table"),
])
def test_a_grouped_worker_rejects_a_malformed_sliding_table_alone_and_by_name(group, message):
    rejected = check(item(group=group), item("ok", table=(8, 9, 10, 11, 12), group=(HOLE, HOLE, 0, 1, 2)))
    assert list(rejected) == ["a"] and message in rejected["a"] and rejected["a"].startswith("item 'a'")


def test_the_window_of_start_pos_decides_which_holes_may_be():
    assert check(item(start=40, n=25, group=(HOLE, 4, 3, 5, 6))) == {}  # 40 reads 17 .. 64: pages 1 .. 4
    assert "group_page_table[1] is a hole" in check(item(start=40, n=25, group=(HOLE, HOLE, 3, 5, 6)))["a"]


def test_two_items_sharing_a_written_sliding_page_fail_the_step():
    with pytest.raises(InvalidRequest, match="both write sliding group page 6"):
        check(item(), item("b", table=(8, 9, 10, 11, 12), group=(HOLE, HOLE, 1, 2, 6)))
    with pytest.raises(InvalidRequest, match="'b' reads sliding group page 6, which item 'a' writes"):
        check(item(), item("b", start=48, table=(8, 9, 10, 11), group=(HOLE, 6, 2, 3)))


def test_a_worker_without_groups_rejects_a_sliding_table():
    assert "keeps no page groups" in check(item(), group=None)["a"]
    assert check(item(group=()), group=None) == {}


def test_the_runner_rejects_an_item_without_its_sliding_table(tiny):
    runner = grouped_runner(tiny["gemma3"], "reference")
    out = runner.step(StepBatch((StepItem("a", (5, 6), 0, (0,), sample=True, sampling=GREEDY),)))
    assert [(r.req_id, "group_page_table has 0 pages" in r.message) for r in out.rejected] == [("a", True)]
    assert out.sampled == []
