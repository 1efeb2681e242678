"""``move_grads_`` as a multi-tensor Triton kernel: float16/bfloat16 gradients into float32 ones, one pass.

One program per CHUNK-element chunk of any tensor (the tables of ``triton_stats``: addresses, sizes and
chunk offsets, cached by address). Each value is read once (2 bytes), widened to float32, multiplied
by ``inv_scale`` (one float32 multiply, the rounding of torch's unscale) and written once (4 bytes);
the non-finite bit of the stored value is ORed into the device flag (atomic max of 1.0).
"""

from __future__ import annotations

import torch

from gradscaler.kernels import triton_stats

if triton_stats.AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _move_kernel(
        src_table,
        dst_table,
        offsets_ptr,
        num_tensors,
        flag_ptr,
        inv_ptr,
        DTYPE: tl.constexpr,
        HAS_INV: tl.constexpr,
        CHUNK_SIZE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TABLE_BLOCK: tl.constexpr,
    ):
        tensor, base, count = triton_stats.locate(src_table, offsets_ptr, num_tensors, CHUNK_SIZE, TABLE_BLOCK)
        src = tl.load(src_table + tensor).to(tl.pointer_type(DTYPE))
        dst = tl.load(dst_table + tensor).to(tl.pointer_type(tl.float32))
        if HAS_INV:
            inv = tl.load(inv_ptr)
        else:
            inv = tl.full((), 1.0, tl.float32)
        lanes = tl.arange(0, BLOCK_SIZE)
        bad = tl.zeros((BLOCK_SIZE,), dtype=tl.int32)
        for start in range(0, count, BLOCK_SIZE):
            where = start + lanes
            mask = where < count
            x = tl.load(src + base + where, mask=mask, other=0.0).to(tl.float32)  # exact, inf and NaN kept
            bad = bad | ((x - x) != 0).to(tl.int32)
            if HAS_INV:
                x = x * inv
            tl.store(dst + base + where, x, mask=mask)
        nonfinite = tl.max(bad, axis=0)
        tl.atomic_max(flag_ptr, 1.0, mask=nonfinite > 0)


def move_grads_(src: list[torch.Tensor], dst: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor:
    """See ``gradscaler.kernels.move_grads_``; ``src`` and ``dst`` contiguous."""
    device = src[0].device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    inv = None if inv_scale is None else inv_scale.to(device, torch.float32, non_blocking=True)
    step = triton_stats.MAX_TENSORS
    for i in range(0, len(src), step):
        part, out = src[i : i + step], dst[i : i + step]
        tables, targets = triton_stats.tables_for(part), triton_stats.tables_for(out)
        _move_kernel[(tables.num_chunks,)](
            tables.table,
            targets.table,
            tables.offsets,
            len(part),
            flag,
            flag if inv is None else inv,
            DTYPE=triton_stats.TRITON_DTYPES[part[0].dtype],
            HAS_INV=inv is not None,
            CHUNK_SIZE=triton_stats.CHUNK,
            BLOCK_SIZE=triton_stats.BLOCK,
            TABLE_BLOCK=triton.next_power_of_2(len(part) + 1),
            num_warps=triton_stats.NUM_WARPS,
        )
    return flag
