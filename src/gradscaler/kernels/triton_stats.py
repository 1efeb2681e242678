"""``grad_stats`` as a multi-tensor Triton kernel: one read of every gradient, two launches.

Launch 1 runs one program per CHUNK-element chunk of any tensor. A program finds its tensor from a
small table of chunk offsets, reads its chunk once, ORs a non-finite bit into the device flag (atomic
max of 1.0, so the result does not depend on order) and, for a norm, writes one partial (sum of
squares, sum of ``|x|**p``, or max ``|x|``, of ``x * inv_scale``; sums in float64). The flag is read
off the stored values (float64 ones are not narrowed). Launch 2 reduces each tensor's partials in a
fixed order, so norms are deterministic run to run. Float64 gradients above ~1e154 get an inf
2-norm here (their squares overflow float64); the CPU route rescales them. The tables (addresses,
sizes, chunk offsets) are built on the host and cached by the gradients' addresses, which the
caching allocator keeps stable across iterations.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch

from gradscaler.kernels import GradStats, KernelUnavailableError, moved

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised on machines without Triton
    AVAILABLE = False

# Defaults from benchmarks/tune_kernel.py on an H100 (355M float32 values, 291 tensors).
CHUNK = int(os.environ.get("GRADSCALER_CHUNK", 65536))
BLOCK = int(os.environ.get("GRADSCALER_BLOCK", 4096))
NUM_WARPS = int(os.environ.get("GRADSCALER_WARPS", 8))
MAX_TENSORS = 2048
TABLE_BLOCK = 1024
"""Chunk offsets ``locate`` reads per step: two steps at ``MAX_TENSORS`` tensors, one below 1024."""
RBLOCK = 256
"""Partials the second launch reads per step."""
MODE_CHECK, MODE_SQUARES, MODE_MAX, MODE_POWER = 0, 1, 2, 3
MODES = (MODE_CHECK, MODE_SQUARES, MODE_MAX, MODE_POWER)
"""Every MODE a launch can ask for (``mode_of``): the compile test enumerates these."""
COMPILE_OPTIONS: dict[str, bool] = {"enable_fp_fusion": False}
"""Compiler options of every launch of the package's kernels. Floating-point contraction off: a
multiply followed by an add stays two roundings (no FMA), as in torch's ops and Triton's interpreter,
whatever Triton's default is (on in 3.9, off from 3.10). The move kernel's norms equal the read
pass's bit for bit only if neither contracts; ``tests/test_kernel_compile.py`` reads the PTX."""

