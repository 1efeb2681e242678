"""master_weights=True: float16 parameters trained through float32 masters, bit for bit the recipe by hand.

The reference is the recipe done by hand with torch's own scaler: an optimizer over float32 copies of
the float16 parameters (and the float32 ones as they are), ``master.grad = param.grad.float()`` after
backward, ``torch.amp.GradScaler.step`` on that optimizer, then ``param.copy_(master)``.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.masters import SAVED_KEY, torch_clip_grad_norm_

STEPS = 20
INIT_SCALE = 2.0**24  # float16 gradients overflow for the first steps


class HalfNet(nn.Module):
    """float16 linear layers around a LayerNorm kept in float32, and a frozen float16 embedding-like table."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(16, 32).half()
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4).half()
        self.frozen = nn.Parameter(torch.randn(16).half(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x + self.frozen)
        h = self.norm(h.float()).half()
        return self.fc2(torch.relu(h))


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g).half(), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y) ** 2).mean()


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd_momentum_forloop": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adagrad_foreach": lambda p: torch.optim.Adagrad(p, lr=0.05, foreach=True),
}


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bits_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype, (what, i)
        assert torch.equal(
            x.view(-1).view(torch.int16 if x.element_size() == 2 else torch.int32),
            y.view(-1).view(torch.int16 if y.element_size() == 2 else torch.int32),
        ), (what, i)


def states_by_position(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in optimizer.state.get(p, {}).items()}
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def by_hand(name: str, steps: int = STEPS, clip: float | None = None, scaler_clips: bool = False) -> dict[str, Any]:
    """The recipe by hand with torch.amp.GradScaler: the reference. ``scaler_clips``: with gradscaler's
    default scaler and its ``clip_grad_norm_`` on the masters' optimizer (torch's scaler has none)."""
    model = HalfNet()
    pairs = [
        (p, p.detach().float().requires_grad_())
        for p in model.parameters()
        if p.requires_grad and p.dtype == torch.float16
    ]
    master_of = {id(p): m for p, m in pairs}
    opt = OPTIMIZERS[name]([master_of.get(id(p), p) for p in model.parameters() if p.requires_grad])
    scaler = (GradScaler if scaler_clips else torch.amp.GradScaler)("cpu", init_scale=INIT_SCALE, growth_interval=3)
    trace: dict[str, Any] = {"scales": [], "params": [], "skipped": []}
    for x, y in batches(steps):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        for p, m in pairs:
            m.grad = p.grad.float()
            p.grad = None
        if clip is not None and scaler_clips:
            scaler.clip_grad_norm_(opt, clip)
        elif clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < before
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
        trace["scales"].append(scaler.get_scale())
        trace["skipped"].append(skipped)
        trace["params"].append(snapshot(model))
    trace["state"] = states_by_position(opt)
    return trace


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: GradScaler,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    trace: dict[str, Any],
    clip: float | None = None,
    clip_after_unscale: str | None = None,
) -> dict[str, Any]:
    """Train on ``data``, appending to ``trace``; ``clip`` through ``scaler.clip_grad_norm_``, or
    ``scaler.unscale_`` + torch's clipping of the ``"optimizer"``'s or the ``"model"``'s parameters."""
    for x, y in data:
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if clip is not None and clip_after_unscale:
            scaler.unscale_(opt)
            owner = model if clip_after_unscale == "model" else None
            params = owner.parameters() if owner else [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip)
        elif clip is not None:
            scaler.clip_grad_norm_(opt, clip)
        scaler.step(opt)
        scaler.update()
        trace["scales"].append(scaler.get_scale())
        trace["skipped"].append(scaler.last_step_skipped())
        trace["params"].append(snapshot(model))
    trace["state"] = states_by_position(opt)
    return trace


def fresh(name: str) -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    model = HalfNet()
    opt = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
    return model, opt, GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3, master_weights=True)


