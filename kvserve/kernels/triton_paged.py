"""The triton paged-attention backend: in-place paged decode and prefill kernels written in Triton, for CUDA
(and, slowly, the CPU under ``TRITON_INTERPRET=1``, which is how the tests run them without a GPU).

Decode (the rows of sequences with one new token), flash-decoding style (kvserve/kernels/triton_attention.py)::

    grid (num_decodes, num_kv_heads, num_splits)       one program: the query heads of one kv head
    keys of sequence b:  [ split 0 | split 1 | ... ]   SPLIT_TOKENS each, walked BLOCK_N at a time
    each key's page:     page_tables[b, pos // page_size], read in place (no gather copy)
    partials [seqs, heads, splits] (acc, max, sum) --reduce_splits_kernel--> out rows

The grid depends only on the number of sequences, the heads and ``meta.max_seq_len`` (a Python int, an upper
bound on every sequence's length: under a CUDA graph, the captured bound). Each split reads its sequence's real
length from ``meta.seq_lens`` on the device and loops zero times past it; a sequence of length 0 (a padding row
of a captured batch) reads nothing and outputs zeros. With a single split the kernel normalises and writes the
output itself. A pure-decode step (``meta.max_q_len == 1``) does no host synchronisation, so it can be captured.

Prefill chunks (q_len > 1, on top of ``start_pos`` cached tokens): grid (work items, num_kv_heads), an item being
BLOCK_Q rows of one chunk; the query heads of the kv head are folded into the tile's rows, so K/V are read once
per kv head; keys up to the item's last row, causally. Building the items syncs with the host (allowed: a step
with a prefill is not captured). Mixed steps run both kernels over their own rows of the flat output.

KV pages: float32, bfloat16 and float16 are read as they are; int8 and fp8 (passed as their bytes) are
dequantised in the kernel, times their per-(token, kv head) scale, or 1.0 without scales (the tensor scheme).
Sliding windows and attention sinks follow kvserve/kernels/window.py: each program walks only the keys its rows read
(the sinks, then the window), so HOLE pages are never touched; sink keys are scored against the query rotated
at its in-cache position (``sink_rope``). A soft cap on the scores (``meta.logits_soft_cap``, Gemma 2) turns every
score s, sink keys' too, into cap * tanh(s / cap) before the masks; the cap is a compile-time constant of the
kernels, so an uncapped model's kernels do none of it.

RoPE with the K/V write (quantised on write, byte for byte as kvserve/kernels/kv_quant.py) and the norms are Triton
kernels too (kvserve/kernels/triton_ops.py); linear layers are F.linear, argmax/logsumexp torch's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvserve.kernels.kv_quant import FORMAT_OF_DTYPE, FORMATS
from kvserve.kernels.paged_attention import AttentionMetadata
from kvserve.kernels.reference import argmax_logsumexp

BLOCK_N = 32  # keys per inner step
BLOCK_Q = 16  # prefill query rows per program (times the padded GQA group)
MIN_SPLIT_TOKENS = 256  # a decode split holds at least this many keys...
TARGET_PROGRAMS = 512  # ...and splits are added until the decode grid has about this many programs


def interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, read when the kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _kernels():
    """The kernel modules, imported on first use (triton is an optional dependency)."""
    from kvserve.kernels import triton_attention, triton_ops

    return triton_attention, triton_ops


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the kernels can run on ``device`` (CUDA, or any device under TRITON_INTERPRET=1); else why not."""
    try:
        _kernels()
    except Exception as e:  # noqa: BLE001 - not installed, or a broken install: say which
        return f"triton is not importable ({type(e).__name__}: {e})"
    if device is not None and device.type != "cuda" and not interpreted():
        return f"it runs on CUDA, not {device.type} (TRITON_INTERPRET=1 runs its kernels on the CPU, slowly)"
    return None


