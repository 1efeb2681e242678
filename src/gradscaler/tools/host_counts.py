"""What one phase of a step costs, as ``gradscaler bench --sections host`` counts it (``tools/bench_host.py``
runs the loops): the ATen ops dispatched (``Counts``, a ``TorchDispatchMode``) and of them the kernel launches
(``PhaseCost.launches``: not views, allocations, marks or host reads; a casting reduction's hidden cast added),
the launches of gradscaler's Triton kernels (``triton_counted``), and on a GPU what the device ran as its
profiler records it (``device_work``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_LAUNCH = frozenset(
    {
        "_local_scalar_dense",  # a host read: counted as a sync
        "_record_function_enter_new",
        "_record_function_exit",
        "alias",
        "as_strided",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "lift_fresh",
        "new_empty",
        "new_empty_strided",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "_unsafe_view",
    }
)
"""ATen ops that launch no kernel on CUDA: views, allocations, profiler marks, host reads."""


CASTING_REDUCTIONS = frozenset({"sum", "nansum", "prod"})
"""Reductions that, given a ``dtype`` other than their input's, first cast the input with an op of their own that
no dispatch mode sees (ATen's ``make_reduction_from_out_ty``; on CUDA not for float16/bfloat16 summed into float32)."""


def _casts_first(args: Any, kwargs: Any) -> bool:
    dtype = (kwargs or {}).get("dtype")
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if dtype is None or source is None or dtype == source.dtype:
        return False
    return not (source.dtype in (torch.float16, torch.bfloat16) and dtype == torch.float32)


class Counts(TorchDispatchMode):
    """ATen ops dispatched inside the block, by name; a casting reduction's hidden cast as a ``_to_copy``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not _IN_TRITON[0]:  # the interpreter's own tensor work stands for one launch, counted apart
            name = func.overloadpacket.__name__
            self.ops[name] += 1
            if name in CASTING_REDUCTIONS and _casts_first(args, kwargs):
                self.ops["_to_copy"] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class PhaseCost:
    """One phase of one step: ops by name, Triton launches, thread CPU time (ns)."""

    ops: Counter[str]
    triton: int
    cpu_ns: int

    @property
    def launches(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in NO_LAUNCH)

    @property
    def syncs(self) -> int:
        return self.ops["_local_scalar_dense"]


TRITON_LAUNCHES = [0]
_IN_TRITON = [False]


@contextmanager
def triton_counted() -> Iterator[None]:
    """Count launches of gradscaler's Triton kernels (only where they run: on CUDA, or forced)."""
    from gradscaler.kernels import triton_stats

    launch = triton_stats.launch

    def counted(*args: Any, **kwargs: Any) -> None:
        TRITON_LAUNCHES[0] += 1
        _IN_TRITON[0] = True
        try:
            launch(*args, **kwargs)
        finally:
            _IN_TRITON[0] = False

    triton_stats.launch = counted
    try:
        yield
    finally:
        triton_stats.launch = launch


def device_work(call: Callable[[], Any], device_type: str | None) -> tuple[Any, int | None]:
    """``call()``, and what ``device_type``'s profiler saw that device run for it (kernels, copies, fills: on CUDA
    each a launch or a copy the host issued, a multi-tensor op's several kernels and the ops' hidden ones
    included), None when ``device_type`` is None or the profiler could not say. ``call`` runs once either way."""
    if device_type is None:
        return call(), None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        session = torch.profiler.profile(activities=activities)
        session.__enter__()
    except Exception:  # a profiler that cannot start: the count is unknown, the step still runs
        return call(), None
    try:
        result = call()
        if device_type == "cuda":
            torch.cuda.synchronize()  # every kernel done before the profiler stops
    finally:
        try:
            session.__exit__(None, None, None)
            events = session.events()
        except Exception:
            events = None
    if events is None:
        return result, None
    wanted = getattr(torch.autograd.DeviceType, device_type.upper())
    return result, sum(1 for event in events if event.device_type == wanted)
