"""``grad_stats`` with torch ops, for the CPU and any device without Triton.

CPU: one read-only op per tensor, the fastest that gives an exact answer when its result is finite.
Measured on the 2-core machine (8M values, median of 11; a ``copy_`` of the same float32 values moves
twice the bytes in 1.47 ms): ``dot(g, g)`` 0.61 ms, ``sum`` 0.61, ``amax`` 0.66, ``aminmax`` 1.10,
``vector_norm`` (p=2) 1.26, p=1 2.9, p=inf 13, p=3 27; ``isfinite(g).all()`` 12.6. Per tensor, a
``reshape`` + ``dot`` costs ~2 us of host time (``_foreach_norm`` is no better: a C++ loop of the same
ops), so tensors under ``SMALL`` values are copied by one ``cat`` into one buffer (see ``_squares``).

* float32 / float64, flag and L2: ``dot(g, g)``. A sum of squares is finite only if every value is
  (inf and NaN propagate through products and sums), so a finite result proves the tensor clean.
* float16 / bfloat16 flag: sums over chunks of 1024 values (float32 accumulation; 0.43 ms for 8M
  float16 values, against 0.75 for ``aminmax`` and 0.58 for torch's check-and-unscale, which writes).
  A finite sum proves its chunk clean, as with ``dot``; float16 sums may overflow (see below).
* every inf-norm: ``aminmax`` (NaN and +/-inf reach the min or the max: exact in itself; the inf-norm
  is ``max(|min|, |max|)``).
* everything else: ``vector_norm`` with float32 (float64) accumulation, same argument as ``dot``.

A non-finite result is ambiguous: a real inf/NaN, or finite values whose squares (powers, float16
sums) overflow (float32 values above ~1.8e19, float64 above ~1e154, bfloat16 likewise). One host read
of all the results decides (free on the CPU: the values are already there); only the tensors whose
result is not finite are read again by ``_exact`` (for a flag alone, every tensor of the group):
``aminmax`` for the flag, then a norm scaled by the tensor's largest value, in float64. So the flag is
exact and the norm does not overflow before the multiply by ``inv_scale``, at the cost of a second read
of an offending tensor on an overflowing step.

The other way round, powers of stored values below ~2**-63 underflow in float32 (a scale near the
2**-126 floor, or gradients near float32's smallest normal): a norm would come back 0 or too small.
The sum of squares already read decides for ``dot`` at no cost (``_underflowed``); only when it is
under ``_SUSPECT`` are the tensors whose own sum is under ``numel * tiny`` read again the same way.

Other devices (no host sync allowed, CUDA-graph capturable): two multi-tensor reads, the inf-norm
(exact for inf) and the requested p-norm (1 for a check) accumulated in float64 where the device has
it (NaN propagates through the sum): flag = ``not isfinite(inf-norm) or isnan(p-norm)``.
"""

from __future__ import annotations

import math
from itertools import groupby
from typing import NamedTuple

import torch

from gradscaler.kernels import GradStats, NoGrad, host_reads_free, moved

_DOT_DTYPES = (torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_SUM_CHUNK = 1 << 10
"""Values per partial sum in a half-precision flag pass: 1024 float16 values of one sign overflow the sum
only if their mean magnitude is above 64 (of random signs, only if their RMS is above ~2000)."""
SMALL = 1 << 13
"""Tensors under this many values share one flattened buffer in the CPU route (see ``_squares``)."""
_CHUNK = 1 << 20
"""Values per float64 copy in ``_exact`` (bounds its memory to 8 MiB)."""


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms of ``dtype`` gradients: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exact(grad: torch.Tensor, norm_type: float | None) -> tuple[bool, float]:
    """(non-finite?, float64 norm of ``grad`` as stored) from a second, careful read of one tensor.

    The norm of a tensor with an inf is inf, with a NaN NaN (as ``vector_norm`` in float64 gives).
    """
    values = grad.reshape(-1)
    if not values.numel():
        return False, 0.0
    lo, hi = (float(v) for v in torch.aminmax(values))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return True, abs(lo) + abs(hi)  # inf, or NaN when a NaN is present
    if norm_type is None:
        return False, 0.0
    top = max(abs(lo), abs(hi))
    if top == 0.0 or math.isinf(norm_type):
        return False, top
    total = 0.0
    for chunk in values.split(_CHUNK):
        total += float(torch.linalg.vector_norm(chunk.double() / top, norm_type)) ** norm_type
    return False, top * total ** (1.0 / norm_type)


def _cpu_raw(grads: list[torch.Tensor], norm_type: float | None) -> tuple[torch.Tensor, bool]:
    """Per tensor one result (a norm, a sum of squares or a max |g|) and whether it is already a norm.

    Every result is finite only if its tensor is. A flag-only call may return other results (one for
    all small tensors together, partial sums of half-precision chunks): only their finiteness matters then.
    """
    dtype = grads[0].dtype
    acc = norm_dtype(dtype)
    if dtype in _DOT_DTYPES and norm_type is None:
        return _summed_squares(grads), False
    if dtype in _DOT_DTYPES and norm_type == 2.0:
        return _squares(grads), False
    if norm_type is None and dtype in _HALF_DTYPES:
        return _chunk_sums(grads), False
    if norm_type is None or math.isinf(norm_type):
        zero = torch.zeros((), dtype=dtype, device=grads[0].device)
        peaks = [torch.stack(torch.aminmax(g.reshape(-1))).abs().amax() if g.numel() else zero for g in grads]
        return torch.stack(peaks).to(acc), True
    return torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in grads]), True


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a 1-d tensor (a 1-d tensor as it is: a ``reshape`` costs a view op)."""
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The values of ``tensors`` in one new 1-d buffer (one ``cat``; inline, not ``_values``: 0.1 ms less
    Python at 2000 tensors)."""
    return torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors])


