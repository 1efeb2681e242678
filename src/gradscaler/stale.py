"""An optimizer's record of the iteration (``OptimizerRecord``), and telling a retried step from a new
iteration when an unscaled optimizer was never stepped.

``unscale_`` (or ``clip_grad_norm_``) leaves an optimizer's gradients unscaled and its record says so
until ``update()``. If the iteration is interrupted before ``step`` (an exception in the user's
clipping or logging, a KeyboardInterrupt, an exception inside ``optimizer.step``) and the loop goes on
with ``zero_grad`` and a new ``scale(loss).backward()``, the record describes gradients that no longer
exist: the new ones are still multiplied by the scale. torch steps them as they are.

The signal is ``scale()`` itself, called once per iteration: only when it finds a record that is
unscaled and not stepped (the interrupted case; normal loops never do) does the scaler take a
``GradSnapshot`` of that optimizer's gradients. At its next ``unscale_``, ``clip_grad_norm_`` or
``step``, gradients that are other objects (``zero_grad(set_to_none=True)`` and a backward) or whose
version counter moved (an in-place ``zero_grad`` and a backward) mean a new backward: the record is stale
and the optimizer starts the iteration afresh. Unchanged gradients, or gradients only dropped since (a
``zero_grad`` and no backward), mean a retry of the same iteration (or a backward that wrote only other
optimizers' gradients): the record stands, and what is left is stepped exactly as it is, as torch's scaler
steps it. Version counters alone would not do: ``torch.nn.utils.clip_grad_norm_``
after ``unscale_`` moves them in the standard recipe, with no ``scale()`` in between.

A new backward is not always a new iteration: a loop that unscales at every micro-batch (Accelerate's
``clip_grad_norm_`` written outside ``if accelerator.sync_gradients:``) adds the next micro-batch's
scaled gradients to the unscaled ones, a sum that is neither. The snapshot tells the two apart by what
the backward found: gradients that ``zero_grad`` cleared (None, or all zeros) start a new iteration;
any other value left there means accumulation onto unscaled gradients (``GradSnapshot.cleared``), which
the scaler refuses as torch's scaler does at the second ``unscale_``. What the backward found is read
when it begins (``watch_unscaled``'s hook on the scaled outputs), not at ``scale()``: a loop may call
``zero_grad`` between the two, or between another optimizer's backward and this one's (DCGAN's loop): the first
backward whose graph reaches the optimizer's parameters is the one read (``Watch``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias, TypedDict

import torch
from torch.amp.grad_scaler import OptState

MIXED_MESSAGE = (
    "Call unscale_() (or clip_grad_norm_()) once per iteration, after the last backward of the accumulation "
    "window (with Accelerate: inside `if accelerator.sync_gradients:`), or zero_grad() before a new backward "
    "to start the iteration again. {call} found gradients that unscale_() divided by the scale and a later "
    "backward added scaled gradients to: a sum that is neither, which no step can use. torch's scaler raises "
    "at the second unscale_() and steps such a sum as it is (docs/migration.md)."
)


class GradSnapshot:
    """Which gradient tensor each parameter holds, and its version counter, at one moment; and whether
    the gradients a backward would add to were all cleared then.

    Holds weak references to gradients only: a snapshot never keeps a gradient alive, and no reference to a
    parameter (``torch.utils.swap_tensors``, which ``module.to`` may use, refuses a tensor with weak references).
    ``left``: ``largest_magnitude`` of the gradients a new backward adds to, taken at the same moment or just before.
    ``waiting``: taken at ``scale()``, to be taken again when the next backward begins (``watch_unscaled``).
    """

    __slots__ = ("_left", "_seen", "waiting")

    def __init__(self, params: Sequence[torch.Tensor], left: torch.Tensor | None = None, waiting: bool = False) -> None:
        # id of each parameter -> a weak reference to its gradient (None: it had none) and the gradient's version
        self._seen: dict[int, tuple[weakref.ReferenceType[torch.Tensor] | None, int | None]] = {}
        for param in params:
            grad = param.grad
            self._seen[id(param)] = (None, None) if grad is None else (weakref.ref(grad), grad._version)
        self._left = left
        self.waiting = waiting

    def cleared(self) -> bool:
        """Whether every gradient a backward would add to was None or all zeros when the snapshot was
        taken (a ``zero_grad``). Reads the device once; only asked after ``changed``."""
        return self._left is None or bool(self._left.eq(0).item())

    def watches_any(self, ids: set[int]) -> bool:
        """Whether the snapshot was taken of any parameter whose id is in ``ids``."""
        return not ids.isdisjoint(self._seen)

    def changed(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether any parameter of ``params`` now holds another gradient, or one written since, as a backward
        leaves them; a parameter added since the snapshot (``add_param_group``) only if it holds one; one gone
        from them, always. A gradient dropped since (None: a ``zero_grad`` with no backward after it) is no
        change: no backward drops one, and the record stands for what is left, as torch's scaler's does."""
        met: set[int] = set()
        for param in params:
            grad = param.grad
            seen = self._seen.get(id(param))
            if seen is not None:
                met.add(id(param))
            if grad is None:
                continue
            if seen is None:  # added since, with a gradient
                return True
            ref, version = seen
            if ref is None or ref() is not grad or grad._version != version:
                return True
        return len(met) != len(self._seen)