if AVAILABLE:

    @triton.jit
    def locate(table_ptr, offsets_ptr, num_tensors, CHUNK_SIZE: tl.constexpr, TABLE_BLOCK: tl.constexpr):
        """This program's chunk: (its tensor's index in the table, first value's offset, values in it).
        The chunk offsets are read TABLE_BLOCK at a time (one block up to TABLE_BLOCK tensors), so
        one compiled kernel serves every tensor count."""
        pid = tl.program_id(0)
        tensor = pid * 0
        for start in range(0, num_tensors, TABLE_BLOCK):
            index = start + tl.arange(0, TABLE_BLOCK)
            ends = tl.load(offsets_ptr + 1 + index, mask=index < num_tensors, other=2147483647)
            tensor += tl.sum((ends <= pid).to(tl.int32), axis=0)
        first = tl.load(offsets_ptr + tensor)
        numel = tl.load(table_ptr + num_tensors + tensor)
        base = (pid - first).to(tl.int64) * CHUNK_SIZE
        return tensor, base, tl.minimum(numel - base, CHUNK_SIZE)

    @triton.jit
    def accumulate(raw, acc, bad, inv, p, MODE: tl.constexpr, ACC: tl.constexpr):
        """Fold one block of stored values into the running norm term and the non-finite bits.

        The flag is read off the stored dtype (a float64 1e300 is finite; cast to float32 it would
        not be). Norm terms are of ``raw * inv``, multiplied before any power, in ``ACC``.
        """
        if raw.dtype == tl.float64:
            exact = raw
        else:
            exact = raw.to(tl.float32)  # exact for 16-bit values, inf and NaN included
        bad = bad | ((exact - exact) != 0).to(tl.int32)  # inf - inf and NaN - NaN are NaN; finite gives 0
        if MODE != 0:
            y = raw.to(ACC) * inv
            if MODE == 1:
                acc += y * y
            elif MODE == 2:
                acc = tl.maximum(acc, tl.abs(y), propagate_nan=tl.PropagateNan.ALL)
            elif MODE == 3:
                acc += tl.exp2(p * tl.log2(tl.abs(y)))
        return acc, bad

    @triton.jit
    def nan_max(values):
        """The max of a block, NaN when any lane is NaN (a reduction max may drop NaN; a sum keeps it)."""
        has_nan = tl.max((values != values).to(tl.int32), axis=0)
        return tl.where(has_nan > 0, tl.sum(values, axis=0), tl.max(values, axis=0))

    @triton.jit(do_not_specialize=["num_tensors"])  # one compiled kernel for every tensor count
    def _chunk_kernel(
        table_ptr,
        offsets_ptr,
        num_tensors,
        partial_ptr,
        flag_ptr,
        inv_ptr,
        p,
        DTYPE: tl.constexpr,
        ACC: tl.constexpr,
        MODE: tl.constexpr,
        HAS_INV: tl.constexpr,
        ALIGNED: tl.constexpr,
        CHUNK_SIZE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TABLE_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tensor, base, count = locate(table_ptr, offsets_ptr, num_tensors, CHUNK_SIZE, TABLE_BLOCK)
        ptr = tl.load(table_ptr + tensor).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        if HAS_INV:
            inv = tl.load(inv_ptr).to(ACC)
        else:
            inv = tl.full((), 1.0, ACC)
        full = (count // BLOCK_SIZE) * BLOCK_SIZE
        acc = tl.zeros((BLOCK_SIZE,), dtype=ACC)
        bad = tl.zeros((BLOCK_SIZE,), dtype=tl.int32)
        lanes = tl.arange(0, BLOCK_SIZE)
        for start in range(0, full, BLOCK_SIZE):  # whole blocks: unmasked, vectorised loads
            raw = tl.load(ptr + base + start + lanes)
            acc, bad = accumulate(raw, acc, bad, inv, p, MODE, ACC)
        tail = full + lanes  # the partial last block of this chunk (empty when count % BLOCK == 0)
        raw = tl.load(ptr + base + tail, mask=tail < count, other=0.0)
        acc, bad = accumulate(raw, acc, bad, inv, p, MODE, ACC)
        nonfinite = tl.max(bad, axis=0)
        tl.atomic_max(flag_ptr, 1.0, mask=nonfinite > 0)
        if MODE == 2:
            tl.store(partial_ptr + pid, nan_max(acc).to(tl.float64))
        elif MODE != 0:
            tl.store(partial_ptr + pid, tl.sum(acc, axis=0).to(tl.float64))

    @triton.jit
    def _tensor_kernel(partial_ptr, offsets_ptr, norms_ptr, p, MODE: tl.constexpr, RBLOCK: tl.constexpr):
        tensor = tl.program_id(0)
        lo = tl.load(offsets_ptr + tensor)
        hi = tl.load(offsets_ptr + tensor + 1)
        acc = tl.zeros((RBLOCK,), dtype=tl.float64)
        for start in range(lo, hi, RBLOCK):
            idx = start + tl.arange(0, RBLOCK)
            v = tl.load(partial_ptr + idx, mask=idx < hi, other=0.0)
            if MODE == 2:
                acc = tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
            else:
                acc += v
        if MODE == 2:
            norm = nan_max(acc)
        elif MODE == 1:
            norm = tl.sqrt(tl.sum(acc, axis=0))
        else:
            norm = tl.exp2(tl.log2(tl.sum(acc, axis=0)) / p)
        tl.store(norms_ptr + tensor, norm.to(norms_ptr.dtype.element_ty))

    TRITON_DTYPES = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
    }


def launch(kernel: object, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)``: Triton compiles it at its first launch with these
    specializations, loads the module and launches. Any failure of that is a ``KernelUnavailableError``
    naming the kernel and the cause (chained), on which ``kernels`` falls back to torch's ops."""
    try:
        kernel[grid](*args, **kwargs)  # type: ignore[index]
    except Exception as error:
        name = getattr(kernel, "__name__", type(kernel).__name__)
        lines = str(error).strip().splitlines()
        detail = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        raise KernelUnavailableError(f"Triton could not compile or launch {name} ({detail})") from error


class _Tables:
    """Device tables for one list of tensors on ``device``, from their addresses and sizes (the cache's key):
    addresses + sizes (int64) and chunk offsets (int32)."""

    def __init__(self, device: torch.device, addresses: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + max(1, math.ceil(n / CHUNK)))
        # on the host whatever torch.set_default_device says: pinned, then copied to the tensors' device
        table = torch.tensor(addresses + sizes, dtype=torch.int64, device="cpu")
        offs = torch.tensor(offsets, dtype=torch.int32, device="cpu")
        if device.type == "cuda":
            table, offs = table.pin_memory(), offs.pin_memory()
        self._host = (table, offs)  # pinned sources stay alive while the async copies run
        self.table = table.to(device, non_blocking=True)
        self.offsets = offs.to(device, non_blocking=True)
        self.num_chunks = offsets[-1]
        self.aligned = all(address % 16 == 0 for address in addresses)


_DATA_PTR, _NUMEL, _IS_CONTIGUOUS = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_CACHE: OrderedDict[tuple[object, ...], _Tables] = OrderedDict()
_CACHE_SIZE = 16
_CAPTURED: dict[tuple[object, ...], _Tables] = {}
"""Tables used inside a CUDA graph capture: the graph reads them at every replay, so never evicted."""


def _tables(grads: list[torch.Tensor]) -> _Tables | None:
    """The device tables for ``grads``; None when they are new and a CUDA graph is being captured
    (building them needs a host-to-device copy, which a capture must not contain)."""
    key = (grads[0].device, tuple(map(_DATA_PTR, grads)), tuple(map(_NUMEL, grads)))  # C-level passes, no bytecode
    capturing = grads[0].is_cuda and torch.cuda.is_current_stream_capturing()
    found = _CAPTURED.get(key) or _CACHE.get(key)
    if found is None:
        if capturing:
            return None
        found = _Tables(*key)
        _CACHE[key] = found
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    elif key in _CACHE:
        _CACHE.move_to_end(key)
    if capturing:
        _CAPTURED[key] = found
    return found


def tables_for(tensors: list[torch.Tensor]) -> _Tables:
    """The cached device tables for ``tensors`` outside a graph capture (``triton_move`` shares them)."""
    found = _tables(tensors)
    if found is None:
        raise RuntimeError("gradscaler's Triton move kernel cannot build its tables inside a CUDA graph capture.")
    return found


def mode_of(norm_type: float | None) -> int:
    """The kernels' MODE for a norm type: none (flag alone), p = 2, inf, or another p."""
    if norm_type is None:
        return MODE_CHECK
    if math.isinf(norm_type):
        return MODE_MAX
    return MODE_SQUARES if norm_type == 2.0 else MODE_POWER


def grad_stats(grads: list[torch.Tensor], norm_type: float | None, inv_scale: torch.Tensor | None = None) -> GradStats:
    """See ``gradscaler.kernels.grad_stats``. Tensors must be contiguous; others are read via a copy."""
    if not all(map(_IS_CONTIGUOUS, grads)):
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    step = MAX_TENSORS
    parts = [grads[i : i + step] for i in range(0, len(grads), step)] if len(grads) > step else [grads]
    tables = [_tables(part) for part in parts]
    if any(t is None for t in tables):  # new gradients inside a graph capture: torch's ops instead
        from gradscaler.kernels import torch_stats

        return torch_stats.grad_stats(grads, norm_type, inv_scale)
    device = grads[0].device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    mode = mode_of(norm_type)
    inv = None if inv_scale is None or mode == MODE_CHECK else moved(inv_scale, device, torch.float32)
    norms = [
        _launch(part, table, mode, float(norm_type or 0.0), flag, inv)  # type: ignore[arg-type]
        for part, table in zip(parts, tables, strict=True)
    ]
    if mode == MODE_CHECK:
        return GradStats(flag, None)
    return GradStats(flag, norms[0] if len(norms) == 1 else torch.cat(norms))  # one part: no copy


def _launch(
    grads: list[torch.Tensor], tables: _Tables, mode: int, p: float, flag: torch.Tensor, inv: torch.Tensor | None
) -> torch.Tensor:
    device, dtype = grads[0].device, grads[0].dtype
    wide = dtype == torch.float64
    acc = accumulator(dtype, mode)
    partial = torch.empty(tables.num_chunks if mode != MODE_CHECK else 1, dtype=torch.float64, device=device)
    launch(
        _chunk_kernel,
        (tables.num_chunks,),
        tables.table,
        tables.offsets,
        len(grads),
        partial,
        flag,
        flag if inv is None else inv,
        p,
        DTYPE=TRITON_DTYPES[dtype],
        ACC=acc,
        MODE=mode,
        HAS_INV=inv is not None,
        ALIGNED=tables.aligned,
        CHUNK_SIZE=CHUNK,
        BLOCK_SIZE=BLOCK,
        TABLE_BLOCK=TABLE_BLOCK,
        num_warps=NUM_WARPS,
        **COMPILE_OPTIONS,
    )
    if mode == MODE_CHECK:
        return torch.empty(0, dtype=torch.float32, device=device)
    return tensor_norms(partial, tables, len(grads), p, mode, torch.float64 if wide else torch.float32)


def accumulator(dtype: torch.dtype, mode: int) -> tl.dtype:
    """The accumulation type of a pass over ``dtype`` values in ``mode``. Sums of squares and powers
    accumulate in float64: no overflow for any float32 value, so the norm is right whatever
    ``inv_scale`` is. Maxima need no widening."""
    return tl.float64 if dtype == torch.float64 or mode in (MODE_SQUARES, MODE_POWER) else tl.float32


def tensor_norms(
    partial: torch.Tensor, tables: _Tables, count: int, p: float, mode: int, dtype: torch.dtype
) -> torch.Tensor:
    """Launch 2: each tensor's norm from its chunks' ``partial`` terms, in a fixed order (``dtype``)."""
    norms = torch.empty(count, dtype=dtype, device=partial.device)
    launch(_tensor_kernel, (count,), partial, tables.offsets, norms, p, MODE=mode, RBLOCK=RBLOCK, **COMPILE_OPTIONS)
    return norms