def _pieces(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The values of ``grads`` as 1-d tensors: each big tensor as it is, the small ones (under ``SMALL``
    values) copied together into one buffer (one ``cat``: far cheaper than ~2 us of dispatch each)."""
    pieces, small = [], []
    for grad in grads:
        if grad.numel() < SMALL:
            small.append(grad)
        else:
            pieces.append(_values(grad))
    if small:
        pieces.append(_values(small[0]) if len(small) == 1 else _flat(small))
    return pieces


def _chunk_sums(grads: list[torch.Tensor]) -> torch.Tensor:
    """Half-precision flag: sums over chunks of at most ``_SUM_CHUNK`` values (float32 accumulation, the
    fastest read of float16 / bfloat16 there is, ~0.05 ms per 1M values). A sum is finite only if its
    chunk is, unless it overflows (float16: past 65504); small chunks make that rare, and ``_cpu``
    settles it by reading the tensors again."""
    parts = []
    for values in _pieces(grads):
        chunk = min(_SUM_CHUNK, values.numel() & -values.numel())  # largest power of two dividing the size
        parts.append(values.view(-1, chunk).sum(1) if chunk >= 64 else values.sum().view(1))
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).float()  # float16 sums of sums would overflow


def _summed_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Flag alone: one ``dot(v, v)`` per piece (see ``_pieces``)."""
    parts = [torch.dot(values, values) for values in _pieces(grads)]
    return parts[0] if len(parts) == 1 else torch.stack(parts)


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sums of squares, one per tensor: ``dot(g, g)`` per big tensor; the small ones (under ``SMALL``
    values), sorted by size, are copied into one buffer by one ``cat`` (cache-resident bytes, far
    cheaper than ~2 us of Python and dispatch per tensor) and each run of equal sizes is reduced as the
    rows of one matrix. The 65 small tensors of the bench's GPT-2-like layout (3 sizes) take 0.09 ms
    that way, against 0.19 ms for one ``segment_reduce`` over the same buffer, which remains the route
    for more than ``_MAX_RUNS`` distinct sizes.
    """
    layout = _layout(tuple(map(torch.Tensor.numel, grads)))
    if layout is None:  # fewer than 8 small tensors: not worth a copy
        return torch.stack([torch.dot(v, v) for v in map(_values, grads)])
    parts = [torch.stack([torch.dot(v, v) for v in (_values(grads[i]) for i in layout.big)])] if layout.big else []
    flat = _flat([grads[i] for i in layout.small])
    if layout.lengths is not None:
        parts.append(torch.segment_reduce(flat * flat, "sum", lengths=layout.lengths))
    else:
        start = 0
        for size, count in layout.runs:
            rows = flat[start : start + size * count].view(count, size)
            parts.append((rows * rows).sum(1))
            start += size * count
    joined = torch.cat(parts) if len(parts) > 1 else parts[0]
    return joined if layout.order is None else joined[layout.order]


_MAX_RUNS = 16
"""Most distinct small-tensor sizes reduced as matrices, one per size; beyond, one ``segment_reduce``."""


class _Layout(NamedTuple):
    """How ``_squares`` reads tensors of given sizes."""

    big: list[int]
    """Indices of the tensors read one by one."""
    small: list[int]
    """Indices of the tensors copied into one buffer, sorted by size."""
    runs: list[tuple[int, int]]
    """(size, count) of each run of equal sizes in ``small``."""
    lengths: torch.Tensor | None
    """The sizes of ``small`` as ``segment_reduce`` lengths when there are more than ``_MAX_RUNS`` runs."""
    order: torch.Tensor | None
    """Where each caller's tensor is in ``big + small`` (None: the same order)."""


_LAYOUTS: dict[tuple[int, ...], _Layout | None] = {}
_MISSING = object()


def _layout(sizes: tuple[int, ...]) -> _Layout | None:
    """The ``_Layout`` for tensors of ``sizes`` (None: fewer than 8 small ones); cached by the sizes,
    which are stable from step to step."""
    cached = _LAYOUTS.get(sizes, _MISSING)  # one look-up: another thread may clear the cache
    if cached is not _MISSING:
        return cached  # type: ignore[return-value]
    big = [i for i, n in enumerate(sizes) if n >= SMALL]
    small = sorted((i for i, n in enumerate(sizes) if n < SMALL), key=sizes.__getitem__)
    found = None
    if len(small) >= 8:
        runs = [(n, len(list(run))) for n, run in groupby(sizes[i] for i in small)]  # small is sorted by size
        lengths = None
        if len(runs) > _MAX_RUNS:
            lengths = torch.tensor([sizes[i] for i in small], dtype=torch.int64, device="cpu")
        order = None
        if big + small != list(range(len(sizes))):
            order = torch.empty(len(sizes), dtype=torch.int64, device="cpu")
            order[torch.tensor(big + small, device="cpu")] = torch.arange(len(sizes), device="cpu")
        found = _Layout(big, small, runs, lengths, order)
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    _LAYOUTS[sizes] = found
    return found


_SUSPECT = {torch.float32: 2.0**-80, torch.float64: 2.0**-976}
"""A sum of powers at or above this holds no underflow that matters: each power below the smallest
normal (``tiny``) is off by at most ``tiny * eps / 2``, so ``n`` of them shift a sum of at least
``n * tiny`` by under one rounding; this is ``n * tiny`` for up to 2**46 values."""


def _underflowed(raw: torch.Tensor, is_norm: bool, p: float, grads: list[torch.Tensor], total: float) -> list[int]:
    """Indices of the tensors whose result may have lost bits to powers that underflowed.

    The p-th powers (squares for ``dot``) of stored values below ~2**-63 (scaled gradients at a small
    scale, or gradients near float32's smallest normal) underflow in the float32 accumulation, so a
    norm would come back 0 or too small where torch's unscale-first recipe is right. ``total`` is
    the sum of ``raw``, already on the host: for sums of squares it settles the common case with no
    op at all. A tensor is re-read only if its own sum of powers is under ``numel * tiny``.
    """
    suspect = _SUSPECT[raw.dtype]
    if not is_norm and total >= suspect:
        return []
    powers = [v**p if is_norm else v for v in raw.tolist()]  # inf and NaN entries compare False below
    if is_norm and math.fsum(x for x in powers if math.isfinite(x)) >= suspect:
        return []
    tiny = torch.finfo(raw.dtype).tiny
    return [i for i, (x, g) in enumerate(zip(powers, grads, strict=True)) if x < g.numel() * tiny]


def _cpu(grads: list[torch.Tensor], norm_type: float | None, inv_scale: torch.Tensor | None) -> GradStats:
    raw, is_norm = _cpu_raw(grads, norm_type)
    nonfinite = torch.scalar_tensor(0.0, dtype=torch.float32, device=grads[0].device)
    # Their sum is finite iff every one is (inf and NaN propagate; finite results that overflow the
    # sum are cleared by the per-entry check below): one op and one host read on the common path.
    total = raw.item() if raw.dim() == 0 else raw.sum().item()
    again: list[int] = []
    if not math.isfinite(total):
        bad = torch.isfinite(raw).logical_not_()
        if bool(bad.any()):  # rare: a real inf/NaN, or finite values that overflowed
            if norm_type is None:  # the results may not be per tensor: check every tensor again
                found = any(_exact(g, None)[0] for g in grads)
                return GradStats(nonfinite.fill_(1.0) if found else nonfinite, None)
            again = bad.nonzero().flatten().tolist()
    if norm_type is not None and not math.isinf(norm_type):
        again += _underflowed(raw, is_norm, norm_type, grads, total)
    if again:
        raw = raw.double() if is_norm else raw.double().sqrt()
        is_norm = True
        for i in again:
            found, norm = _exact(grads[i], norm_type)
            raw[i] = norm
            if found:
                nonfinite.fill_(1.0)
    if norm_type is None:
        return GradStats(nonfinite, None)
    norms = raw if is_norm else raw.sqrt()
    if inv_scale is not None:  # in float64 after a fallback: no overflow or underflow before the multiply
        norms = norms * moved(inv_scale, norms.device, norms.dtype)
    return GradStats(nonfinite, moved(norms, norms.device, norm_dtype(grads[0].dtype)))


def _nonfinite(values: torch.Tensor) -> torch.Tensor:
    """0-d float32, 1.0 when any of ``values`` is inf or NaN, else 0.0, in three kernels on any device: each value
    times 0 is 0 where it is finite and NaN where not, written as float32 (the kernel casts on the way; a reduction
    given ``dtype=`` would launch a cast of its own), so their sum is 0 or NaN (zeros never overflow), and NaN
    becomes 1. (The values are norms: none is negative, so no -0.0 reaches the flag.)"""
    zeros = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    return torch.nan_to_num(torch.mul(values, 0, out=zeros).sum(), nan=1.0)


def _per_tensor(
    values: tuple[torch.Tensor, ...] | list[torch.Tensor], grads: list[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """One value per tensor of ``grads`` (``values`` for the non-empty ones, in order; 0 for an empty one), as
    ``dtype`` in one op: not a conversion per tensor."""
    if len(values) != len(grads):
        zero, it = values[0].new_zeros(()), iter(values)
        values = [next(it) if g.numel() else zero for g in grads]
    return torch.stack(list(values)).to(dtype)


def peaks(grads: list[torch.Tensor]) -> torch.Tensor:
    """``_generic``'s inf-norms (each tensor's largest magnitude, inf or NaN where it holds one), the same values,
    without its flag: a multi-tensor inf-norm and its stack, where the flag adds three ops more. Widened straight to
    the output dtype, not through float64: a float16 NaN may keep other payload bits (still a NaN). Outside autograd,
    as ``grad_stats``."""
    present = [g for g in grads if g.numel()]
    out = norm_dtype(grads[0].dtype)
    if not present:
        return torch.zeros(len(grads), dtype=out, device=grads[0].device)
    with NoGrad():
        return _per_tensor(torch._foreach_norm(present, math.inf), grads, out)


def _generic(grads: list[torch.Tensor], norm_type: float | None, inv_scale: torch.Tensor | None) -> GradStats:
    """Any device, no host sync and no host-built index tensors (runs inside CUDA-graph captures)."""
    device = grads[0].device
    out = norm_dtype(grads[0].dtype)
    acc = out if device.type == "mps" else torch.float64  # MPS has no float64
    present = [g for g in grads if g.numel()]  # the inf-norm of nothing is an error

    def per_tensor(values: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        return _per_tensor(values, grads, acc)

    if not present:
        zeros = torch.zeros(len(grads), dtype=out, device=device)
        return GradStats(torch.zeros((), dtype=torch.float32, device=device), None if norm_type is None else zeros)
    # In float64, a 1- or 2-norm of float32/16 values (or their largest magnitude) is finite exactly when
    # the values are: the flag comes from the norms the pass computes anyway, in three small ops. float64
    # gradients (and MPS, without float64) take the inf-norm, which propagates NaN (as vector_norm does),
    # so it is exact for the flag on its own.
    wide = acc == torch.float64 and grads[0].dtype != torch.float64
    if norm_type is None:  # a check alone: a float64 1-norm where it is exact, else the inf-norm
        check = per_tensor(
            torch._foreach_norm(present, 1.0, dtype=acc) if wide else torch._foreach_norm(present, math.inf)
        )
        return GradStats(_nonfinite(check), None)
    if math.isinf(norm_type):
        norms = per_tensor(torch._foreach_norm(present, math.inf))
        nonfinite = _nonfinite(norms)
    else:
        norms = per_tensor(torch._foreach_norm(present, norm_type, dtype=acc))
        exact = wide and 1 <= norm_type <= 2  # else a p-norm may overflow where no value does
        peaks = norms if exact else per_tensor(torch._foreach_norm(present, math.inf))
        nonfinite = _nonfinite(peaks)
    if inv_scale is None:
        return GradStats(nonfinite, norms.to(out))
    # one op: the 0-d float32 factor takes the norms' dtype (promotion), the product rounds to it, and the
    # result is written rounded to ``out`` (the multiply in float64, then float32, as two ops would give it)
    scaled = torch.empty(norms.shape, dtype=out, device=device)
    return GradStats(nonfinite, torch.mul(norms, inv_scale.to(device=device), out=scaled))


def grad_stats(
    grads: list[torch.Tensor],
    norm_type: float | None,
    inv_scale: torch.Tensor | None = None,
    *,
    host: bool | None = None,
) -> GradStats:
    """See ``gradscaler.kernels.grad_stats``. ``host``: take the CPU route (None: ``host_reads_free``). Outside
    autograd (also for the Triton route's fallback): gradients with a graph (``create_graph=True``) give results
    without one."""
    with NoGrad():
        if host if host is not None else host_reads_free(grads[0].device):
            return _cpu(grads, norm_type, inv_scale)
        return _generic(grads, norm_type, inv_scale)