class Masters(Protocol):
    """What ``watch_unscaled`` asks of the scaler's master weights (``masters.MasterWeights`` or ``NoMasters``)."""

    def added_to(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def release(self, optimizer: torch.optim.Optimizer) -> None: ...
    def lows(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]: ...


def watched(masters: Masters, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose gradients a new backward (or ``zero_grad``) changes: ``optimizer``'s ``params``,
    and with master weights the low-precision parameters the backward writes."""
    return params + masters.lows(optimizer)


# each snapshot waiting for its backward: its optimizer's record and the optimizer (weakly)
Waiting: TypeAlias = "list[tuple[OptimizerRecord, weakref.ReferenceType[torch.optim.Optimizer]]]"


class Watch:
    """The snapshots ``scale()`` took after an interrupted iteration that wait for the first backward to reach
    their optimizer's parameters (``watch_unscaled``)."""

    __slots__ = ("_masters", "_params_of", "_waiting")

    def __init__(
        self, waiting: Waiting, masters: Masters, params_of: Callable[[torch.optim.Optimizer], list[torch.Tensor]]
    ) -> None:
        self._waiting, self._masters, self._params_of = waiting, masters, params_of

    def hook(self, scaled: torch.Tensor) -> None:
        """Hook ``scaled`` (a scaled output that requires grad) to take again, when its backward begins, each
        snapshot whose parameters its graph reaches (a walk of the graph: only after an interrupted iteration)."""
        reached = leaves(scaled)
        mine = [(record, ref) for record, ref in self._waiting if _reaches(record, reached)]
        if mine:
            scaled.register_hook(functools.partial(_began, mine, self._masters, self._params_of))


def watch_unscaled(
    records: Iterable[OptimizerRecord],
    masters: Masters,
    params_of: Callable[[torch.optim.Optimizer], list[torch.Tensor]],
) -> Watch | None:
    """At ``scale()`` after an interrupted iteration: snapshot the gradients of each record still unscaled and
    not stepped. Returns what hooks the scaled outputs so that each snapshot is taken again when the first
    backward that reaches its optimizer's parameters begins (a ``zero_grad`` may come between ``scale()`` and
    that backward, or between another optimizer's backward and it), releasing the kept float16 gradients of
    master weights so that the backward writes them afresh; None when no snapshot waits."""
    waiting: Waiting = []
    for record in records:
        optimizer = record["optimizer"]() if "optimizer" in record else None
        if record["stage"] is not OptState.UNSCALED or optimizer is None:
            continue
        seen = record.get("grads_seen")
        if seen is None:
            seen = record["grads_seen"] = _snapshot(masters, optimizer, params_of(optimizer), begun=False)
        if seen.waiting:
            waiting.append((record, record["optimizer"]))
    return Watch(waiting, masters, params_of) if waiting else None


def graph_nodes(output: Any) -> Iterator[Any]:
    """Each node of the autograd graph of ``output`` (a tensor, or a node) once, from the top; an
    ``AccumulateGrad`` node (it has a ``variable``) ends its branch. Each node met is held until the walk ends:
    torch (2.11 and older) makes a new Python object for a node at each access and frees it after, so a bare
    id() set would meet a freed node's id again on another node and skip it (and every node below it)."""
    stack: list[Any] = [getattr(output, "grad_fn", output)]
    held: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in held:
            continue
        held[id(node)] = node
        yield node
        if getattr(node, "variable", None) is None:
            stack.extend(following for following, _ in node.next_functions)


def leaves(output: torch.Tensor) -> set[int]:
    """The ids of the tensors a backward of ``output`` accumulates gradients into: its graph's ``AccumulateGrad``
    nodes (those a reentrant activation checkpoint hides inside its node are not seen)."""
    if output.grad_fn is None:
        return {id(output)}
    return {id(variable) for node in graph_nodes(output) if (variable := getattr(node, "variable", None)) is not None}


def _reaches(record: OptimizerRecord, reached: set[int]) -> bool:
    seen = record.get("grads_seen")
    return seen is not None and seen.waiting and seen.watches_any(reached)


def _began(
    waiting: Waiting,
    masters: Masters,
    params_of: Callable[[torch.optim.Optimizer], list[torch.Tensor]],
    grad: torch.Tensor,
) -> None:
    for record, ref in waiting:
        optimizer, seen = ref(), record.get("grads_seen")  # None: checked already (or the optimizer is gone)
        if optimizer is not None and seen is not None and seen.waiting:
            record["grads_seen"] = _snapshot(masters, optimizer, params_of(optimizer), begun=True)


def _snapshot(
    masters: Masters, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], begun: bool
) -> GradSnapshot:
    added_to = masters.added_to(optimizer, params)
    left = largest_magnitude(added_to)  # before the release: the kept gradients are left there
    if begun:
        masters.release(optimizer)  # the new backward must not add to the kept float16 gradients
    return GradSnapshot(watched(masters, optimizer, params), left, waiting=not begun)


def largest_magnitude(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The largest magnitude over the gradients of ``params`` as a device tensor (NaN when any is NaN),
    None when all are None: no host sync, so ``scale()`` pays nothing it may not need."""
    present = [p.grad for p in params if p.grad is not None]
    if not present:
        return None
    dense: list[torch.Tensor] = []
    peaks: list[torch.Tensor] = []
    with torch.no_grad():
        for grad in present:
            if type(grad) is torch.Tensor and grad.layout is torch.strided and grad.numel():
                dense.append(grad)
                continue
            values = grad.coalesce().values() if grad.is_sparse else getattr(grad, "_local_tensor", grad)
            peak = values.abs().amax() if values.numel() else values.new_zeros(())  # sparse, DTensor, empty
            peaks.append(peak.to(torch.float32))
        if dense:
            peaks += [norm.to(torch.float32) for norm in torch._foreach_norm(dense, float("inf"))]
        device = peaks[0].device
        return torch.stack([peak.to(device) for peak in peaks]).amax()


class OptimizerRecord(TypedDict, total=False):
    """What the scaler knows about one optimizer during the current iteration.

    ``stage`` and ``found_inf_per_device`` are torch's two keys (torch's ``OptState``); the others are
    ours: the agreed flag, a weak reference to the optimizer, the ``grad_scale`` a fused optimizer
    receives after clipping, whether ``clip_grad_norm_`` ran, the gradients an unscaled record
    describes when ``scale()`` found it not stepped, and whether a backward added to them (``stale``).
    """

    stage: OptState
    found_inf_per_device: dict[torch.device, torch.Tensor]
    found_inf: torch.Tensor
    optimizer: weakref.ReferenceType[torch.optim.Optimizer]
    grad_scale: torch.Tensor
    clipped: bool
    grads_seen: GradSnapshot
    mixed: bool


def fresh_record() -> OptimizerRecord:
    """A record at the start of an iteration (torch's ``_refresh_per_optimizer_state``)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}
