"""Gradients of an optimizer, grouped by device and dtype, and the passes the scaler makes over them.

Three passes exist, each a single sweep over the gradient bytes:

* ``unscale_and_check_``: read + write, ``g *= 1/S`` and the non-finite flag (torch's
  ``_amp_foreach_non_finite_check_and_unscale_``; the minimum for optimizers that read ``.grad``).
* ``nonfinite_flags``: read only, the non-finite flag (for fused optimizers, which unscale inside their kernel).
* ``norms_and_check``: read only, the flag and per-tensor norms (for scale-aware clipping); ``peaks``, the
  largest magnitudes alone (for attribution, once the flag is known).

Sparse gradients contribute their values (fp16 ones are coalesced first, so duplicate indices that sum
past 65504 are caught); complex gradients contribute their real and imaginary parts; DTensor gradients
contribute their local shard.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any, Generic, TypeVar

import torch

from gradscaler import distributed
from gradscaler.distributed import Agreement
from gradscaler.kernels import grad_peaks, grad_stats, host_reads_free, moved

GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]
Owners = dict[torch.device, list[torch.Tensor]]
"""Per device, the parameters whose per-tensor results (norms, peaks) a pass returned, in their order."""


def new_groups() -> GradGroups:
    """An empty device -> dtype -> list mapping."""
    return defaultdict(lambda: defaultdict(list))


FP16_GRADS_MESSAGE = (
    "Attempting to unscale FP16 gradients. The parameters themselves are float16, so their gradients "
    "are too, and unscaling them in float16 loses the small values loss scaling exists to keep. Keep "
    "the parameters in float32 and let torch.autocast run the forward pass in float16, or keep them in "
    "float16 and train them through float32 master weights: GradScaler(..., master_weights=True), or, "
    "for code you do not edit (a Trainer, a script that builds torch's scaler), the one line "
    "gradscaler.patch_torch(master_weights=True) before it builds its scaler."
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; any other tensor unchanged."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of ``optimizer``, in param-group order."""
    for group in optimizer.param_groups:
        yield from group["params"]


class ParamList:
    """One optimizer's parameters in param-group order, rebuilt only when its param groups change.

    Valid while the optimizer has as many param groups as when it was built and each group's
    ``params`` holds the same tensors, compared by identity (one C-level pass): a group added, a
    parameter added, removed or replaced, or another optimizer at the same ``id`` rebuilds it.
    Gradients are never cached: ``group_grads`` reads every ``.grad`` afresh. ``agreement`` holds
    what ``agreed`` resolved from the parameters; a rebuild drops it.
    """

    def __init__(self) -> None:
        self._groups: list[list[torch.Tensor]] = []
        self._params: list[torch.Tensor] = []
        self.agreement: Agreement | None = None

    def of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters of ``optimizer`` (the cached list when its groups are unchanged)."""
        groups = optimizer.param_groups
        cached = self._groups
        if len(cached) == len(groups):
            for kept, group in zip(cached, groups, strict=True):  # a loop, not a generator: no resumption per group
                params = group["params"]
                if len(kept) != len(params) or not all(map(operator.is_, kept, params)):
                    break
            else:
                return self._params
        self._groups = [list(g["params"]) for g in groups]
        self._params = [p for params in self._groups for p in params]
        self.agreement = None
        return self._params

    def agreed(self, process_group: Any) -> Agreement:
        """The collectives over which these parameters' flag and norms agree (``distributed.resolve``),
        resolved from the parameters ``of`` last returned, never from gradients, which differ between
        ranks; kept until the parameters or ``process_group`` change."""
        if self.agreement is None or self.agreement.explicit is not process_group:
            self.agreement = distributed.resolve(self._params, process_group)
        return self.agreement


V = TypeVar("V")


class WeakById(Generic[V]):
    """A map keyed weakly by object identity: an entry goes when its key is collected, and a new object
    at a dead one's address finds nothing. A look-up is one dict get and one call (~0.5 us; torch's
    ``WeakIdKeyDictionary`` builds a key reference per look-up, ~2 us)."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ReferenceType[Any], V]] = {}

    def get(self, key: object) -> V | None:
        """The value stored for ``key`` itself, or None."""
        entry = self._data.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def __setitem__(self, key: object, value: V) -> None:
        data, address = self._data, id(key)

        def forget(ref: weakref.ReferenceType[Any]) -> None:  # holds the dict, not its owner
            entry = data.get(address)
            if entry is not None and entry[0] is ref:
                del data[address]

        data[address] = (weakref.ref(key, forget), value)

    def values(self) -> list[V]:
        """The values whose keys are alive."""
        return [value for ref, value in list(self._data.values()) if ref() is not None]


