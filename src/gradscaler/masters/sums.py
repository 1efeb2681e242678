"""One parameter's float32 sum of an iteration's gradients and the post-accumulate-grad hook that keeps it
(``Sum``), for ``accumulate.Accumulation``, which holds one per hooked parameter of its scaler.

A hook belongs to the scaler whose optimizer steps its parameter. Made from a scaled graph before any
binding, it is a claim: the scaler whose optimizer binds the parameter takes it over (``Sum.take_over``),
or, without float32 sums, has it give the gradient back to ``p.grad`` (``give_way``).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscaler import compiled
from gradscaler.masters import zeroing
from gradscaler.masters.checks import CREATE_GRAPH_MESSAGE, SPARSE_MESSAGE

# The key of the token a hooked parameter carries in its ``__dict__``: torch's ``swap_tensors`` swaps the
# ``__dict__`` with the new tensor's (empty), so a parameter without its Sum's token was swapped. Its
# ``_cdata`` alone does not tell: a swap frees the old tensor, and a second swap (a round trip under the
# swap-tensors future) may get the first one's address back, hooks dead (found by the state machine).
HOOKED_KEY = "_gradscaler_sum_token"
_TOKENS = itertools.count()
# a gradient ``Sum.release`` gave back in the parameter's dtype -> (its version then, the float32 sum it rounds):
# a scaler that hooks the parameter before anything touched that gradient starts from the float32 sum (G's
# scaler gives D's back at its update, D's own scaler takes them at its next scale()); held weakly by the
# gradient, which a ``zero_grad`` drops
_RELEASED = WeakIdKeyDictionary()
# the scalers (their ``Accumulation``) that hooked parameters from their scaled graphs and have not ended their
# first iteration: a scaler without float32 sums gives way to them at each move while any is (``give_way``)
CLAIMING: weakref.WeakSet[Any] = weakref.WeakSet()


class Sum:
    """One parameter's float32 sum of this iteration's gradients, and the hook autograd calls after it
    wrote a backward's gradient into the parameter's ``.grad``.

    ``fresh``: the next gradient starts the sum (the iteration's first); ``total``: the sum while no
    master is bound (after that it lives in the master's ``.grad``), and ``low`` beside it, the same
    gradients added in the parameter's dtype as autograd adds them (what ``release`` gives back: a parameter
    no optimizer of this scaler steps gets the gradient it would have had without the hook); ``impl``: the parameter's
    ``_cdata`` when hooked (torch's ``swap_tensors`` gives the parameter a new one, without the hook);
    ``token``: the one it gave the parameter (``HOOKED_KEY``), which a swap takes away.
    The parameter holds it (its hooks); it holds no reference to the parameter (torch's swap refuses a
    weakly referenced tensor), and its master and owner weakly: a hook whose scaler is gone leaves
    ``.grad`` as autograd wrote it."""

    __slots__ = ("__weakref__", "fresh", "handle", "impl", "low", "master", "owner", "token", "total")

    def __init__(self, param: torch.Tensor, owner: object) -> None:
        self.impl = param._cdata
        self.token = self.mark(param)
        self.owner = weakref.ref(owner)
        self.master: weakref.ref[torch.Tensor] | None = None
        self.total: torch.Tensor | None = None
        self.low: torch.Tensor | None = None
        self.fresh = True
        self.handle: Any = None

    @compiled.eager  # autograd calls it inside a compiled step's backward: one frame per parameter otherwise
    def __call__(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None or param._cdata != self.impl or self.owner() is None:
            return  # a copy of the parameter that shares the hook, or a scaler that is gone
        if grad.layout is not torch.strided or grad.requires_grad:
            param.grad = None  # a refused backward leaves nothing behind: the first hook of it refuses
            if grad.layout is not torch.strided:
                raise ValueError(SPARSE_MESSAGE.format(shape=tuple(param.shape), dtype=param.dtype, layout=grad.layout))
            raise RuntimeError(CREATE_GRAPH_MESSAGE.format(shape=tuple(param.shape), dtype=param.dtype))
        master = None if self.master is None else self.master()
        if master is None:
            if self.fresh or self.total is None:
                released = _RELEASED.pop(grad, None) if _RELEASED else None
                if released is not None and released[0] == grad._version:
                    self.total = released[1]
                else:
                    self.total = grad.float()
                self.low = grad
                zeroing.waiting(param, self)
            else:
                self.total.add_(grad)
                self.low = None if self.low is None else self.low + grad  # rounded as autograd's add rounds
        else:
            self.add_to(master, grad)
        self.fresh = False
        param.grad = None

    def add_to(self, master: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` into ``master``'s gradient (the first of an iteration replaces it, written into
        last iteration's tensor when that is still there and fits)."""
        if self.total is not None:
            self.hand_over(master)
        out = master.grad
        if not self.fresh and out is not None:
            out.add_(grad)  # float32 += float16: each value widened exactly, added in float32
        elif out is not None and _fits(out, grad):
            out.copy_(grad)
        else:
            master.grad = grad.float()

    def hand_over(self, master: torch.Tensor) -> None:
        """The sum made before the binding, if any, becomes ``master``'s gradient."""
        if self.total is not None:
            master.grad, self.total, self.low = self.total, None, None

    def take(self, master: torch.Tensor) -> bool:
        """At the move: ``master``'s gradient becomes this iteration's sum, or None when the parameter got
        no gradient this iteration; the next gradient starts a new sum. Whether it has one."""
        if self.fresh:
            master.grad = None
        elif self.total is not None:
            master.grad, self.total, self.low = self.total, None, None
        self.fresh = True
        return master.grad is not None

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad`` of the sum held before the binding: None, or zeros that the next gradient adds to."""
        if self.total is None or self.handle is None:
            return
        if set_to_none:
            self.total = self.low = None
            self.fresh = True
        else:
            self.total.zero_()
            if self.low is not None:
                self.low.zero_()

    def take_over(self, other: Sum, param: torch.Tensor) -> None:
        """``other``, another scaler's hook on the same parameter, is removed and its sum of this iteration
        carried over (in its hook, or in the master's gradient the two share): a second scaler over an optimizer
        the first one bound steers alone, as its masters' checkpoint hooks do (with both hooks, the first moved
        each gradient and the second found none: nothing was trained)."""
        if other.handle is not None:
            other.handle.remove()
            other.handle = None
        self.total, self.low, self.fresh, self.master = other.total, other.low, other.fresh, other.master
        if other.owner() is None:  # a scaler that is gone binds nothing: its master is no one's
            master = None if other.master is None else other.master()
            self.master = None  # a hook that only met the parameter in a scaled graph sums apart, gives it back
            if master is not None and master.grad is not None and self.total is None and not self.fresh:
                self.total = master.grad.clone()  # its iteration's sum so far, carried on in this hook
                self.low = self.total.to(param.dtype)
        other.total = other.low = None
        if self.total is not None:
            zeroing.waiting(param, self)

    def rehook(self, param: torch.Tensor) -> None:
        """Hook ``param`` again after torch's ``swap_tensors`` (``model.float()`` with the swap-tensors
        future): its new tensor has no post-accumulate-grad hook; the Python dictionary it still shows
        is dead (each hook in it, the user's too, ran on the old tensor), so a new one replaces it."""
        param._post_accumulate_grad_hooks = None  # type: ignore[assignment]
        self.handle = param.register_post_accumulate_grad_hook(self)
        self.impl = param._cdata
        self.token = self.mark(param)

    @staticmethod
    def mark(param: torch.Tensor) -> int:
        """Give ``param`` a new token (``HOOKED_KEY``); return it."""
        token = next(_TOKENS)
        param.__dict__[HOOKED_KEY] = token
        return token

    def swapped(self, param: torch.Tensor) -> bool:
        """Whether torch's ``swap_tensors`` gave ``param`` a new tensor since it was hooked (its hook is
        then on the old one)."""
        return self.impl != param._cdata or param.__dict__.get(HOOKED_KEY) != self.token

    def follow(self, param: torch.Tensor) -> None:
        """Hook ``param`` again if torch's ``swap_tensors`` gave it a new tensor since it was hooked; not
        while it is frozen (torch refuses a hook on a tensor that does not require grad, and it gets no
        gradient): it stays marked as swapped, so the first ``scale()`` after it is unfrozen does it."""
        if param.requires_grad and self.swapped(param):
            self.rehook(param)

    def give_back(self, param: torch.Tensor) -> None:
        """``release`` for a scaler without float32 sums that binds ``param`` now: this iteration's gradient,
        held by the hook or, once bound, in the master's ``.grad``, goes into ``p.grad`` for its move."""
        master = None if self.master is None else self.master()
        summed = None if master is None or self.total is not None or self.fresh else master.grad
        if summed is not None and param.grad is None:
            param.grad = summed.to(param.dtype)  # the float32 sum rounded once (docs/migration.md)
        self.release(param)

    def release(self, param: torch.Tensor) -> None:
        """Remove the hook; the parameter's gradient, if any, goes back into its ``.grad`` in its dtype."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if param.__dict__.get(HOOKED_KEY) == self.token:
            del param.__dict__[HOOKED_KEY]
        if self.total is not None and not self.fresh and param.grad is None:
            param.grad = self.total.to(param.dtype) if self.low is None else self.low
            _RELEASED[param.grad] = (param.grad._version, self.total)
        self.total = self.low = None


def released(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is one a hook gave back (``Sum.release``), untouched since: its float32 sum is kept."""
    entry = _RELEASED.get(grad)
    return entry is not None and entry[0] == grad._version


def others(param: torch.Tensor, owner: object | None, live: bool = True) -> list[Sum]:
    """The hooks of scalers other than ``owner`` on ``param`` (``live``: only those whose scaler lives)."""
    found = []
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        if isinstance(hook, Sum) and hook.handle is not None:
            scaler = hook.owner()
            if (scaler is None and not live) or (scaler is not None and scaler is not owner):
                found.append(hook)
    return found


def give_way(params: list[torch.Tensor]) -> None:
    """A binding of ``params`` by a scaler without float32 sums, or its move while a scaler is ``CLAIMING``:
    the hooks other scalers put on them are removed (``Sum.give_back``), so that its move finds their
    gradients in ``p.grad``. A scaler's hook on a parameter its scaled graph met is a claim (G's loss runs
    through D): the scaler whose optimizer steps the parameter steers it."""
    for param in params:
        for other in others(param, None, live=False):
            other.give_back(param)


def _fits(out: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        type(out) is torch.Tensor
        and out.dtype == torch.float32
        and out.shape == grad.shape
        and out.device == grad.device
        and out.is_contiguous()
    )
