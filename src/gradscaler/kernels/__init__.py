"""Passes over lists of same-device, same-dtype gradients.

``grad_stats``: one read pass giving the non-finite flag and norms. ``move_grads_``: one pass that
widens float16/bfloat16 gradients into float32 ones times a factor (master weights), with the flag and
norms of the same read.
For ``grad_stats``: on CUDA with Triton installed it runs the multi-tensor Triton
kernel (two launches for any number of tensors); elsewhere the torch implementation, which picks the
fastest read-only torch op per norm type. ``GRADSCALER_KERNEL=torch`` forces the torch path,
``GRADSCALER_KERNEL=triton`` forces Triton (on the CPU too, under ``TRITON_INTERPRET=1``), and
``GRADSCALER_KERNEL=generic`` the device-generic torch path on the CPU too: the path CUDA takes
without Triton, which reads nothing back to the host (the CPU path reads its results once, free
there). ``host_reads_free`` answers the same question for the scaler's telemetry, so under
``generic`` a CPU scaler keeps its counters with device ops too; ``tests/test_sync.py`` uses it to
prove that the scaler's own code makes no host read.

Never stranded: under ``auto``, a device whose compute capability is below ``MIN_CAPABILITY``, or on
which a Triton kernel fails to compile, load or launch (no ptxas, an architecture Triton cannot
target, a driver that refuses the module), takes the torch path for the rest of the process, after
one ``KernelFallbackWarning`` naming the device and the cause. ``GRADSCALER_KERNEL=torch`` takes
that path from the start without the warning; ``GRADSCALER_KERNEL=triton`` raises the failure.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple

import torch

from gradscaler.errors import warn

TRITON_DEVICE_TYPES = ("cuda",)
"""Device types on which ``GRADSCALER_KERNEL=auto`` (the default) runs the Triton kernels."""
MIN_CAPABILITY = (7, 0)
"""The oldest CUDA compute capability the Triton kernels are compiled for (``tests/test_kernel_compile.py``
compiles them for 7.0, 7.5, 8.0, 8.6, 8.9, 9.0 and 10.0); older devices take the torch path."""


class KernelFallbackWarning(RuntimeWarning):
    """A device takes the torch path because gradscaler's Triton kernels cannot run on it."""


class KernelUnavailableError(RuntimeError):
    """A Triton kernel could not be compiled, loaded or launched (the cause is chained)."""


_FALLBACK: dict[torch.device, str] = {}
"""Devices that take the torch path for the rest of the process, with the cause."""
_SUPPORTED: set[torch.device] = set()
"""Devices whose compute capability has been checked and found supported."""
_LOCK = threading.Lock()


class NoGrad:
    """``torch.no_grad()`` for the scaler's own passes over gradients (``torch_stats``), whose flags and norms are
    never differentiated (a gradient from ``backward(create_graph=True)`` has a graph: none reaches the scale), and
    for the masters' two calls of every step (``move``, ``finish``): the same calls torch's makes on entry and
    exit, without its decorator machinery (0.4 us a use against 2.1 on the 2-core machine)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self._before)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device; None for other devices."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def fall_back(device: torch.device, cause: str) -> None:
    """Send ``device`` to the torch path for the rest of the process; warn the first time only."""
    with _LOCK:
        if device in _FALLBACK:
            return
        _FALLBACK[device] = cause
    warn(
        f"gradscaler's Triton kernels cannot run on {device}: {cause}. The scaler uses torch's ops on "
        "this device for the rest of the process: the same flags and unscaled values, norms equal to "
        "rounding, slower passes. Set GRADSCALER_KERNEL=torch to choose torch's ops without this "
        "warning, or GRADSCALER_KERNEL=triton to raise the error instead.",
        KernelFallbackWarning,
    )


def _triton_route(device: torch.device, choice: str) -> str | None:
    """``"forced"`` (``GRADSCALER_KERNEL=triton``: failures raise), ``"auto"`` (failures fall back), or
    None for the torch path."""
    if choice == "triton":
        return "forced"
    if choice != "auto" or device.type not in TRITON_DEVICE_TYPES or device in _FALLBACK:
        return None
    from gradscaler.kernels import triton_stats

    if not triton_stats.AVAILABLE:
        return None
    if device not in _SUPPORTED:
        capability = _capability(device)
        if capability is not None and tuple(capability) < MIN_CAPABILITY:
            fall_back(
                device,
                f"its compute capability {capability[0]}.{capability[1]} is below "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the oldest the kernels are compiled for",
            )
            return None
        _SUPPORTED.add(device)
    return "auto"


class GradStats(NamedTuple):
    """Result of one read pass.

    ``nonfinite``: 0-d float32, 1.0 when any stored value is inf or NaN, else 0.0. Exact for every
    dtype: a finite value is never called an overflow (float64 1e300, float32 3e38 with p=2).
    ``norms``: 1-d, the ``norm_type``-norm of each tensor times ``inv_scale`` (``||g * inv_scale||``),
    or None for a check only; float32, float64 for float64 gradients. No power of a stored value
    overflows or underflows before the multiply: scaled gradients near float32's max with
    ``inv_scale`` down to 2**-100, stored values at a scale of 2**-126 (subnormal) and gradients near
    float32's smallest normal all give the unscaled norm. Triton and the generic path multiply
    before any power and sum in float64; the CPU route squares stored values in float32 and re-reads,
    in float64, a tensor whose result overflowed or whose sum of powers is small enough for underflow
    to matter (``torch_stats``). Norms of a tensor holding an inf are inf, holding a NaN NaN. An
    empty tensor's norm is 0.
    """

    nonfinite: torch.Tensor
    norms: torch.Tensor | None


def host_reads_free(device: torch.device, choice: str | None = None) -> bool:
    """Whether reading a tensor on ``device`` costs the host no more than reading memory: the CPU, unless
    ``GRADSCALER_KERNEL=generic`` asks for the device-generic paths (which never read back) there too.
    ``choice``: that variable's value when the caller has read it already."""
    return device.type == "cpu" and (choice or os.environ.get("GRADSCALER_KERNEL", "auto")) != "generic"