def ours(name: str, steps: int = STEPS, clip: float | None = None) -> dict[str, Any]:
    model, opt, scaler = fresh(name)
    return train(model, opt, scaler, batches(steps), {"scales": [], "params": [], "skipped": []}, clip)


def assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["scales"] == b["scales"]
    assert a["skipped"] == b["skipped"]
    for step, (pa, pb) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert_bits_equal(pa, pb, f"parameters after step {step}")
    assert len(a["state"]) == len(b["state"])
    for sa, sb in zip(a["state"], b["state"], strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, key
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_the_recipe_by_hand_with_torchs_scaler(name: str) -> None:
    reference = by_hand(name)
    assert reference["skipped"][:3] == [True, True, True], "the test must start with overflowing steps"
    assert not all(reference["skipped"]), "and then step"
    assert_same_run(ours(name), reference)


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum_forloop"])
def test_unscale_then_clipping_the_optimizers_parameters_equals_the_recipe_by_hand(name: str) -> None:
    reference = by_hand(name, clip=0.5)
    model, opt, scaler = fresh(name)
    trace = train(model, opt, scaler, batches(), {"scales": [], "params": [], "skipped": []}, 0.5, "optimizer")
    assert_same_run(trace, reference)


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum_forloop", "adamw_fused"])
def test_skipped_steps_leave_parameters_masters_and_state_untouched(name: str) -> None:
    model, opt, scaler = fresh(name)
    data = batches(14)
    train(model, opt, scaler, data[:12], {"scales": [], "params": [], "skipped": []})
    params = snapshot(model)
    masters = [m.detach().clone() for _, m in scaler.master_weights(opt)]
    state = states_by_position(opt)
    x, y = data[12]
    opt.zero_grad()
    scaler.scale(loss_of(model, x, y)).backward()
    model.fc1.weight.grad.view(-1)[3] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped()
    assert_bits_equal(snapshot(model), params, "parameters")
    assert_bits_equal([m for _, m in scaler.master_weights(opt)], masters, "masters")
    for a, b in zip(states_by_position(opt), state, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(p.grad is None for p, _ in scaler.master_weights(opt)), "float16 gradients must not accumulate"


def test_masters_replace_the_float16_parameters_in_the_optimizer_only() -> None:
    model, opt, scaler = fresh("adamw_foreach")
    train(model, opt, scaler, batches(1), {"scales": [], "params": [], "skipped": []})
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [p.dtype for p in params] == [torch.float32] * 6
    assert params[2] is model.norm.weight and params[3] is model.norm.bias  # float32 ones stay themselves
    lows = [low for low, _ in scaler.master_weights(opt)]
    assert lows == [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias]
    assert all(p.dtype == torch.float16 for p in lows) and model.norm.weight.dtype == torch.float32


def test_default_scaler_keeps_torchs_error_first_sentence() -> None:
    model = HalfNet()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = GradScaler("cpu")
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\. ") as caught:
        scaler.step(opt)
    assert "master_weights=True" in str(caught.value)
    assert "fused" not in str(caught.value)


# Checkpoints ----------------------------------------------------------------------------------------


def save_three(model: nn.Module, opt: torch.optim.Optimizer, scaler: GradScaler) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}, buffer)
    return buffer.getvalue()


def load_three(blob: bytes, name: str) -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    """The hand-written resume: build model, optimizer, scaler; load the three dicts."""
    model, opt, scaler = fresh(name)
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    return model, opt, scaler


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_at_step_11_through_the_three_state_dicts_equals_the_uninterrupted_run(name: str) -> None:
    reference = by_hand(name)
    model, opt, scaler = fresh(name)
    data = batches()
    trace = train(model, opt, scaler, data[:11], {"scales": [], "params": [], "skipped": []})
    blob = save_three(model, opt, scaler)
    del model, opt, scaler
    model, opt, scaler = load_three(blob, name)
    assert_same_run(train(model, opt, scaler, data[11:], trace), reference)


