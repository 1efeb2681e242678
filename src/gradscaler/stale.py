"""Telling a retried step from a new iteration when an unscaled optimizer was never stepped.

``unscale_`` (or ``clip_grad_norm_``) leaves an optimizer's gradients unscaled and its record says so
until ``update()``. If the iteration is interrupted before ``step`` (an exception in the user's
clipping or logging, a KeyboardInterrupt, an exception inside ``optimizer.step``) and the loop goes on
with ``zero_grad`` and a new ``scale(loss).backward()``, the record describes gradients that no longer
exist: the new ones are still multiplied by the scale. torch steps them as they are.

The signal is ``scale()`` itself, called once per iteration: only when it finds a record that is
unscaled and not stepped (the interrupted case; normal loops never do) does the scaler take a
``GradSnapshot`` of that optimizer's gradients. At its next ``unscale_``, ``clip_grad_norm_`` or
``step``, gradients that are other objects (``zero_grad(set_to_none=True)``) or whose version counter
moved (an in-place ``zero_grad`` and a backward) mean a new backward: the record is stale and the
optimizer starts the iteration afresh. Unchanged gradients mean a retry of the same iteration (or a
backward that wrote only other optimizers' gradients): the record stands, and the gradients are
stepped exactly as they are. Version counters alone would not do: ``torch.nn.utils.clip_grad_norm_``
after ``unscale_`` moves them in the standard recipe, with no ``scale()`` in between.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch


class GradSnapshot:
    """Which gradient tensor each parameter holds, and its version counter, at one moment.

    Holds weak references only: a snapshot never keeps a gradient (or a parameter) alive.
    """

    __slots__ = ("_refs", "_versions")

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        self._refs = [None if g is None else weakref.ref(g) for g in grads]
        self._versions = [None if g is None else g._version for g in grads]

    def changed(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether any parameter of ``params`` now holds another gradient, or one written since."""
        if len(params) != len(self._refs):
            return True
        for param, ref, version in zip(params, self._refs, self._versions, strict=True):
            grad = param.grad
            if grad is None or ref is None:
                if grad is not None or ref is not None:
                    return True
            elif ref() is not grad or grad._version != version:
                return True
        return False