def plan_splits(max_keys: int, num_seqs: int, num_kv_heads: int, min_split_tokens: int = MIN_SPLIT_TOKENS,
                target_programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(num_splits, split_tokens) for decodes of up to ``max_keys`` keys: splits of at least min_split_tokens
    keys (whole BLOCK_Ns) until the grid has about target_programs programs. Python ints only (graph-safe)."""
    blocks = max(1, -(-max_keys // BLOCK_N))
    want = max(1, -(-target_programs // max(1, num_seqs * num_kv_heads)))
    splits = max(1, min(want, -(-max_keys // max(min_split_tokens, 1)), blocks))
    split_tokens = -(-blocks // splits) * BLOCK_N
    return max(1, -(-max(max_keys, 1) // split_tokens)), split_tokens


@dataclass(slots=True)
class TritonState:
    """A step's routing, shared by all layers: which sequences decode, the prefill work items, and the decode
    split plan and partials buffers (made by the first layer, reused by the rest)."""

    meta: AttentionMetadata
    decode_ids: torch.Tensor | None  # [num_decodes] int64 sequences with one new token; None = none
    item_seq: torch.Tensor | None  # [num_items] int64 prefill work items: the sequence...
    item_q: torch.Tensor | None  # ...and the first of its rows, of the chunk's BLOCK_Q-row blocks
    max_keys: int  # the most keys a decode reads (graph-safe: from meta.max_seq_len, window and sinks)
    splits: tuple[int, int] | None = None  # (num_splits, split_tokens)
    part_acc: torch.Tensor | None = None  # [num_decodes, heads, num_splits, head_dim] float32
    part_ml: torch.Tensor | None = None  # [num_decodes, heads, num_splits, 2] float32: max, sum


KV_KINDS = {"float32": 0, "bfloat16": 0, "float16": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}


def _triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _cache_args(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None):
    """(K pages, V pages, K scales, V scales, kind, qmax): the cache as the kernels take it (fp8 as bytes; a
    stand-in pointer where there are no scales)."""
    fmt = FORMAT_OF_DTYPE[kv_cache.dtype]
    stored = kv_cache.view(torch.uint8) if fmt.name.startswith("fp8") else kv_cache
    scales = (kv_scales[0], kv_scales[1]) if kv_scales is not None else (stored[0], stored[1])
    return stored[0], stored[1], scales[0], scales[1], KV_KINDS[fmt.name], fmt.qmax or 1.0


class TritonBackend:
    """Paged attention in Triton over every KV format (``kv_dtypes``); see the module docstring."""

    name = "triton"
    kv_dtypes = tuple(FORMATS)

    def __init__(self, min_split_tokens: int = MIN_SPLIT_TOKENS, target_programs: int = TARGET_PROGRAMS):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"the triton attention backend is not available: {reason}")
        self.attention, self.ops = _kernels()
        self.min_split_tokens = min_split_tokens
        self.target_programs = target_programs

    # --- the model's small ops ---------------------------------------------------------------------------------

    def pack_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, delta, weight, eps)

    def _norm(self, x, delta, weight, eps: float) -> torch.Tensor:
        assert x.stride(-1) == 1, "the residual stream is updated in place: it must be contiguous"
        rows, hidden = x.reshape(-1, x.shape[-1]).shape
        x2 = x.view(rows, hidden)
        d2 = x2 if delta is None else delta.reshape(rows, hidden).contiguous()
        out = torch.empty_like(x2)
        block_r = 4
        self.ops.rms_norm_kernel[(-(-rows // block_r),)](
            x2, d2, weight, out, rows, hidden, eps, x2.stride(0), d2.stride(0), out.stride(0), BLOCK_R=block_r,
            BLOCK_D=_pow2(hidden), HAS_DELTA=delta is not None, DT=_triton_dtype(x.dtype))
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        x = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        rows, inter = x.shape[0], x.shape[1] // 2
        out = x.new_empty((rows, inter))
        block_r, block_i = 4, min(_pow2(inter), 1024)
        self.ops.silu_mul_kernel[(-(-rows // block_r), -(-inter // block_i))](
            x, out, rows, inter, x.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK_I=block_i,
            DT=_triton_dtype(x.dtype))
        return out.view(*gate_up.shape[:-1], inter)

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return argmax_logsumexp(logits)

    # --- attention ---------------------------------------------------------------------------------------------

    def prepare(self, meta: AttentionMetadata) -> TritonState:
        """Routes the step's sequences. A pure-decode step (max_q_len == 1) reads nothing back from the device."""
        device = meta.q_lens.device
        max_keys = meta.window.tokens_kept(meta.max_seq_len)
        if meta.max_q_len <= 1:
            return TritonState(meta, torch.arange(meta.num_seqs, device=device), None, None, max_keys)
        q_lens = meta.q_lens.tolist()
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        items = [(b, q0) for b, n in enumerate(q_lens) if n > 1 for q0 in range(0, n, BLOCK_Q)]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return TritonState(meta, as_tensor(decodes) if decodes else None, as_tensor([b for b, _ in items]),
                           as_tensor([q for _, q in items]), max_keys)

    def qkv_attention(self, qkv, cos, sin, kv_cache, meta, state, scale: float, num_heads: int,
                      num_kv_heads: int, kv_scales: torch.Tensor | None = None, sink_rope=None) -> torch.Tensor:
        """RoPE on q and k, k and v into their slots (one kernel), then the attention of ``forward``."""
        head_dim = cos.shape[-1]
        tokens = qkv.shape[0]
        q_in = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
        k_in = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads,
                                                                                         head_dim)
        v_in = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
        q = qkv.new_empty((tokens, num_heads, head_dim))
        q_sink = torch.empty_like(q) if sink_rope is not None else None
        self._store(q_in, k_in, v_in, kv_cache, kv_scales, meta.slot_mapping, (cos, sin), sink_rope, q, q_sink)
        return self.attend(q, kv_cache, state, scale, kv_scales, q_sink)

    def forward(self, q, k, v, kv_cache, meta, state, scale: float, kv_scales: torch.Tensor | None = None,
                q_sink: torch.Tensor | None = None) -> torch.Tensor:
        """k and v (RoPE applied) into their slots (slot < 0: not written), then attention."""
        self._store(None, k, v, kv_cache, kv_scales, meta.slot_mapping, None, None, None, None)
        return self.attend(q, kv_cache, state, scale, kv_scales, q_sink)

    def _store(self, q, k, v, kv_cache, kv_scales, slots, rope, sink_rope, q_out, q_sink_out) -> None:
        """The rope_store kernel over every token: q rotated into q_out (and q_sink_out), k (rotated when rope
        is given) and v into their slots."""
        tokens, num_kv_heads, head_dim = k.shape
        if tokens == 0:
            return
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
        k_cache, v_cache, k_scales, v_scales, kind, qmax = _cache_args(kv_cache, kv_scales)
        rotate = rope is not None
        cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rotate else (k, k)
        sink_cos, sink_sin = (sink_rope[0].contiguous(), sink_rope[1].contiguous()) if sink_rope else (cos, sin)
        q, q_out = (q, q_out) if rotate else (k, k)
        q_sink_out = q_sink_out if q_sink_out is not None else q_out
        self.ops.rope_store_kernel[(tokens,)](
            q, k, v, cos, sin, sink_cos, sink_sin, q_out, q_sink_out, k_cache, v_cache, k_scales, v_scales, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            q_out.stride(0), q_out.stride(1), k_cache.stride(1), k_cache.stride(2),
            kv_scales.stride(2) if kv_scales is not None else 0, q.shape[1], num_kv_heads,
            HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_H=_pow2(q.shape[1]), BLOCK_KVH=_pow2(num_kv_heads),
            ROTATE=rotate, HAS_SINKS=sink_rope is not None, KV_KIND=kind, QMAX=qmax,
            PER_TOKEN=kv_scales is not None, DT=_triton_dtype(k.dtype),
            enable_fp_fusion=False)  # no FMA: x c + r s rounded as torch rounds it, so quantised bytes match

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, state: TritonState, scale: float,
               kv_scales: torch.Tensor | None = None, q_sink: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's rows q [tokens, heads, d] over their pages (their K/V already written)."""
        meta = state.meta
        assert not meta.window.sinks or q_sink is not None, "attention sinks need the queries rotated at sink_positions"
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        args = _AttendArgs.build(q, q_sink, kv_cache, kv_scales, meta, scale)
        if state.decode_ids is not None:
            self._decode(args, out, state)
        if state.item_seq is not None:
            self._prefill(args, out, state)
        return out

    def _decode(self, a: _AttendArgs, out: torch.Tensor, state: TritonState) -> None:
        meta, num_heads, num_kv_heads = state.meta, a.q.shape[1], a.k_cache.shape[2]
        num_decodes = state.decode_ids.shape[0]
        if state.splits is None:
            state.splits = plan_splits(state.max_keys, num_decodes, num_kv_heads, self.min_split_tokens,
                                       self.target_programs)
        num_splits, split_tokens = state.splits
        direct = num_splits == 1
        if not direct and state.part_acc is None:
            state.part_acc = a.q.new_empty((num_decodes, num_heads, num_splits, a.head_dim), dtype=torch.float32)
            state.part_ml = a.q.new_empty((num_decodes, num_heads, num_splits, 2), dtype=torch.float32)
        part_acc = state.part_acc if not direct else out
        part_ml = state.part_ml if not direct else out
        group, w = num_heads // num_kv_heads, meta.window
        ka = self.attention
        ka.decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
            a.q, a.q_sink, a.k_cache, a.v_cache, a.k_scales, a.v_scales, meta.page_tables, meta.seq_lens,
            meta.cu_q_lens, state.decode_ids, out, part_acc, part_ml, a.qk_scale,
            a.q.stride(0), a.q.stride(1), out.stride(0), out.stride(1), meta.page_tables.stride(0), *a.strides,
            num_heads, num_splits, GROUP=group, BLOCK_G=max(16, _pow2(group)), HEAD_DIM=a.head_dim,
            BLOCK_D=a.block_d, PAGE_SIZE=meta.page_size, BLOCK_N=BLOCK_N, SPLIT_TOKENS=split_tokens,
            WINDOW=w.window, SINKS=w.sinks, KV_KIND=a.kind, HAS_SCALES=a.has_scales, HAS_SINKS=a.has_sinks,
            SOFT_CAP=a.soft_cap, DIRECT=direct, DOT_DTYPE=a.dot_dtype, PREC=a.prec)
        if not direct:
            ka.reduce_splits_kernel[(num_decodes, num_heads)](
                state.part_acc, state.part_ml, meta.seq_lens, meta.cu_q_lens, state.decode_ids, out, out.stride(0),
                out.stride(1), num_heads, num_splits, HEAD_DIM=a.head_dim, BLOCK_D=a.block_d,
                BLOCK_S=_pow2(num_splits), SPLIT_TOKENS=split_tokens, WINDOW=w.window, SINKS=w.sinks)

    def _prefill(self, a: _AttendArgs, out: torch.Tensor, state: TritonState) -> None:
        meta, num_heads, num_kv_heads = state.meta, a.q.shape[1], a.k_cache.shape[2]
        group, w = num_heads // num_kv_heads, meta.window
        self.attention.prefill_kernel[(state.item_seq.shape[0], num_kv_heads)](
            a.q, a.q_sink, a.k_cache, a.v_cache, a.k_scales, a.v_scales, meta.page_tables, meta.q_lens,
            meta.start_pos, meta.cu_q_lens, state.item_seq, state.item_q, out, a.qk_scale,
            a.q.stride(0), a.q.stride(1), out.stride(0), out.stride(1), meta.page_tables.stride(0), *a.strides,
            GROUP=group, BLOCK_G=_pow2(group), BLOCK_Q=BLOCK_Q, HEAD_DIM=a.head_dim, BLOCK_D=a.block_d,
            PAGE_SIZE=meta.page_size, BLOCK_N=BLOCK_N, WINDOW=w.window, SINKS=w.sinks, KV_KIND=a.kind,
            HAS_SCALES=a.has_scales, HAS_SINKS=a.has_sinks, SOFT_CAP=a.soft_cap, DOT_DTYPE=a.dot_dtype,
            PREC=a.prec)