GRAD, DTYPE = operator.attrgetter("grad"), operator.attrgetter("dtype")
"""``GRAD(p)`` is ``p.grad``; ``map(GRAD, params)`` reads every gradient at C speed (``DTYPE``: every dtype)."""


def group_grads(params: Sequence[torch.Tensor], *, allow_fp16: bool, owners: GradGroups | None = None) -> GradGroups:
    """The checkable views of the gradients of ``params`` (those that have one), by device then dtype.

    ``owners``, when given, receives the parameters in the same layout (``owners[d][t][i]`` owns
    ``groups[d][t][i]``).

    Raises ``ValueError`` (torch's message, with advice) on a float16 gradient unless ``allow_fp16``.
    May replace a sparse float16 ``.grad`` by its coalesced copy. Dense plain gradients, the common
    case, are grouped by torch's C++ helper; sparse, complex and DTensor ones take the slow path.
    """
    grads: list[torch.Tensor] = list(map(GRAD, params))
    if any(map(operator.is_, grads, repeat(None))):
        params = [p for p, g in zip(params, grads, strict=True) if g is not None]
        grads = [g for g in grads if g is not None]
    plain = torch.Tensor
    special = [i for i, g in enumerate(grads) if type(g) is not plain or g.is_sparse]
    dense_params = params
    if special:
        skip = set(special)
        dense_params = [p for i, p in enumerate(params) if i not in skip]
        grads = [g for i, g in enumerate(grads) if i not in skip]
    groups = new_groups()
    if grads:
        grouped = torch._C._group_tensors_by_device_and_dtype([grads], owners is not None)  # type: ignore[list-item]
        for (device, dtype), (tensor_lists, indices) in grouped.items():
            tensors: list[torch.Tensor] = tensor_lists[0]  # type: ignore[assignment]
            if dtype.is_complex:
                tensors = [torch.view_as_real(t) for t in tensors]
                dtype = tensors[0].dtype
            elif dtype == torch.float16 and not allow_fp16:
                raise ValueError(FP16_GRADS_MESSAGE)
            groups[device][dtype].extend(tensors)
            if owners is not None:
                owners[device][dtype].extend(dense_params[i] for i in indices)
    if special:
        with torch.no_grad():
            for param in (params[i] for i in special):
                grad = param.grad
                assert grad is not None
                if grad.dtype == torch.float16 and not allow_fp16:
                    raise ValueError(FP16_GRADS_MESSAGE)
                if grad.is_sparse and grad.dtype is torch.float16:
                    # Duplicate indices of scaled float16 values can sum past 65504: check (and step) them summed.
                    param.grad = grad = grad.coalesce()
                grad = checkable_view(grad)
                groups[grad.device][grad.dtype].append(grad)
                if owners is not None:
                    owners[grad.device][grad.dtype].append(param)
    return groups


def checkable_view(grad: torch.Tensor) -> torch.Tensor:
    """The values of ``grad`` that decide whether it is finite, as a real strided tensor.

    A DTensor gives its local shard, a sparse tensor its values (float16 ones summed over duplicate
    indices first), a complex tensor its real view; a plain tensor itself. Writes nothing.
    """
    grad = _local(grad)
    if grad.is_sparse:
        if grad.dtype is torch.float16 and not grad.is_coalesced():
            grad = grad.coalesce()
        grad = grad._values()
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    return grad


