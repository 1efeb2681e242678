"""``move_grads_`` as a multi-tensor Triton kernel: float16/bfloat16 gradients into float32 ones, one pass.

One program per CHUNK-element chunk of any tensor (the tables of ``triton_stats``: addresses, sizes and
chunk offsets, cached by address). Each value is read once (2 bytes), widened to float32, multiplied
by ``factor`` (one float32 multiply, the rounding of torch's unscale) and written once (4 bytes); on
the way the non-finite bit of the stored value is ORed into the device flag (atomic max of 1.0) and,
for a norm, the value times ``norm_inv`` is folded into the chunk's partial term exactly as
``triton_stats`` folds it (``accumulate``), whose second launch then gives each tensor's norm.
"""

from __future__ import annotations

import torch

from gradscaler.kernels import GradStats, moved, triton_stats

MOVE_DTYPES = (torch.float16, torch.bfloat16)
"""The gradient dtypes the move takes (those of parameters that get float32 masters)."""

if triton_stats.AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_tensors"])  # one compiled kernel for every tensor count
    def _move_kernel(
        src_table,
        dst_table,
        offsets_ptr,
        num_tensors,
        flag_ptr,
        factor_ptr,
        partial_ptr,
        norm_inv_ptr,
        p,
        DTYPE: tl.constexpr,
        HAS_FACTOR: tl.constexpr,
        MODE: tl.constexpr,
        ACC: tl.constexpr,
        HAS_NORM_INV: tl.constexpr,
        CHUNK_SIZE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TABLE_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tensor, base, count = triton_stats.locate(src_table, offsets_ptr, num_tensors, CHUNK_SIZE, TABLE_BLOCK)
        src = tl.load(src_table + tensor).to(tl.pointer_type(DTYPE))
        dst = tl.load(dst_table + tensor).to(tl.pointer_type(tl.float32))
        if HAS_FACTOR:
            factor = tl.load(factor_ptr)
        else:
            factor = tl.full((), 1.0, tl.float32)
        if HAS_NORM_INV:
            norm_inv = tl.load(norm_inv_ptr).to(ACC)
        else:
            norm_inv = tl.full((), 1.0, ACC)
        lanes = tl.arange(0, BLOCK_SIZE)
        acc = tl.zeros((BLOCK_SIZE,), dtype=ACC)
        bad = tl.zeros((BLOCK_SIZE,), dtype=tl.int32)
        for start in range(0, count, BLOCK_SIZE):
            where = start + lanes
            mask = where < count
            raw = tl.load(src + base + where, mask=mask, other=0.0)  # masked lanes add 0 to every norm term
            acc, bad = triton_stats.accumulate(raw, acc, bad, norm_inv, p, MODE, ACC)
            x = raw.to(tl.float32)  # exact, inf and NaN kept
            if HAS_FACTOR:
                x = x * factor
            tl.store(dst + base + where, x, mask=mask)
        nonfinite = tl.max(bad, axis=0)
        tl.atomic_max(flag_ptr, 1.0, mask=nonfinite > 0)
        if MODE == 2:
            tl.store(partial_ptr + pid, triton_stats.nan_max(acc).to(tl.float64))
        elif MODE != 0:
            tl.store(partial_ptr + pid, tl.sum(acc, axis=0).to(tl.float64))


def move_grads_(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    factor: torch.Tensor | None,
    norm_type: float | None = None,
    norm_inv: torch.Tensor | None = None,
) -> GradStats:
    """See ``gradscaler.kernels.move_grads_``; ``src`` and ``dst`` contiguous."""
    if src[0].dtype not in MOVE_DTYPES:
        raise ValueError(f"move_grads_ takes float16 or bfloat16 gradients, got {src[0].dtype}.")
    device = src[0].device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    mode = triton_stats.mode_of(norm_type)
    p = float(norm_type or 0.0)
    acc = triton_stats.accumulator(src[0].dtype, mode)
    factor = None if factor is None else moved(factor, device, torch.float32)
    if norm_inv is not None and mode != triton_stats.MODE_CHECK:
        norm_inv = moved(norm_inv, device, torch.float32)
    else:
        norm_inv = None
    norms: list[torch.Tensor] = []
    step = triton_stats.MAX_TENSORS
    for i in range(0, len(src), step):
        part, out = src[i : i + step], dst[i : i + step]
        tables, targets = triton_stats.tables_for(part), triton_stats.tables_for(out)
        partial = torch.empty(tables.num_chunks if mode else 1, dtype=torch.float64, device=device)
        triton_stats.launch(
            _move_kernel,
            (tables.num_chunks,),
            tables.table,
            targets.table,
            tables.offsets,
            len(part),
            flag,
            flag if factor is None else factor,
            partial,
            flag if norm_inv is None else norm_inv,
            p,
            DTYPE=triton_stats.TRITON_DTYPES[part[0].dtype],
            HAS_FACTOR=factor is not None,
            MODE=mode,
            ACC=acc,
            HAS_NORM_INV=norm_inv is not None,
            CHUNK_SIZE=triton_stats.CHUNK,
            BLOCK_SIZE=triton_stats.BLOCK,
            TABLE_BLOCK=triton_stats.TABLE_BLOCK,
            num_warps=triton_stats.NUM_WARPS,
            **triton_stats.COMPILE_OPTIONS,
        )
        if mode:
            norms.append(triton_stats.tensor_norms(partial, tables, len(part), p, mode, torch.float32))
    return GradStats(flag, (norms[0] if len(norms) == 1 else torch.cat(norms)) if norms else None)