@dataclass(slots=True)
class _AttendArgs:
    """What both attention kernels take about q and the layer's cache."""

    q: torch.Tensor
    q_sink: torch.Tensor
    k_cache: torch.Tensor  # [num_pages, page_size, kv_heads, d] (fp8 as uint8)
    v_cache: torch.Tensor
    k_scales: torch.Tensor
    v_scales: torch.Tensor
    strides: tuple[int, int, int, int, int]  # page, token, head of the pages; page, token of the scales
    kind: int
    has_scales: bool
    has_sinks: bool
    head_dim: int
    block_d: int
    qk_scale: float  # what q.k is multiplied by: the softmax scale in log2 units (the kernels use exp2); with a
    # soft cap, scale / cap (tanh's argument; the kernels multiply tanh by cap * log2(e))
    soft_cap: float  # meta.logits_soft_cap, a compile-time constant of the kernels (0.0: no cap, no extra ops)
    dot_dtype: object
    prec: str

    @staticmethod
    def build(q, q_sink, kv_cache, kv_scales, meta: AttentionMetadata, scale: float) -> _AttendArgs:
        assert q.stride(-1) == 1 and kv_cache.is_contiguous()
        k_cache, v_cache, k_scales, v_scales, kind, _ = _cache_args(kv_cache, kv_scales)
        s_strides = (kv_scales.stride(1), kv_scales.stride(2)) if kv_scales is not None else (0, 0)
        has_sinks = bool(meta.window.sinks) and q_sink is not None
        # fp32 models: exact fp32 dots; bf16/fp16 on a GPU: the tensor cores' dtype. The interpreter keeps
        # bf16 as raw bits in its dots, so it always gets fp32 ones.
        fp32 = q.dtype == torch.float32 or interpreted()
        cap = float(meta.logits_soft_cap)
        qk_scale = scale / cap if cap > 0 else scale * math.log2(math.e)
        return _AttendArgs(q, q_sink if has_sinks else q, k_cache, v_cache, k_scales, v_scales,
                           (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *s_strides), kind,
                           kv_scales is not None, has_sinks, q.shape[-1], max(16, _pow2(q.shape[-1])),
                           qk_scale, cap, _triton_dtype(torch.float32 if fp32 else q.dtype), "ieee" if fp32 else "tf32")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