def moved(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` on ``device`` as ``dtype``: itself when it already is (a no-op ``.to`` costs ~0.5 us
    of host time), else a non-blocking copy."""
    if tensor.device == device and tensor.dtype == dtype:
        return tensor
    return tensor.to(device, dtype, non_blocking=True)


def grad_peaks(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest magnitude as stored: ``grad_stats(grads, inf).norms``, the same values, without
    the flag. Off the CPU without Triton the flag costs ops of its own (``torch_stats.peaks`` leaves them
    out); elsewhere it comes with the same pass, and this is ``grad_stats``."""
    if not grads:
        raise ValueError("grad_peaks needs at least one tensor.")
    choice = os.environ.get("GRADSCALER_KERNEL", "auto")
    device = grads[0].device
    if _triton_route(device, choice) is None and not host_reads_free(device, choice):
        from gradscaler.kernels import torch_stats

        return torch_stats.peaks(grads)
    norms = grad_stats(grads, math.inf).norms
    assert norms is not None
    return norms


def grad_stats(grads: list[torch.Tensor], norm_type: float | None, inv_scale: torch.Tensor | None = None) -> GradStats:
    """Flag and (when ``norm_type`` is given) per-tensor norms of ``grads * inv_scale`` in one read.

    ``grads`` share one device and one real dtype (float16, bfloat16, float32 or float64); nothing is
    written. ``norm_type`` is a p > 0, ``inf``, or None (the flag alone). ``inv_scale`` is a 0-d
    float tensor (any device; on the gradients' device it costs no copy; the Triton kernels read it
    as float32, as the scaler's ``1/S`` is), or None for 1. No host sync
    on CUDA; on the CPU one host read of the per-tensor results decides whether a tensor whose result
    overflowed must be read again (see ``torch_stats``).
    """
    if not grads:
        raise ValueError("grad_stats needs at least one tensor.")
    choice = os.environ.get("GRADSCALER_KERNEL", "auto")
    device = grads[0].device
    route = _triton_route(device, choice)
    if route is not None:
        from gradscaler.kernels import triton_stats

        try:
            return triton_stats.grad_stats(grads, norm_type, inv_scale)
        except KernelUnavailableError as error:
            if route == "forced":
                raise
            fall_back(device, str(error))
    from gradscaler.kernels import torch_stats

    return torch_stats.grad_stats(grads, norm_type, inv_scale, host=host_reads_free(device, choice))


def move_grads_(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    factor: torch.Tensor | None,
    norm_type: float | None = None,
    norm_inv: torch.Tensor | None = None,
) -> GradStats:
    """``dst[i] = src[i].float() * factor`` (torch's unscale rounding; None: no multiply), and from the
    same read the non-finite flag of ``src`` and, when ``norm_type`` is given, the per-tensor norms of
    ``src[i] * norm_inv`` (as ``grad_stats`` gives them: exact flag, no overflow before the multiply).

    ``src``: same-device, same-dtype (float16 or bfloat16) dense contiguous tensors; ``dst``: float32
    tensors of the same shapes, contiguous, on that device. On CUDA with Triton (or
    ``GRADSCALER_KERNEL=triton``) one pass: 2 bytes read and 4 written per value, the flag and the
    norm terms folded in on the way. Elsewhere torch's ops: the copy, ``grad_stats`` over the float32
    copies when norms are asked, then check-and-unscale (by 1 without ``factor``, for the flag). Either way
    the norms equal, bit for bit, those ``grad_stats`` gives for ``[s.float() for s in src]`` (the
    Triton passes sum the same float64 terms over the same chunks for every input dtype).
    """
    choice = os.environ.get("GRADSCALER_KERNEL", "auto")
    device = src[0].device
    route = _triton_route(device, choice)
    if route is not None:
        from gradscaler.kernels import triton_move

        try:
            return triton_move.move_grads_(src, dst, factor, norm_type, norm_inv)
        except KernelUnavailableError as error:
            if route == "forced":
                raise
            fall_back(device, str(error))  # nothing is left half-done: the copy below rewrites every value
    torch._foreach_copy_(dst, src)
    stats = grad_stats(dst, norm_type, norm_inv) if norm_type is not None else None
    if stats is not None and factor is None:
        return stats
    flag = torch.zeros((), dtype=torch.float32, device=src[0].device)
    # No factor (a fused optimizer unscales in its step): a multiply by 1 writes every copied value as it
    # is and gives the flag in one op, as torch's scaler checks a fused optimizer's gradients; a read pass
    # for the flag alone is six launches more (the copies are this call's own: nothing else sees the write).
    by = torch.ones_like(flag) if factor is None else moved(factor, flag.device, torch.float32)
    torch._amp_foreach_non_finite_check_and_unscale_(dst, flag, by)
    return GradStats(flag, None) if stats is None else stats
