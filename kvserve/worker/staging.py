"""Step inputs for a CUDA worker: built on the host, packed into one pinned int64 block, copied to the GPU in one
``non_blocking`` copy on the worker's stream, and viewed there as the step's tensors.

A pageable ``tensor.to("cuda")`` returns only once the bytes are staged, once per tensor; a pinned block lets the
host go on building the step while the copy runs in stream order, ahead of the kernels that read it::

    host (pinned):  [ token_ids | positions | slot_mapping | ... | page_tables ]  --one copy-->  device block
    device views:     token_ids   positions   slot_mapping   ...   page_tables   (same offsets, same shapes)

torch's caching host allocator keeps a pinned block until the copies that read it have run, so a block is never
overwritten under a copy in flight. CPU workers never come here.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.kernels.paged_attention import AttentionMetadata


def pack(tensors: list[torch.Tensor], pin: bool) -> tuple[torch.Tensor, list[tuple[int, torch.Size]]]:
    """The tensors (CPU, int64) in one flat block (pinned when ``pin``), and each one's (offset, shape)."""
    layout, offset = [], 0
    for t in tensors:
        layout.append((offset, t.shape))
        offset += t.numel()
    block = torch.empty(offset, dtype=torch.int64, pin_memory=pin)
    for t, (start, shape) in zip(tensors, layout, strict=True):
        block[start:start + t.numel()].view(shape).copy_(t)
    return block, layout


def unpack(block: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    """Views of ``block`` with pack's layout."""
    return [block[start:start + shape.numel()].view(shape) for start, shape in layout]


def stage(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The int64 CPU tensors on ``device``, through one pinned block and one non_blocking copy (on the current
    stream; no host synchronisation)."""
    block, layout = pack(tensors, pin=device.type == "cuda")
    return unpack(block.to(device, non_blocking=True), layout)


_INT_FIELDS = [f.name for f in dataclasses.fields(AttentionMetadata)
               if f.name not in ("page_size", "max_q_len", "max_seq_len", "window", "logits_soft_cap")]


def stage_metadata(meta: AttentionMetadata, extra: list[torch.Tensor],
                   device: torch.device) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """A host-built metadata (build_metadata on the CPU) and ``extra`` int64 tensors (token ids, rows to
    sample), all on ``device`` in one staged copy."""
    names = [n for n in _INT_FIELDS if getattr(meta, n) is not None]
    staged = stage([getattr(meta, n) for n in names] + extra, device)
    return dataclasses.replace(meta, **dict(zip(names, staged[:len(names)], strict=True))), staged[len(names):]
