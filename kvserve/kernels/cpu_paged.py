"""The CPU backend: decode tokens attend through a small C++ kernel that reads K/V in place from the page pool
(``kvserve/kernels/paged_decode.cpp``), and so do prefill chunks (``kvserve/kernels/paged_prefill.cpp``; shapes it does
not take go through the reference backend's gather + SDPA). Sliding windows and attention sinks
(kvserve/kernels/window.py) go through the same kernels, which read only the pages of each query's sinks and window; the
linear layers run over weights packed once into column panels (``kvserve/kernels/packed_linear.cpp``), or, for a weight
whose float32 values are exactly 4- or 8-bit blocks (a quantised GGUF's, such as the default model's), over those blocks
(``kvserve/kernels/block_linear.cpp``): the same floats in a fifth of the bytes, which a decode step reads once.

Why: in a decode step the reference backend copies every sequence's pages into a padded batch and SDPA then
reads the copy, so K/V cross memory three times; with contexts of a few hundred tokens that gather cost as
much as all the GEMMs. The kernel walks each sequence's page table once, with an online softmax, on torch's
intra-op (OpenMP) threads. For prefill chunks the reference made a dozen small torch ops per chunk and layer;
the prefill kernel reads the pages in place, a block of up to 16 query rows and one kv head per work item.

The pool is float32, or 1-byte elements (int8, float8_e4m3fn, float8_e5m2: ``kvserve/kernels/kv_quant.py``) with one
scale per token and kv head in ``kv_scales`` or none (the tensor scheme). The kernels read those elements in
place as well, and ``rope_store`` quantises on write, byte for byte as ``kv_quant`` does in torch.

The extension is compiled on first use with torch.utils.cpp_extension (g++ and ninja), cached
under torch's extension directory, and built ahead by ``make kernels`` (``python -m kvserve.kernels.cpu_paged``).
When it cannot be built, ``get_backend("auto", cpu)`` falls back to the reference backend and says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu_march import cpu_flags_line, kernel_march
from kvserve.kernels.paged_attention import AttentionMetadata, write_kv
from kvserve.kernels.reference import ReferenceBackend, ReferenceState, attend_groups, group_state, sink_query

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / name
           for name in ("cpu_ops.cpp", "paged_decode.cpp", "paged_prefill.cpp", "packed_linear.cpp", "block_linear.cpp",
                        "layer_ops.cpp")]
# torch rebuilds when SOURCES change; the headers are in the extension's name instead
HEADERS = [Path(__file__).parent / name for name in ("cpu_vec.h", "cpu_parallel.h")]
# -fopenmp: at::parallel_for is a header template that runs its loop inline, on one thread, unless the code
# that instantiates it is compiled with OpenMP. The extension then links the libgomp torch already loaded.
OPENMP = ["-fopenmp"]
PANEL = 32  # output columns per packed weight panel (kPanel in packed_linear.cpp), and weights per block along K
BLOCK_BITS = (4, 8)  # the block formats pack_weight tries, in order (block_linear.cpp)


def compile_flags() -> list[str]:
    """-march from KVSERVE_CPU_MARCH (kvserve/kernels/cpu_march.py): native by default, a level in a container image."""
    return ["-O3", "-ffast-math", f"-march={kernel_march()}"]


def _build_name(cflags: list[str]) -> str:
    """The extension's name, which keys torch's build cache: ``-march=native`` code must not be reused on a
    machine with other instruction sets (a shared home directory), so the CPU's flags are part of it (a named
    -march is in ``cflags``, and its build is the same on every CPU that runs it), and so is the text of every
    source and header: torch's JIT build does not watch included headers, and two checkouts of different
    sources (a worktree beside the main one) must not rebuild one shared directory under each other."""
    flags = cpu_flags_line() if "-march=native" in cflags else ""
    texts = "".join(f.read_text() for f in [*SOURCES, *HEADERS])
    digest = hashlib.sha256(f"{platform.machine()} {flags} {cflags} {texts}".encode()).hexdigest()[:12]
    return f"kvserve_paged_decode_{digest}"


@cache
def load_extension():
    """The compiled module (built on first call, then cached on disk). Raises when it cannot be built."""
    from torch.utils.cpp_extension import load

    try:  # torch runs `ninja` from PATH; the ninja wheel's binary may not be on it (an unactivated venv)
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    sources, cflags = [str(s) for s in SOURCES], compile_flags()
    try:
        return _load_guarded(load, _build_name(cflags + OPENMP), sources, extra_cflags=cflags + OPENMP,
                             extra_ldflags=OPENMP)
    except Exception as e:  # noqa: BLE001 - a compiler without OpenMP (Apple clang): build without it
        log.warning("cpu kernels: the build with OpenMP failed (%s); trying without OpenMP, where they run on "
                    "one thread", str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    return _load_guarded(load, _build_name(cflags), sources, extra_cflags=cflags)


def _load_guarded(load, name: str, sources: list[str], **flags):
    """torch's ``load`` under an flock of our own on its build directory. torch marks a build in progress with
    a ``lock`` file that only the builder removes: a process killed mid-build (a worker stopped during its first
    start, a test's timeout) leaves it, and every later load then waits for it forever. The flock is released
    by the kernel when its holder dies, so whoever holds it and still finds ``lock`` knows it is stale."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvserve.flock", "a") as guard:
        fcntl.flock(guard.fileno(), fcntl.LOCK_EX)  # waits while another kvserve process loads or builds it
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("cpu kernels: removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        # copies: torch appends its own flags to the lists it is given (OPENMP grew torch's -L/-l flags, and with
        # them the names _build_name gave afterwards)
        return load(name, sources, build_directory=str(build_dir), verbose=False,
                    **{key: list(value) for key, value in flags.items()})


def unavailable_reason() -> str | None:
    """None when the extension loads; else why not (no compiler, no ninja, a build error)."""
    try:
        load_extension()
    except Exception as e:  # noqa: BLE001 - any build failure means: use the reference backend
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None


@dataclass(slots=True)
class BlockPanels:
    """A float32 weight matrix [N, K] held as the exact 4- or 8-bit blocks its values are
    (``kvserve/kernels/block_linear.cpp``): per panel p of 32 output columns, block b of 32 along K and column j,
    w[32 p + j, 32 b + i] = d[p, b, j] * q + m[p, b, j] (4 bits; m is empty for 8 bits, where w = d * q)."""

    q: torch.Tensor  # [N / 32, K, 16] uint8: column j in the low nibble of byte j, j + 16 in the high one; or
    #                  [N / 32, K, 32] int8
    d: torch.Tensor  # [N / 32, K / 32, 32] float32
    m: torch.Tensor  # [N / 32, K / 32, 32] float32, or empty

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """w[ids] as float32 [len(ids), K], the same floats (a tied embedding read from the LM head)."""
        p, j = ids // PANEL, ids % PANEL
        if self.m.numel():
            q = (self.q[p, :, j % 16] >> (4 * (j // 16)).unsqueeze(1)) & 15
        else:
            q = self.q[p, :, j]
        w = q.float() * self.d[p, :, j].repeat_interleave(PANEL, dim=1)
        return w + self.m[p, :, j].repeat_interleave(PANEL, dim=1) if self.m.numel() else w


@dataclass(slots=True)
class PrefillChunks:
    """A step's prefill chunks for ``kvserve/kernels/paged_prefill.cpp``: where their rows start in the step's flat
    run, how many there are, the position of the first, and their page tables."""

    seqs: list[int]  # the chunks' sequences in the step (for the reference groups, when the kernel is not used)
    row_start: torch.Tensor  # [num_chunks] int64
    q_lens: torch.Tensor  # [num_chunks] int64
    start_pos: torch.Tensor  # [num_chunks] int64
    tables: torch.Tensor  # [num_chunks, max_pages] int64


@dataclass(slots=True)
class CPUState:
    decode_index: torch.Tensor | None  # [num_decodes] flat token (= sequence) rows of the decodes; None = all
    tables: torch.Tensor  # [num_decodes, max_pages] int64
    seq_lens: torch.Tensor  # [num_decodes] int64
    chunks: PrefillChunks | None  # the prefill chunks; None when every row is a decode
    meta: AttentionMetadata
    prefill: ReferenceState | None = None  # the chunks as reference groups, for shapes paged_prefill does not take
    native_prefill: bool | None = None  # whether paged_prefill takes this step's shapes (decided by the first layer)


class CPUPagedBackend:
    """float32 on CPU, over float32, int8 or float8 pages (``kv_dtypes``). Decodes and prefill chunks: the
    in-place kernels, with or without a sliding window and sinks (prefill chunks of shapes the kernel does not
    take: the reference backend's groups). Linear
    layers: weights packed once into panels of 32 output columns (``kvserve/kernels/packed_linear.cpp``); MKL's sgemm
    repacks them on every call, which costs a decode step more than the product. A weight that is exact 4- or
    8-bit blocks is kept as those blocks and unpacked into panels in cache, per call (``block_linear.cpp``):
    bit for bit the float32 panels' result. ``block_weights=False`` (or KVSERVE_BLOCK_WEIGHTS=0) turns that off,
    and ``prefill_kernel=False`` (KVSERVE_PREFILL_KERNEL=0) sends prefill chunks through the reference, for
    comparisons."""

    name = "cpu"
    kv_dtypes = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")

    def __init__(self, block_weights: bool | None = None, prefill_kernel: bool | None = None):
        self.ext = load_extension()
        if block_weights is None:  # KVSERVE_BLOCK_WEIGHTS=0: float32 panels only (for comparisons)
            block_weights = os.environ.get("KVSERVE_BLOCK_WEIGHTS", "1") != "0"
        if prefill_kernel is None:  # KVSERVE_PREFILL_KERNEL=0: prefill through the reference (for comparisons)
            prefill_kernel = os.environ.get("KVSERVE_PREFILL_KERNEL", "1") != "0"
        self.block_weights = block_weights
        self.prefill_kernel = prefill_kernel
        self.reference = ReferenceBackend()

    def pack_weight(self, w: torch.Tensor) -> torch.Tensor | BlockPanels:
        """[N, K] -> exact 4- or 8-bit block panels when every weight is one (a quantised GGUF's), else float32
        panels [N / 32, K, 32]; a w whose N is not a multiple of 32 stays as it is (F.linear)."""
        if w.dim() != 2 or w.shape[0] % PANEL or w.dtype != torch.float32:
            return w
        for bits in BLOCK_BITS if self.block_weights else ():
            parts = self.ext.pack_blocks(w, bits)
            if parts:
                return BlockPanels(*parts)
        return self.ext.pack_panels(w)

    def linear(self, x: torch.Tensor, w: torch.Tensor | BlockPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, BlockPanels):
            y = self.ext.linear_blocks(x.contiguous(), w.q, w.d, w.m)
        elif w.dim() == 2:
            return F.linear(x, w, bias)
        else:
            y = self.ext.linear_packed(x.contiguous(), w)
        return y if bias is None else y.add_(bias)

    def prepare(self, meta: AttentionMetadata) -> CPUState:
        q_lens = meta.q_lens.tolist()
        prefills = [i for i, n in enumerate(q_lens) if n > 1]
        if not prefills:
            return CPUState(None, meta.page_tables, meta.seq_lens, None, meta)
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        idx = torch.tensor(decodes, dtype=torch.long, device=meta.positions.device)
        pidx = torch.tensor(prefills, device=meta.positions.device)
        chunks = PrefillChunks(prefills, meta.cu_q_lens[pidx], meta.q_lens[pidx], meta.start_pos[pidx],
                               meta.page_tables[pidx].contiguous())
        return CPUState(meta.cu_q_lens[idx], meta.page_tables[idx].contiguous(), meta.seq_lens[idx], chunks, meta)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ext.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ext.add_rms_norm_(x, delta.contiguous(), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ext.silu_mul(gate_up.contiguous())

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ext.argmax_logsumexp(logits.float().contiguous())

    def qkv_attention(self, qkv, cos, sin, kv_cache, meta, state, scale: float, num_heads: int,
                      num_kv_heads: int, kv_scales: torch.Tensor | None = None, sink_rope=None) -> torch.Tensor:
        """RoPE, the K/V write (quantised into a 1-byte cache, with the scales into ``kv_scales`` unless it is
        None) and the split into heads in one pass (``kvserve/kernels/layer_ops.cpp``), then forward's attention."""
        q = self.ext.rope_store(qkv.contiguous(), cos.contiguous(), sin.contiguous(), num_heads, num_kv_heads,
                                kv_cache, kv_scales, meta.slot_mapping)
        return self._attend(q, kv_cache, state, scale, kv_scales, sink_query(qkv, sink_rope, num_heads))

    def forward(self, q, k, v, kv_cache, meta, state, scale: float,
                kv_scales: torch.Tensor | None = None, q_sink: torch.Tensor | None = None) -> torch.Tensor:
        # a 1-byte cache: kv_quant.write_kv_quantised; the kernels check dtypes and shapes
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self._attend(q, kv_cache, state, scale, kv_scales, q_sink)

    def _attend(self, q, kv_cache, state: CPUState, scale: float, kv_scales: torch.Tensor | None,
                q_sink: torch.Tensor | None = None) -> torch.Tensor:
        """Decodes and prefill chunks through the kernels. A sliding window and sinks go with them: the kernels
        read only the pages of each query's sinks and window (kvserve/kernels/window.py), the sinks against q_sink;
        so does the soft cap on the scores (the reference groups of the prefill fallback read it from the metadata
        too, through group_state)."""
        window, cap = state.meta.window, state.meta.logits_soft_cap
        assert not window.sinks or q_sink is not None, "attention sinks need the queries rotated at sink_positions"
        q = q.contiguous()
        q_sink = q_sink.contiguous() if window.sinks else None
        if state.chunks is None:
            return self.ext.paged_decode(q, kv_cache, kv_scales, state.tables, state.seq_lens, scale, window.window,
                                         window.sinks, q_sink, cap)
        out = torch.empty_like(q)
        if state.decode_index.numel():
            idx = state.decode_index
            out.index_copy_(0, idx, self.ext.paged_decode(
                q.index_select(0, idx), kv_cache, kv_scales, state.tables, state.seq_lens, scale, window.window,
                window.sinks, None if q_sink is None else q_sink.index_select(0, idx), cap))
        if state.native_prefill is None:
            _, heads, head_dim = q.shape
            state.native_prefill = self.prefill_kernel and self.ext.paged_prefill_supports(
                head_dim, heads, kv_cache.shape[3], kv_cache.shape[2])
        c = state.chunks
        if state.native_prefill:
            return self.ext.paged_prefill(q, kv_cache, kv_scales, c.tables, c.row_start, c.q_lens, c.start_pos,
                                          scale, out, window.window, window.sinks, q_sink, cap)
        if state.prefill is None:
            state.prefill = ReferenceState([group_state(state.meta, [i]) for i in c.seqs])
        return attend_groups(q, kv_cache, state.prefill.groups, scale, out, kv_scales=kv_scales, q_sink=q_sink)


def main() -> int:
    """``python -m kvserve.kernels.cpu_paged``: builds the extension now (``make kernels`` runs it)."""
    reason = unavailable_reason()
    if reason:
        print(f"kvserve: the cpu attention kernel did not build ({reason}); workers on CPU will use the "
              f"reference backend", file=sys.stderr)
        return 0
    print("kvserve: cpu attention kernel built", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
