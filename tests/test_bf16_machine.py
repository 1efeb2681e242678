"""``gradscaler.with_master_weights(optimizer)`` as a state machine: a bfloat16 model that no scaler steps, every
operation of a loop in any order, against the recipe by hand (issue 45).

``HeldMachine`` (Hypothesis's ``RuleBasedStateMachine``) drives ``masters_net.Net`` cast to bfloat16 (its LayerNorm
stays float32) twice: ours, the user's optimizer given masters by the one line; the recipe, float32 copies of the
bfloat16 parameters in an optimizer of the copies (the float32 LayerNorm stepped as it is), each backward's
gradient added into the copy's ``.grad`` in float32 (``copy.grad = p.grad.float()``, or ``copy.grad +
p.grad.float()``), ``p.grad = None``, clipping over the copies, each copy written into its parameter after every
step; ``model.zero_grad()`` clears the copies' gradients too (the gradients the loop means, as the HF Trainer
calls it), and a loop that clears nothing adds up across steps, as autograd does.
Rules: a backward (with or without the ``block`` layer, so a parameter without a gradient), torch's
``clip_grad_norm_`` and ``clip_grad_value_`` over ``model.parameters()``, ``step``, ``optimizer.zero_grad`` and
``model.zero_grad`` both ways, freezing and unfreezing a layer (gradual unfreezing: frozen from the start too),
``add_param_group`` of the ``extra`` layer, and a checkpoint saved at any point and resumed in a new process (the
model's state loaded first or the optimizer's first; in the middle of an accumulation neither side's checkpoint
holds the partial sum). After every rule the invariant compares bit for bit: each parameter, each master against
its copy (values and gradients), each parameter's ``.grad`` (None on our side for every bfloat16 one), and the
optimizers' state by position.

``derandomize=True`` with CI's budget: the same 150 sequences of up to 30 rules every run.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import gradscaler
from gradscaler.masters.checks import HELD_ATTR, PARAM_ATTR
from masters_net import Net, batch

LAYERS = ("inp", "block", "head")


def _bf16_net(seed: int) -> Net:
    net = Net(seed)
    for name in (*LAYERS, "extra"):
        getattr(net, name).to(torch.bfloat16)
    return net


def _loss(net: Net, number: int, use_block: bool) -> torch.Tensor:
    x, y = batch(number)
    return ((net(x, use_block) - y) ** 2).mean()


def _params(net: Net, extra: bool) -> list[torch.nn.Parameter]:
    return net.base_params() + (list(net.extra.parameters()) if extra else [])


class Recipe:
    """The recipe by hand over its own copy of the model."""

    def __init__(self, net: Net, lr: float) -> None:
        self.net = net
        self.copies: dict[int, torch.Tensor] = {}
        self.optimizer = torch.optim.AdamW(self._stepped(net.base_params()), lr=lr)

    def _stepped(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        out = []
        for p in params:
            if p.dtype == torch.bfloat16:
                self.copies[id(p)] = p.detach().float().clone().requires_grad_()
                out.append(self.copies[id(p)])
            else:
                out.append(p)
        return out

    def add_extra(self) -> None:
        self.optimizer.add_param_group({"params": self._stepped(list(self.net.extra.parameters()))})

    def backward(self, number: int, use_block: bool) -> None:
        _loss(self.net, number, use_block).backward()
        for p in self.net.parameters():
            copy = self.copies.get(id(p))
            if copy is not None and p.grad is not None:
                copy.grad = p.grad.float() if copy.grad is None else copy.grad + p.grad.float()
                p.grad = None

    def stepped(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool, model: bool = False) -> None:
        """The optimizer's ``zero_grad``, or the model's (``model``), which clears the copies' gradients too: the
        loop means the parameters' gradients, which the copies hold (the HF Trainer's ``model.zero_grad()``)."""
        if model:
            self.net.zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for p in self.net.parameters():
                if id(p) in self.copies:
                    p.copy_(self.copies[id(p)])

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        return self.copies.get(id(p), p)


def _ours_master(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    for group in optimizer.param_groups:
        for m in group["params"]:
            if m is p or getattr(m, PARAM_ATTR, None) is p:
                return m
    raise AssertionError("a parameter of the optimizer has no master on our side")


def _same_outcome(mine: Any, theirs: Any) -> None:
    """Run both; either both raise the same error (torch's clipping over no gradient at all) or neither does."""
    errors = []
    for call in (mine, theirs):
        try:
            call()
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error))
    assert errors[0] == errors[1], errors


