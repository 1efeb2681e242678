"""A Hypothesis state machine of several scalers and optimizers over one float16 model with master weights,
ours against the recipe by hand (tests/gan_recipe.py), bit for bit after every rule, from the first iteration on.

The model is a GAN: G's loss runs through D. The machine draws whether one scaler steers both networks or
each has its own, and whether each sums in float32; then, in any order, either network's ``zero_grad`` (to
None or zeros), backwards of either loss (so different micro-batch counts per optimizer), steps, updates, and
a scaler switched for a new one (the old one's state loaded, float32 sums turned on or off, the old one kept
or dropped). tests/masters_machine.py drives one scaler over one optimizer from its second iteration on.

Kept out, because docs/migration.md documents them as limits: a backward that reaches a network whose scaler
sums in float32 before that scaler (or another one in its first iteration) hooked its parameters (its first
gradients sum in float16: "a float16 parameter first met after that"), and a switch with gradients pending.
The bookkeeping that tells them is the documented rule, not our scaler's state (``owner``): the scaler whose
hook holds a network's parameters, if any.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gan_recipe import REACHES, SIDES, Ours, Recipe


def outcome(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except Exception as error:  # the same error on both sides is the same outcome
        return f"{type(error).__name__}: {error}"
    return None


class ScalersMachine(RuleBasedStateMachine):
    ended: Callable[[], None] | None = None  # called after every sequence (progress in CI)

    def teardown(self) -> None:
        if ScalersMachine.ended is not None:
            ScalersMachine.ended()

    @initialize(shared=st.booleans(), g=st.booleans(), d=st.booleans())
    def start(self, shared: bool, g: bool, d: bool) -> None:
        """One scaler for both networks (float32 sums: ``g``), or one each (``g``, ``d``)."""
        accumulate = {"G": g, "D": g if shared else d}
        self.ours, self.reference = Ours(accumulate, shared), Recipe(accumulate, shared)
        self.kept: list[Any] = []  # scalers switched out and kept alive
        self.ids = itertools.count()
        first = next(self.ids)
        self.scaler = {"G": first, "D": first if shared else next(self.ids)}  # each side's scaler, by number
        self.watching = set(self.scaler.values())  # scalers in their first iteration (before an update)
        self.alive = set(self.scaler.values())  # scalers whose hooks work (kept or in use)
        self.owner: dict[str, int | None] = dict.fromkeys(SIDES)  # the scaler whose float32 hooks hold a side
        self.bound: dict[str, int | None] = dict.fromkeys(SIDES)  # the scaler that bound a side's optimizer
        self.grads = dict.fromkeys(SIDES, False)  # a gradient reached the side since its last zero_grad or step
        self.stepped: dict[int, set[str]] = {}  # per scaler: the sides it stepped since its last update
        self.scaled: set[int] = set()  # scalers that scaled a loss (torch's has no scale before its first)
        self.number = 0

    def both(self, name: str, *args: Any) -> None:
        mine = outcome(lambda: getattr(self.ours, name)(*args))
        theirs = outcome(lambda: getattr(self.reference, name)(*args))
        assert mine == theirs, f"{name}{args}: ours {mine!r}, the recipe {theirs!r}"
        assert mine is None, mine

    def sums(self, side: str) -> bool:
        return self.ours.accumulate[side]

    # the model's bookkeeping (the documented rule) -------------------------------------------------------------

    def hooks_after_scale(self, side: str) -> dict[str, int | None]:
        """``owner`` after ``scale()`` of ``side``'s loss: a scaler with float32 sums in its first iteration hooks
        the parameters its graph reaches that no live scaler holds."""
        owner = {s: (o if o in self.alive else None) for s, o in self.owner.items()}
        scaler = self.scaler[side]
        if self.sums(side) and scaler in self.watching:
            for reached in REACHES[side]:
                if owner[reached] is None:
                    owner[reached] = scaler
        return owner

    def reachable(self, side: str) -> bool:
        """A backward of ``side``'s loss stays inside the documented rule: every network it reaches whose scaler
        sums in float32 is held by a float32 hook by then."""
        owner = self.hooks_after_scale(side)
        return all(owner[s] is not None or not self.sums(s) for s in REACHES[side])

    # rules -----------------------------------------------------------------------------------------------------

    @rule(side=st.sampled_from(SIDES), set_to_none=st.booleans())
    def zero_grad(self, side: str, set_to_none: bool) -> None:
        self.both("zero_grad", side, set_to_none)
        self.grads[side] = False

    @rule(side=st.sampled_from(SIDES), count=st.sampled_from([1, 2, 4]))
    def backward(self, side: str, count: int) -> None:
        """One micro-batch of ``side``'s loss (divided by ``count``, the loop's micro-batch count)."""
        if not self.reachable(side):
            return  # a documented limit (the module's docstring)
        self.owner = self.hooks_after_scale(side)
        self.scaled.add(self.scaler[side])
        number, self.number = self.number, self.number + 1
        for system in (self.ours, self.reference):
            system.backward(side, system.loss(side, number, 0, count))
        for reached in REACHES[side]:
            self.grads[reached] = True

    @precondition(lambda self: any(self.grads.values()))
    @rule(side=st.sampled_from(SIDES))
    def step(self, side: str) -> None:
        scaler = self.scaler[side]
        if not self.grads[side] or side in self.stepped.get(scaler, ()) or scaler not in self.scaled:
            return  # torch's scaler: nothing to check, stepped twice in one iteration, or no scale yet
        self.both("step", side)
        self.stepped.setdefault(scaler, set()).add(side)
        self.grads[side] = False
        self.bound[side] = scaler
        self.owner[side] = scaler if self.sums(side) else None  # taken over, or given up to a scaler without

    @precondition(lambda self: any(self.stepped.values()))
    @rule(side=st.sampled_from(SIDES))
    def update(self, side: str) -> None:
        scaler = self.scaler[side]
        if not self.stepped.get(scaler):
            return  # torch's scaler: no step to update from
        self.both("update", side)
        self.stepped[scaler] = set()
        if scaler in self.watching:  # the end of its first iteration: what it hooked and did not bind, given back
            self.watching.discard(scaler)
            for s in SIDES:
                if self.owner[s] == scaler and self.bound[s] != scaler:
                    self.owner[s] = None

    @rule(side=st.sampled_from(SIDES), accumulate=st.booleans(), kept=st.booleans())
    def switch(self, side: str, accumulate: bool, kept: bool) -> None:
        """A new scaler for ``side`` (both when shared) between its iterations, the old one's state loaded, the
        old one kept alive or dropped."""
        old = self.scaler[side]
        sides = [s for s in SIDES if self.scaler[s] == old]
        if self.stepped.get(old) or any(self.grads[s] for s in sides):
            return  # a documented limit: a switch with gradients pending
        # the sides a scaler with float32 sums bound and still holds, alive after this switch: the old one if kept,
        # or one kept at an earlier switch; its hooks go on summing until the new scaler binds them
        holders = self.alive if kept else self.alive - {old}
        held = [s for s in sides if self.sums(s) and self.owner[s] in holders and self.bound[s] == self.owner[s]]
        dropped = self.ours.switch(side, accumulate)
        self.reference.switch(side, accumulate, held)
        if kept:
            self.kept.append(dropped)
        else:
            self.alive.discard(old)
            del dropped
            gc.collect()
        new = next(self.ids)
        self.alive.add(new)
        self.watching.add(new)
        for s in sides:
            self.scaler[s] = new

    @invariant()
    def same_as_the_recipe(self) -> None:
        for index, (a, b) in enumerate(zip(self.ours.weights(), self.reference.weights(), strict=True)):
            assert torch.equal(a, b), f"parameter {index}: {(a.float() - b.float()).abs().max()}"