def test_a_checkpoint_stores_the_masters_state_once_and_in_float32() -> None:
    model, opt, scaler = fresh("adamw_foreach")
    train(model, opt, scaler, batches(12), {"scales": [], "params": [], "skipped": []})
    saved = opt.state_dict()
    extra = saved["param_groups"][0][SAVED_KEY]
    assert sorted(extra["masters"]) == [0, 1, 4, 5]  # the float16 positions (fc1, fc2); LayerNorm is 2 and 3
    assert all(t.dtype == torch.float32 for t in extra["masters"].values())
    for position, state in extra["state"].items():
        assert state is saved["state"][saved["param_groups"][0]["params"][position]]
    assert SAVED_KEY not in opt.param_groups[0]
    loaded = torch.load(io.BytesIO(save_three(model, opt, scaler)), weights_only=True)["optimizer"]
    group = loaded["param_groups"][0]
    for position, state in group[SAVED_KEY]["state"].items():  # one storage in the file, not two
        assert state["exp_avg"].data_ptr() == loaded["state"][group["params"][position]]["exp_avg"].data_ptr()


def test_resume_before_the_first_contact_loads_into_float16_parameters_exactly() -> None:
    """torch casts a loaded state to the dtype of the parameters it is loaded into; the masters undo it."""
    model, opt, scaler = fresh("adamw_foreach")
    train(model, opt, scaler, batches(12), {"scales": [], "params": [], "skipped": []})
    expected = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    model2, opt2, scaler2 = load_three(save_three(model, opt, scaler), "adamw_foreach")
    assert opt2.state[model2.fc1.weight]["exp_avg"].dtype == torch.float16  # what torch did
    x, y = batches(1)[0]
    scaler2.scale(loss_of(model2, x, y)).backward()
    scaler2.unscale_(opt2)
    master = opt2.param_groups[0]["params"][0]
    assert all(torch.equal(opt2.state[master][k], v) for k, v in expected.items())
    assert SAVED_KEY not in opt2.param_groups[0]


def test_loading_a_checkpoint_into_a_bound_optimizer_restores_the_masters() -> None:
    model, opt, scaler = fresh("sgd_momentum_forloop")
    data = batches()
    train(model, opt, scaler, data[:11], {"scales": [], "params": [], "skipped": []})
    blob = save_three(model, opt, scaler)
    after_11 = snapshot(model)
    train(model, opt, scaler, data[11:15], {"scales": [], "params": [], "skipped": []})
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    opt.load_state_dict(saved["optimizer"])  # the optimizer first: the model load then writes the same values
    model.load_state_dict(saved["model"])
    scaler.load_state_dict(saved["scaler"])
    assert_bits_equal(snapshot(model), after_11, "parameters")
    trace = train(model, opt, scaler, data[11:], {"scales": [], "params": [], "skipped": []})
    reference = by_hand("sgd_momentum_forloop")
    for step, params in enumerate(trace["params"], 11):
        assert_bits_equal(params, reference["params"][step], f"parameters after step {step}")


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum_forloop", "adamw_fused"])
def test_scaler_clip_grad_norm_clips_the_masters_gradients_as_the_recipe_by_hand(name: str) -> None:
    assert_same_run(ours(name, clip=0.5), by_hand(name, clip=0.5, scaler_clips=True))


# Errors -----------------------------------------------------------------------------------------------


def one_backward(model: nn.Module, scaler: GradScaler) -> None:
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum_forloop"])
def test_torchs_clipping_of_model_parameters_after_unscale_reaches_the_masters(name: str) -> None:
    """torch's recipe (``unscale_`` then ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``),
    unpatched: the model's float16 gradients are in the masters, and the clipping reaches them there."""
    model, opt, scaler = fresh(name)
    trace = train(model, opt, scaler, batches(), {"scales": [], "params": [], "skipped": []}, 0.5, "model")
    assert_same_run(trace, by_hand(name, clip=0.5))