def unscale_and_check_(
    groups: GradGroups, inv_scale: torch.Tensor, found_inf: torch.Tensor | None = None
) -> dict[torch.device, torch.Tensor]:
    """Multiply every gradient by ``inv_scale`` in place; return a 0-d float32 flag per device.

    Each device's flag starts as a copy of ``found_inf`` (0 when None) and becomes 1.0 if any of that
    device's gradients is inf or NaN.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    for device, by_dtype in groups.items():
        if found_inf is None:
            found = torch.scalar_tensor(0.0, dtype=torch.float32, device=device)
        else:
            found = found_inf.to(device, non_blocking=True, copy=True)
        inv = moved(inv_scale, device, inv_scale.dtype)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        flags[device] = found
    return flags


def nonfinite_flags(groups: GradGroups) -> dict[torch.device, torch.Tensor]:
    """The non-finite flag per device (0-d float32, 1.0 when any value is inf or NaN); writes nothing."""
    return norms_and_check(groups, None)[1]


def norms_and_check(
    groups: GradGroups, norm_type: float | None, inv_scale: torch.Tensor | None = None
) -> tuple[dict[torch.device, torch.Tensor], dict[torch.device, torch.Tensor]]:
    """Per-tensor ``norm_type``-norms of the gradients times ``inv_scale`` (one 1-d tensor per device) and the flag.

    One read of each gradient gives both; the flag is exact and the norms do not overflow before the
    multiply by ``inv_scale`` (None: the gradients as stored). ``norm_type=None`` computes the flags
    alone (and returns no norms).
    """
    flags: dict[torch.device, torch.Tensor] = {}
    norms: dict[torch.device, torch.Tensor] = {}
    for device, by_dtype in groups.items():
        stats = [grad_stats(grads, norm_type, inv_scale) for grads in by_dtype.values()]
        flags[device] = combine_flags([s.nonfinite for s in stats])
        parts = [s.norms for s in stats if s.norms is not None]
        if parts:
            norms[device] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return norms, flags


def peaks(groups: GradGroups) -> dict[torch.device, torch.Tensor]:
    """Each gradient's largest magnitude as stored, one 1-d tensor per device in ``norms_and_check``'s order: its
    inf-norms, without the flag (for a reader that has the flag already)."""
    out: dict[torch.device, torch.Tensor] = {}
    for device, by_dtype in groups.items():
        parts = [grad_peaks(grads) for grads in by_dtype.values()]
        if parts:
            out[device] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


def flat_owners(owners: GradGroups) -> Owners:
    """``owners`` as ``group_grads`` fills it, each device's dtype lists one after another: the order of
    the per-tensor results ``norms_and_check`` returns."""
    return {device: [p for params in by_dtype.values() for p in params] for device, by_dtype in owners.items()}


def merge_flags(*parts: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """Per-device flags of several passes combined into one flag per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for part in parts:
        for device, flag in part.items():
            by_device.setdefault(device, []).append(flag)
    return {device: combine_flags(flags) for device, flags in by_device.items()}


def flag_on(per_device: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The per-device flags combined into one on ``device`` (a zero flag when there are none)."""
    flags = [flag.to(device, non_blocking=True) for flag in per_device.values()]
    return combine_flags(flags) if flags else torch.zeros((), dtype=torch.float32, device=device)


def combine_flags(flags: list[torch.Tensor]) -> torch.Tensor:
    """Combine 0-d float flags on one device into one (nonzero if any is). A single flag is returned as
    is, and so is the largest where reads are free (the CPU: two host reads instead of two ops)."""
    if len(flags) == 1:
        return flags[0]
    if host_reads_free(flags[0].device):
        return max(flags, key=torch.Tensor.item)
    return torch.stack(flags).amax()
