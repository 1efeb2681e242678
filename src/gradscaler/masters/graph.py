"""Which parameters a backward will give gradients: the float16/bfloat16 ``nn.Parameter``s of a
``scale(loss)`` output's graph (``graph_leaves``), including those a reentrant activation checkpoint hides
(``checkpointed``). ``accumulate`` hooks them in the first iteration, before any optimizer is bound."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from gradscaler.masters.checks import LOW_PRECISION
from gradscaler.stale import graph_nodes


def graph_leaves(output: Any, running: bool = False) -> list[torch.Tensor]:
    """The float16/bfloat16 ``nn.Parameter``s whose gradients a backward of ``output`` accumulates: the
    ``AccumulateGrad`` nodes of its graph, and the parameters a reentrant checkpoint's node hides
    (``checkpointed``; with the parameters of everything its function reaches, some maybe twice).
    ``running``: called inside that backward, before it reaches them, ``output`` its node: the parameters it will
    accumulate into (none for ``torch.autograd.grad``; those of ``inputs``), a checkpoint's hidden ones left out."""
    found: list[torch.Tensor] = []
    for node in graph_nodes(output):
        variable = getattr(node, "variable", None)
        if variable is not None:
            low = isinstance(variable, torch.nn.Parameter) and variable.dtype in LOW_PRECISION
            if low and (not running or _accumulates(node)):
                found.append(variable)
            continue
        function = getattr(node, "run_function", None)
        if function is not None and not running:  # its other arguments: ``inputs`` (tensors as None)
            found.extend(checkpointed((function, getattr(node, "inputs", None)), depth=5))
    return found


def _accumulates(node: Any) -> bool:
    """Inside a backward: whether it will run ``node``, an ``AccumulateGrad``."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch.autograd.grad: it accumulates into no leaf (torch refuses to be asked of one)
        return False


_WIDEST = 4096  # items of a list or tuple that ``checkpointed`` looks at


def checkpointed(function: Any, depth: int = 4) -> list[torch.Tensor]:
    """The float16/bfloat16 parameters that require grad among those ``function`` reaches: the
    ``run_function`` of a reentrant activation checkpoint (``torch.utils.checkpoint(use_reentrant=True)``,
    ``checkpoint_sequential``, DeepSpeed's and Megatron-LM's), which runs under ``no_grad`` in the forward,
    so the checkpoint's graph node takes the parameters' gradients without showing their ``AccumulateGrad``
    nodes. Looked into, ``depth`` levels down: modules (all their parameters), bound methods, a
    ``functools.partial``'s function and arguments, a function's closure and default arguments, lists and
    tuples (the checkpoint's arguments other than tensors among them, such as a block passed to a function
    that runs it; their first ``_WIDEST`` items: a closure over a long list of numbers costs nothing). Not a
    function's globals (a module-level function using a global model: the binding warns instead)."""
    params: dict[int, torch.Tensor] = {}
    seen: dict[int, Any] = {}  # held, so that no id is met again on another object
    level = [function]
    for _ in range(depth):
        below: list[Any] = []
        for item in level:
            if id(item) in seen:
                continue
            seen[id(item)] = item
            if isinstance(item, torch.nn.Module):
                params.update((id(p), p) for p in item.parameters())
            elif isinstance(item, torch.nn.Parameter):
                params[id(item)] = item
            elif isinstance(item, types.MethodType):
                below += (item.__self__, item.__func__)
            elif isinstance(item, functools.partial):
                below += (item.func, *item.args, *item.keywords.values())
            elif isinstance(item, types.FunctionType):
                below += (cell.cell_contents for cell in item.__closure__ or () if _filled(cell))
                below += (*(item.__defaults__ or ()), *(item.__kwdefaults__ or {}).values())
            elif isinstance(item, (list, tuple)):
                below += item[:_WIDEST]
        level = below
    return [p for p in params.values() if p.dtype in LOW_PRECISION and p.requires_grad]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