def test_after_unscale_the_model_gradients_show_unscaled_values_until_step() -> None:
    """Not still multiplied by the scale: a per-layer norm logger over ``model.parameters()`` reads the
    unscaled gradients (rounded to float16); ``step`` drops them, as the recipe by hand does at its move."""
    model, opt, _ = fresh("adamw_foreach")
    scaler = GradScaler("cpu", init_scale=4096.0, master_weights=True)
    one_backward(model, scaler)
    scaler.unscale_(opt)
    for low, master in scaler.master_weights(opt):
        assert master.grad is not None and low.grad is not None
        assert torch.equal(low.grad, master.grad.half())
    scaler.step(opt)
    assert model.fc1.weight.grad is None and model.norm.weight.grad is not None


@pytest.mark.parametrize("how", ["clip_grad_value_module", "bound_before", "clip_grad_module"])
def test_other_writes_to_model_gradients_after_unscale_are_refused_with_the_fix(how: str) -> None:
    """What would be silently lost is refused: a write the optimizer's step would not see."""
    model, opt, _ = fresh("adamw_foreach")
    scaler = GradScaler("cpu", init_scale=1.0, master_weights=True)  # a step that would apply
    one_backward(model, scaler)
    before = snapshot(model)
    scaler.unscale_(opt)
    if how == "clip_grad_value_module":  # torch.nn.utils.clip_grad_value_ is routed; this spelling is not
        torch.nn.utils.clip_grad.clip_grad_value_(model.parameters(), 1e-4)
    elif how == "bound_before":  # torch's own function, bound before the scaler routed it
        torch_clip_grad_norm_(model.parameters(), 1e-4)
    else:
        torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), 1e-4)
    with pytest.raises(ValueError, match=r"^Call scaler\.clip_grad_norm_.*written after scaler\.unscale_") as caught:
        scaler.step(opt)
    assert "optimizer.param_groups[0]['params'][0] (shape (32, 16), torch.float16)" in str(caught.value)
    assert_bits_equal(snapshot(model), before, "parameters")


def test_patch_torch_master_weights_clips_model_parameters_through_the_masters() -> None:
    import gradscaler

    with gradscaler.patch_torch(master_weights=True):
        model = HalfNet()
        opt = OPTIMIZERS["adamw_foreach"]([p for p in model.parameters() if p.requires_grad])
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)
        trace = train(model, opt, scaler, batches(), {"scales": [], "params": [], "skipped": []}, 0.5, "model")
    assert isinstance(scaler, GradScaler)
    assert torch.nn.utils.clip_grad_norm_ is gradscaler.masters.torch_clip_grad_norm_
    assert torch.nn.utils.clip_grad_value_ is gradscaler.masters.torch_clip_grad_value_
    assert_same_run(trace, by_hand("adamw_foreach", clip=0.5))


def test_patch_torch_with_other_master_weights_is_refused() -> None:
    import gradscaler

    with gradscaler.patch_torch(), pytest.raises(ValueError, match=r"unpatch_torch\(\) first"):
        gradscaler.patch_torch(master_weights=True)


@pytest.mark.parametrize("where", ["meta", "sparse"])
def test_a_parameter_without_buildable_master_is_named(where: str) -> None:
    model = HalfNet()
    if where == "meta":
        odd = nn.Parameter(torch.empty(3, 5, dtype=torch.float16, device="meta"))
    else:
        odd = nn.Parameter(torch.eye(3, 5, dtype=torch.float16).to_sparse())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad] + [odd], lr=0.1)
    scaler = GradScaler("cpu", master_weights=True)
    one_backward(model, scaler)
    message = r"optimizer\.param_groups\[0\]\['params'\]\[6\] \(shape \(3, 5\), torch\.float16\)"
    with pytest.raises(ValueError, match=message) as caught:
        scaler.step(opt)
    assert ("to_empty()" if where == "meta" else "sparse_coo") in str(caught.value)
    assert opt.param_groups[0]["params"][0] is model.fc1.weight, "nothing changed before the refusal"


