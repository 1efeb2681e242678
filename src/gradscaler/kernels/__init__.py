"""One read pass over a list of same-device, same-dtype gradients: the non-finite flag and norms.

``grad_stats`` is the only entry point. On CUDA with Triton installed it runs the multi-tensor Triton
kernel (two launches for any number of tensors); elsewhere the torch implementation, which picks the
fastest read-only torch op per norm type. ``GRADSCALER_KERNEL=torch`` forces the torch path,
``GRADSCALER_KERNEL=triton`` forces Triton (on the CPU too, under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch


class GradStats(NamedTuple):
    """Result of one read pass.

    ``nonfinite``: 0-d float32, 1.0 when any value is inf or NaN, else 0.0 (exact).
    ``norms``: 1-d float32, the ``norm_type``-norm of each tensor as stored, or None for a check only.
    """

    nonfinite: torch.Tensor
    norms: torch.Tensor | None


def _use_triton(device: torch.device) -> bool:
    choice = os.environ.get("GRADSCALER_KERNEL", "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    if device.type != "cuda":
        return False
    from gradscaler.kernels import triton_stats

    return triton_stats.AVAILABLE


def grad_stats(grads: list[torch.Tensor], norm_type: float | None) -> GradStats:
    """Flag and (when ``norm_type`` is given) per-tensor norms of ``grads`` in one read; no host sync.

    ``grads`` share one device and one real dtype. ``norm_type`` is a p >= 1, ``inf``, or None.
    """
    if not grads:
        raise ValueError("grad_stats needs at least one tensor.")
    if _use_triton(grads[0].device):
        from gradscaler.kernels import triton_stats

        return triton_stats.grad_stats(grads, norm_type)
    from gradscaler.kernels import torch_stats

    return torch_stats.grad_stats(grads, norm_type)
