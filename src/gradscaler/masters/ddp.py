"""The float32 sums of ``accumulate_grads_in_fp32`` averaged across DistributedDataParallel's ranks
(``scaler.register_ddp(ddp_model)``).

Order in one backward under DDP (torch 2.13): autograd's ``AccumulateGrad`` node writes the gradient into
``p.grad`` and runs the tensor's post-accumulate-grad hooks (ours: the gradient goes into the float32 sum,
``p.grad = None``) inside the node; DDP's reducer hook is a post hook of that node, so it runs after ours
and finds ``p.grad`` None: it zeroes the parameter's place in its bucket, all-reduces the bucket, and at
the end of the backward writes that average (zeros) into ``p.grad``. Under ``no_sync()`` the reducer does
nothing. So DDP never sees our sums, and what it writes is dropped at the move.

At the move (the first ``unscale_``/``clip_grad_norm_``/``step`` of the iteration) the scaler reduces the
sums itself, in float32 as Megatron-LM does: per (process group, device), one tensor holding every
master's sum flattened in the optimizer's parameter order (zeros where this rank has none) and one flag
per master (1 where this rank has a sum), one ``all_reduce`` (SUM) over DDP's process group, then the
sums divided by the group's size. A master gets the average when any rank had a sum, and None when none
did (not stepped, as DDP leaves a globally unused parameter's gradient). Reading the flags is one host
sync per move. An overflow on any rank makes the average non-finite on every rank: every rank skips.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

NOT_DDP_MESSAGE = (
    "Pass scaler.register_ddp the DDP-wrapped model: the object DistributedDataParallel(model) returned, "
    "or a framework's wrapper holding exactly one, such as what Lightning Fabric's setup() returns. "
    "scaler.register_ddp(module): module is a {kind}, not a torch.nn.parallel.DistributedDataParallel, "
    "and holds {count} among its submodules. Nothing was registered."
)

NOT_ACCUMULATING_MESSAGE = (
    "Leave the call out, or build the scaler with accumulate_grads_in_fp32=True. "
    "scaler.register_ddp(ddp_model) is for GradScaler(master_weights=True, "
    "accumulate_grads_in_fp32=True): this scaler has accumulate_grads_in_fp32={accumulate}, and without "
    "the argument DDP's own all-reduce gives the masters their gradients. Nothing was registered."
)


class DataParallel:
    """The parameters of the DDP modules registered with one scaler, each with DDP's process group."""

    def __init__(self) -> None:
        # (the DDP module, weakly; its process group; the ids of the parameters it reduces): ids, not weak
        # references to parameters, which torch's swap_tensors refuses; the live module keeps them valid
        self._modules: list[tuple[weakref.ReferenceType[Any], Any, frozenset[int]]] = []

    def register(self, module: Any) -> list[torch.Tensor]:
        """Take the process group of ``module`` (a DDP module, or a wrapper holding exactly one among its
        submodules: ``find_ddp``) and the parameters DDP reduces (not ``parameters_to_ignore``), frozen ones
        too: DDP's reducer took those that required a gradient when it wrapped the module, which DDP does
        not keep, and a layer frozen since (or before, and unfrozen later) would otherwise drift apart
        across ranks, silently. Returns those parameters."""
        module = find_ddp(module)
        ignored: set[str] = getattr(module, "parameters_to_ignore", set())
        params = [p for name, p in module.module.named_parameters() if name not in ignored]
        self._modules = [entry for entry in self._modules if entry[0]() not in (None, module)]
        self._modules.append((weakref.ref(module), module.process_group, frozenset(map(id, params))))
        return params

    def __bool__(self) -> bool:
        return any(entry[0]() is not None for entry in self._modules)

    def group_of(self, param: torch.Tensor) -> Any:
        """DDP's process group of ``param`` if a registered module reduces it, else None."""
        for module, group, ids in self._modules:
            if id(param) in ids and module() is not None:
                return group
        return None

    def covers(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is DDP's to reduce (registered)."""
        return self.group_of(param) is not None

    def drop_reduced(self, params: list[torch.Tensor]) -> None:
        """Before the move: drop what DDP's reducer wrote into the registered parameters' ``.grad``."""
        for param in params:
            if param.grad is not None and self.covers(param):
                param.grad = None

    def reduce(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Average the masters' float32 sums of the registered parameters among ``pairs`` (low-precision
        parameter, master) across their DDP groups, as the module docstring says."""
        batches: dict[tuple[int, torch.device], tuple[Any, list[torch.Tensor]]] = {}
        for low, master in pairs:
            group = self.group_of(low)
            if group is not None:
                batches.setdefault((id(group), master.device), (group, []))[1].append(master)
        for group, masters in batches.values():
            _average(group, masters)


def find_ddp(module: Any) -> torch.nn.parallel.DistributedDataParallel:
    """``module`` if it is DDP, else the one DDP module among its submodules (a framework's wrapper around
    the DDP-wrapped model: Lightning Fabric's ``_FabricModule`` holds it as ``_forward_module``);
    ``TypeError`` (``NOT_DDP_MESSAGE``) otherwise."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if isinstance(module, ddp):
        return module
    found = [m for m in module.modules() if isinstance(m, ddp)] if isinstance(module, torch.nn.Module) else []
    if len(found) != 1:
        raise TypeError(NOT_DDP_MESSAGE.format(kind=type(module).__name__, count=len(found) or "none"))
    return found[0]


def _average(group: Any, masters: list[torch.Tensor]) -> None:
    device = masters[0].device
    parts = [m.grad.reshape(-1) if m.grad is not None else torch.zeros(m.numel(), device=device) for m in masters]
    flags = torch.tensor([float(m.grad is not None) for m in masters], dtype=torch.float32, device=device)
    flat = torch.cat([*parts, flags])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
    count = flat.numel() - len(masters)
    sums = flat[:count]
    sums.div_(torch.distributed.get_world_size(group))
    present = flat[count:].tolist()  # the one host sync: which masters any rank gave a gradient
    offset = 0
    for master, seen in zip(masters, present, strict=True):
        piece = sums[offset : offset + master.numel()].view(master.shape)
        offset += master.numel()
        if not seen:
            master.grad = None
        elif master.grad is not None:
            master.grad.copy_(piece)
        else:
            master.grad = piece.clone()