def test_an_optimizer_holding_a_parameter_twice_is_refused() -> None:
    model = HalfNet()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = torch.optim.SGD([*params, model.fc2.bias], lr=0.1)
    scaler = GradScaler("cpu", master_weights=True)
    one_backward(model, scaler)
    with pytest.raises(ValueError, match=r"holds one parameter twice, as .*\['params'\]\[5\].* and as .*\[6\]"):
        scaler.step(opt)


def test_a_parameter_in_two_optimizers_of_one_scaler_is_refused() -> None:
    model = HalfNet()
    a = torch.optim.SGD([model.fc1.weight], lr=0.1)
    b = torch.optim.SGD([model.fc1.weight, model.fc2.weight], lr=0.1)
    scaler = GradScaler("cpu", master_weights=True)
    one_backward(model, scaler)
    scaler.unscale_(a)
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] .* already has a float32 master in another optimizer"):
        scaler.unscale_(b)


def test_disabled_scaler_with_master_weights_refuses_float16_and_steps_float32() -> None:
    model = HalfNet()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = GradScaler("cpu", enabled=False, master_weights=True)
    one_backward(model, scaler)
    with pytest.raises(
        ValueError,
        match=r"^Enable the scaler \(enabled=True\) to train .*\['params'\]\[0\].*enabled=False\) does not scale",
    ):
        scaler.step(opt)
    full = nn.Linear(4, 4)
    opt32 = torch.optim.SGD(full.parameters(), lr=0.1)
    full(torch.ones(2, 4)).sum().backward()
    before = full.weight.detach().clone()
    scaler.step(opt32)
    assert not torch.equal(full.weight, before)


def test_new_float16_parameters_added_later_get_masters() -> None:
    model, opt, scaler = fresh("adamw_foreach")
    extra = nn.Parameter(torch.ones(4, dtype=torch.float16))
    train(model, opt, scaler, batches(12), {"scales": [], "params": [], "skipped": []})
    opt.add_param_group({"params": [extra], "lr": 0.5})
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y) + (extra.float() ** 2).sum() * 1e-3).backward()
    scaler.step(opt)
    scaler.update()
    master = opt.param_groups[1]["params"][0]
    assert master.dtype == torch.float32 and master is not extra
    assert torch.equal(extra, master.half()) and not torch.equal(extra, torch.ones(4, dtype=torch.float16))


def test_a_model_load_after_binding_is_taken_by_the_masters() -> None:
    model, opt, scaler = fresh("sgd_momentum_forloop")
    train(model, opt, scaler, batches(12), {"scales": [], "params": [], "skipped": []})
    new = HalfNet(seed=5)
    model.load_state_dict(new.state_dict())
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.unscale_(opt)
    for low, master in scaler.master_weights(opt):
        assert torch.equal(master.half(), low)


@pytest.mark.parametrize("copy_by", ["as_is", "deepcopy", "pickle", "named_after_binding"])
def test_reports_name_a_master_by_its_model_parameter(copy_by: str) -> None:
    """The optimizer steps the masters, but ``nonfinite_parameters`` and ``last_grad_norms`` give the
    names ``name_parameters(model)`` gave the float16 parameters (before or after the masters bind)."""
    model, opt, scaler = fresh("adamw_foreach")
    x, y = batches(1)[0]
    if copy_by != "named_after_binding":
        scaler.name_parameters(model)
    if copy_by == "deepcopy":
        scaler = copy.deepcopy(scaler)
    elif copy_by == "pickle":
        scaler = pickle.loads(pickle.dumps(scaler))
        scaler.name_parameters(model)  # names are per process: a pickle drops them
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.clip_grad_norm_(opt, 1.0)  # binds the masters
    if copy_by == "named_after_binding":
        scaler.name_parameters(model)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert sorted(scaler.last_grad_norms()) == sorted(trainable)
    scaler.step(opt)
    scaler.update()
    overflowed = scaler.nonfinite_parameters()  # INIT_SCALE overflows the first step
    assert overflowed and set(overflowed) <= set(trainable), overflowed