def _next_value(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> torch.Tensor:
    """The value ``master`` steps from: a master loaded with the optimizer's checkpoint before the model's waits
    for the model's load (``Pair.pending``) and is taken at the next step's pre-hook."""
    binding = vars(optimizer)[HELD_ATTR].masters._bindings.get(optimizer)
    pair = None if binding is None else binding.by_master.get(id(master))
    if pair is not None and pair.pending is not None and pair.written():
        return pair.pending
    return master


class HeldMachine(RuleBasedStateMachine):
    @initialize(lr=st.sampled_from([1e-2, 1e-3]), frozen=st.sampled_from([(), ("block",)]))
    def start(self, lr: float, frozen: tuple[str, ...]) -> None:
        self.lr = lr
        self.extra = False
        self.mine = _bf16_net(0)
        self.theirs = _bf16_net(0)
        self.frozen = set(frozen)
        self._freeze_both()
        self.optimizer = gradscaler.with_master_weights(torch.optim.AdamW(self.mine.base_params(), lr=lr))
        self.recipe = Recipe(self.theirs, lr)

    def _freeze_both(self) -> None:
        for net in (self.mine, self.theirs):
            for name in LAYERS:
                for p in getattr(net, name).parameters():
                    p.requires_grad_(name not in self.frozen)

    @rule(number=st.integers(0, 5), use_block=st.booleans())
    def backward(self, number: int, use_block: bool) -> None:
        _loss(self.mine, number, use_block).backward()
        self.recipe.backward(number, use_block)

    @rule(max_norm=st.sampled_from([1e-3, 0.1, 100.0]), norm_type=st.sampled_from([2.0, float("inf")]))
    def clip_norm(self, max_norm: float, norm_type: float) -> None:
        mine = torch.nn.utils.clip_grad_norm_(self.mine.parameters(), max_norm, norm_type=norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(self.recipe.stepped(), max_norm, norm_type=norm_type)
        assert torch.equal(mine, theirs), (mine, theirs)

    @rule(value=st.sampled_from([1e-3, 1.0]))
    def clip_value(self, value: float) -> None:
        _same_outcome(
            lambda: torch.nn.utils.clip_grad_value_(self.mine.parameters(), value),
            lambda: torch.nn.utils.clip_grad_value_(self.recipe.stepped(), value),
        )

    @rule()
    def step(self) -> None:
        self.optimizer.step()
        self.recipe.step()

    @rule(set_to_none=st.booleans(), model=st.booleans())
    def zero_grad(self, set_to_none: bool, model: bool) -> None:
        if model:  # the model's: ours reaches the masters' sums (``Module.zero_grad``), the recipe clears its copies'
            self.mine.zero_grad(set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none)
        self.recipe.zero_grad(set_to_none, model)

    @rule(layer=st.sampled_from(LAYERS))
    def toggle_freeze(self, layer: str) -> None:
        self.frozen ^= {layer}
        self._freeze_both()

    @precondition(lambda self: not self.extra)
    @rule()
    def add_extra(self) -> None:
        self.extra = True
        for net in (self.mine, self.theirs):
            net.use_extra = True
        self.optimizer.add_param_group({"params": list(self.mine.extra.parameters())})
        self.recipe.add_extra()

    @rule(model_first=st.booleans())
    def save_and_resume(self, model_first: bool) -> None:
        buffer = io.BytesIO()
        torch.save({"model": self.mine.state_dict(), "optimizer": self.optimizer.state_dict()}, buffer)
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        mine = _bf16_net(1)  # a new process: other initial values, the loop's own setup again
        mine.use_extra = self.extra
        self.mine = mine
        self._freeze_both_mine()
        optimizer = gradscaler.with_master_weights(torch.optim.AdamW(mine.base_params(), lr=self.lr))
        if self.extra:
            optimizer.add_param_group({"params": list(mine.extra.parameters())})
        self.optimizer = optimizer
        if model_first:
            mine.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        else:
            optimizer.load_state_dict(saved["optimizer"])
            mine.load_state_dict(saved["model"])
        self._resume_recipe()

    def _freeze_both_mine(self) -> None:
        for name in LAYERS:
            for p in getattr(self.mine, name).parameters():
                p.requires_grad_(name not in self.frozen)

    def _resume_recipe(self) -> None:
        """The recipe's checkpoint holds its copies and its optimizer's state; no gradient."""
        recipe = self.recipe
        state = recipe.optimizer.state_dict()
        copies = {key: value.detach().clone() for key, value in recipe.copies.items()}
        for p in recipe.net.parameters():
            p.grad = None
        fresh = Recipe.__new__(Recipe)
        fresh.net, fresh.copies = recipe.net, {k: v.requires_grad_() for k, v in copies.items()}
        groups = [[fresh.master_of(p) for p in recipe.net.base_params()]]
        if self.extra:
            groups.append([fresh.master_of(p) for p in recipe.net.extra.parameters()])
        fresh.optimizer = torch.optim.AdamW([{"params": g} for g in groups], lr=self.lr)
        fresh.optimizer.load_state_dict(state)
        self.recipe = fresh

    @invariant()
    def same(self) -> None:
        mine, theirs = list(_params(self.mine, True)), list(_params(self.theirs, True))
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad)
        for a, b in zip(_params(self.mine, self.extra), _params(self.theirs, self.extra), strict=True):
            ours, recipe = _ours_master(self.optimizer, a), self.recipe.master_of(b)
            assert torch.equal(_next_value(self.optimizer, ours), recipe)
            assert (ours.grad is None) == (recipe.grad is None), (ours.grad, recipe.grad)
            if ours.grad is not None:
                assert torch.equal(ours.grad, recipe.grad)
        mine_state = self.optimizer.state_dict()["state"]
        theirs_state = self.recipe.optimizer.state_dict()["state"]
        assert mine_state.keys() == theirs_state.keys()
        for key, entry in mine_state.items():
            for name, value in entry.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs_state[key][name])), (key, name)


def _settings() -> Any:
    return settings(
        max_examples=150,
        stateful_step_count=30,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class TestHeldMachine(HeldMachine.TestCase):  # type: ignore[misc,name-defined]
    settings = _settings()

    def setUp(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def tearDown(self) -> None:
        torch.set_num_threads(self.threads)
