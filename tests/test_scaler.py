"""GradScaler's public API against torch's: signatures, messages, state machine, state dict, pickling."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import gradscaler
from gradscaler import GradScaler, OptState


def setup(scaler_cls=GradScaler, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu", **kwargs)
    return model, opt, scaler


def backward(model: nn.Module, scaler) -> None:
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()


def snapshot(scaler) -> tuple:
    per_opt = {k: v["stage"] for k, v in scaler._per_optimizer_states.items()}
    return scaler.get_scale(), scaler._get_growth_tracker(), per_opt


def test_public_methods_match_torch_signatures() -> None:
    ecosystem = {
        "_lazy_init_scale_growth_tracker",
        "_check_inf_per_device",
        "_found_inf_per_device",
        "_get_scale_async",
        "__getstate__",
        "__setstate__",
    }
    for name, member in inspect.getmembers(torch.amp.GradScaler, inspect.isfunction):
        if name.startswith("_") and name not in ecosystem:
            continue
        ours = getattr(GradScaler, name, None)
        assert ours is not None, f"missing {name}"
        if not name.startswith("_"):
            theirs_params = list(inspect.signature(member).parameters)
            assert list(inspect.signature(ours).parameters)[: len(theirs_params)] == theirs_params, name
    positional = list(inspect.signature(GradScaler).parameters)[:6]
    assert positional == list(inspect.signature(torch.amp.GradScaler).parameters)


def test_all_public_names_exist_and_are_documented() -> None:
    assert gradscaler.__all__ == sorted(gradscaler.__all__)
    for name in gradscaler.__all__:
        if name == "OptState":  # torch's own enum (no docstring there), so code comparing stages works
            assert gradscaler.OptState is torch.amp.grad_scaler.OptState
            continue
        assert getattr(gradscaler, name).__doc__, name
    for name, member in inspect.getmembers(GradScaler):
        if not name.startswith("_") and callable(member):
            assert member.__doc__, f"GradScaler.{name} lacks a docstring"


@pytest.mark.parametrize("scaler_cls", [GradScaler, torch.amp.GradScaler], ids=["ours", "torch"])
@pytest.mark.parametrize(
    ("misuse", "error", "message"),
    [
        (
            "unscale_twice",
            RuntimeError,
            "unscale_() has already been called on this optimizer since the last update().",
        ),
        ("unscale_after_step", RuntimeError, "unscale_() is being called after step()."),
        ("step_twice", RuntimeError, "step() has already been called since the last update()."),
        ("closure_kwarg", RuntimeError, "Closure use is not currently supported if GradScaler is enabled."),
        (
            "step_before_scale",
            AssertionError,
            "Attempted step but _scale is None.  This may indicate your script did not use "
            "scaler.scale(loss or outputs) earlier in the iteration.",
        ),
        ("update_before_scale", AssertionError, "Attempted update but _scale is None."),
        ("unscale_before_scale", AssertionError, "Attempted unscale_ but _scale is None."),
        ("update_without_step", AssertionError, "No inf checks were recorded prior to update."),
        ("bad_outputs", ValueError, "outputs must be a Tensor or an iterable of Tensors"),
        ("new_scale_requires_grad", AssertionError, "new_scale should be a float or a 1-element"),
        (
            "empty_state_dict",
            RuntimeError,
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.",
        ),
    ],
)
def test_misuse_raises_torchs_error_and_changes_nothing(scaler_cls, misuse: str, error: type, message: str) -> None:
    model, opt, scaler = setup(scaler_cls)
    if not misuse.endswith("before_scale"):
        backward(model, scaler)
    if misuse in ("unscale_twice", "unscale_after_step", "step_twice"):
        (scaler.unscale_ if misuse == "unscale_twice" else scaler.step)(opt)
    before = snapshot(scaler) if scaler._scale is not None else None
    action = {
        "unscale_twice": lambda: scaler.unscale_(opt),
        "unscale_after_step": lambda: scaler.unscale_(opt),
        "step_twice": lambda: scaler.step(opt),
        "closure_kwarg": lambda: scaler.step(opt, closure=lambda: 0.0),
        "step_before_scale": lambda: scaler.step(opt),
        "update_before_scale": lambda: scaler.update(),
        "unscale_before_scale": lambda: scaler.unscale_(opt),
        "update_without_step": lambda: scaler.update(),
        "bad_outputs": lambda: scaler.scale([torch.ones(1), 3]),
        "new_scale_requires_grad": lambda: scaler.update(torch.ones(1, requires_grad=True)),
        "empty_state_dict": lambda: scaler.load_state_dict({}),
    }[misuse]
    with pytest.raises(error) as excinfo:
        action()
    assert str(excinfo.value).startswith(message)
    if before is not None:
        assert snapshot(scaler) == before


def test_positional_closure_is_refused() -> None:
    model, opt, scaler = setup()
    backward(model, scaler)
    weight = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, lambda: 0.0)
    assert torch.equal(model.weight, weight)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


def test_invalid_factors_raise_torchs_assertions() -> None:
    with pytest.raises(AssertionError, match=r"The growth factor must be > 1.0."):
        GradScaler("cpu", growth_factor=1.0)
    with pytest.raises(AssertionError, match=r"The backoff factor must be < 1.0."):
        GradScaler("cpu", backoff_factor=1.0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_init_scale_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(ValueError, match=f"init_scale must be a finite number > 0, got {value}"):
        GradScaler("cpu", init_scale=value)


def test_scale_preserves_structure() -> None:
    scaler = GradScaler("cpu", init_scale=4.0)
    a, b, c = torch.ones(2), torch.full((1,), 2.0), torch.tensor(3.0)
    out = scaler.scale([a, (b, [c])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert torch.equal(out[0], a * 4) and torch.equal(out[1][0], b * 4) and torch.equal(out[1][1][0], c * 4)
    lazy = scaler.scale(iter([a, b]))
    assert [t.tolist() for t in lazy] == [[4.0, 4.0], [8.0]]
    assert scaler._scale.device.type == "cpu" and scaler._scale.dtype == torch.float32


def test_update_accepts_float_int_and_tensor() -> None:
    model, _, scaler = setup()
    backward(model, scaler)
    scaler.update(1024)  # torch raises AttributeError on an int
    assert scaler.get_scale() == 1024.0
    scaler.update(512.0)
    assert scaler.get_scale() == 512.0
    scaler.update(torch.tensor([256.0]))
    assert scaler.get_scale() == 256.0
    for bad in (0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="new_scale must be a finite number > 0"):
            scaler.update(bad)
    assert scaler.get_scale() == 256.0


@pytest.mark.parametrize(
    "bad",
    [torch.tensor(1e300, dtype=torch.float64), 1e300, torch.tensor(3.5e38, dtype=torch.float64), 10**400],
    ids=["fp64-tensor-1e300", "float-1e300", "fp64-tensor-past-fp32-max", "int-past-fp64"],
)
def test_update_refuses_a_finite_value_no_float32_holds(bad: float | int | torch.Tensor) -> None:
    """Issue 25 item 5: torch's RuntimeError (OverflowError for the int) became a ValueError naming the value."""
    model, _, scaler = setup()
    backward(model, scaler)
    scaler.update(512.0)
    with pytest.raises(ValueError, match=r"new_scale must be a finite number > 0") as caught:
        scaler.update(bad)
    assert (repr(bad) if not isinstance(bad, int) else "1000000") in str(caught.value)
    assert scaler.get_scale() == 512.0


def test_getters_and_setters() -> None:
    scaler = GradScaler("cpu", 2.0**10, 3.0, 0.25, 7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 7)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(9)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.125, 9)
    assert scaler.get_scale() == 1024.0 and scaler.is_enabled()


def test_disabled_scaler_is_transparent() -> None:
    model, opt, scaler = setup(enabled=False)
    loss = model(torch.ones(1, 4)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model.weight)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    scaler.load_state_dict({})


def test_cuda_without_cuda_warns_and_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(
        UserWarning, match=r"^gradscaler.GradScaler\(device='cuda'\) is enabled, but CUDA is not available.  Disabling"
    ):
        scaler = GradScaler()
    assert not scaler.is_enabled()


NON_DEFAULT = {
    "scale": 512.0,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 17,
    "_growth_tracker": 5,
    "hysteresis": 3,
    "hysteresis_refill": "growth",
    "min_scale": 2.0,
    "max_scale": 2.0**20,
    "_hysteresis_tracker": 2,
    "steps": 99,
    "skipped_steps": 7,
    "consecutive_skips": 1,
    "growths": 4,
    "backoffs": 3,
    "collapse_run": 0,
}


@pytest.mark.parametrize("after_first_scale", [False, True])
def test_state_dict_round_trips_every_field(after_first_scale: bool) -> None:
    scaler = GradScaler("cpu")
    if after_first_scale:
        scaler.scale(torch.ones(1))
    scaler.load_state_dict(NON_DEFAULT)
    assert scaler.state_dict() == NON_DEFAULT
    fresh = GradScaler("cpu")
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.state_dict() == NON_DEFAULT
    assert fresh._rule.hysteresis_refill == "growth"


def test_state_dict_interoperates_with_torch(tmp_path) -> None:
    model, opt, theirs = setup(torch.amp.GradScaler, init_scale=256.0, growth_interval=3)
    backward(model, theirs)
    theirs.step(opt)
    theirs.update()
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert {k: ours.state_dict()[k] for k in theirs.state_dict()} == theirs.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == theirs.state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save({"scaler": ours.state_dict()}, path)
    assert torch.load(path, weights_only=True)["scaler"] == ours.state_dict()
    assert all(isinstance(v, (int, float, str)) for v in ours.state_dict().values())


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"scale": float("nan")}, ValueError, "state_dict['scale'] must be a finite number > 0, got nan"),
        ({"scale": float("inf")}, ValueError, "state_dict['scale'] must be a finite number > 0, got inf"),
        ({"scale": 0.0}, ValueError, "state_dict['scale'] must be a finite number > 0, got 0.0"),
        ({"scale": -4.0}, ValueError, "must be a finite number > 0, got -4.0"),
        ({"scale": 1e300}, ValueError, "state_dict['scale'] must be <= float32 max"),
        ({"_growth_tracker": -1}, ValueError, "state_dict['_growth_tracker'] must be an int in [0, 16], got"),
        ({"_growth_tracker": 2**31}, ValueError, "state_dict['_growth_tracker'] must be an int in [0, 16]"),
        ({"_growth_tracker": 17}, ValueError, "counts clean steps towards growth_interval (17)"),
        ({"_hysteresis_tracker": 1000}, ValueError, "state_dict['_hysteresis_tracker'] must be an int in [0, 3]"),
        ({"skipped_steps": 2**63}, ValueError, "state_dict['skipped_steps'] must be an int in [0, "),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int, got float 2.5"),
        ({"scale": "big"}, TypeError, "state_dict['scale'] must be a real number (int or float), got str 'big'"),
        ({"hysteresis_refill": "sometimes"}, ValueError, "invalid policy: hysteresis_refill must be one of"),
        ({"max_scale": 1e-40, "min_scale": 0.0}, ValueError, "max_scale must be >= 2**-126"),
        ({"min_scale": 1e300}, ValueError, "min_scale must be <= float32 max"),
        ({"bogus": 1}, ValueError, "Unknown keys in the scaler's state_dict: ['bogus']"),
        ({"backoff_factor": 1.5}, ValueError, "invalid policy"),
        ({"hysteresis": 0}, ValueError, "invalid policy"),
    ],
)
def test_load_state_dict_refuses_bad_values_and_changes_nothing(change: dict, error: type, message: str) -> None:
    scaler = GradScaler("cpu")
    scaler.load_state_dict(NON_DEFAULT)
    with pytest.raises(error) as excinfo:
        scaler.load_state_dict({**NON_DEFAULT, **change})
    assert message in str(excinfo.value)
    assert scaler.state_dict() == NON_DEFAULT


@pytest.mark.parametrize("when", ["before_scale", "after_update"])
def test_pickle_and_deepcopy(when: str) -> None:
    model, opt, scaler = setup(init_scale=128.0, growth_interval=1)
    if when == "after_update":
        backward(model, scaler)
        scaler.step(opt)
        scaler.update()
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
        backward(model, clone)
        clone.step(opt)
        clone.update()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer = io.BytesIO()
        torch.save(scaler.state_dict(), buffer)


def test_pickle_mid_iteration_is_refused() -> None:
    model, opt, scaler = setup()
    backward(model, scaler)
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning"):
        pickle.dumps(scaler)


def test_private_members_keep_torchs_meaning() -> None:
    model, opt, scaler = setup(init_scale=64.0)
    assert scaler._scale is None and scaler._growth_tracker is None
    backward(model, scaler)
    assert scaler._scale.dtype == torch.float32 and float(scaler._scale) == 64.0
    assert scaler._growth_tracker.dtype == torch.int32 and scaler._enabled and scaler._device == "cpu"
    found = scaler._check_inf_per_device(opt)
    assert list(found) == [torch.device("cpu")] and float(found[torch.device("cpu")]) == 0.0
    assert scaler._found_inf_per_device(opt) is found
    assert scaler._get_scale_async() is scaler._scale
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


class LegacyFusedSGD(torch.optim.SGD):
    """An optimizer of the old protocol: takes the scaler as a ``grad_scaler`` keyword."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.seen_scaler = grad_scaler
        found = sum(float(v) for v in grad_scaler._check_inf_per_device(self).values())
        if not found:
            with torch.no_grad():
                for p in self.param_groups[0]["params"]:
                    p.add_(p.grad / grad_scaler.get_scale(), alpha=-0.1)
        return "stepped"


@pytest.mark.parametrize("scaler_cls", [GradScaler, torch.amp.GradScaler], ids=["ours", "torch"])
def test_legacy_grad_scaler_keyword_gets_torchs_future_warning(scaler_cls) -> None:
    model = nn.Linear(4, 2)
    opt = LegacyFusedSGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    with pytest.warns(FutureWarning, match=r"^GradScaler is going to stop passing itself as a keyword argument"):
        assert scaler.step(opt) == "stepped"
    assert opt.seen_scaler is scaler
    scaler.update()
    assert scaler.get_scale() == 8.0


def test_scale_serves_each_device_its_own_copy() -> None:
    scaler = GradScaler("cpu", init_scale=4.0)
    cpu, meta = torch.ones(2), torch.ones(3, device="meta")
    out = scaler.scale([cpu, meta, (meta, cpu)])
    assert out[0].device.type == "cpu" and out[1].device.type == "meta" and out[2][0].device.type == "meta"
    assert torch.equal(out[0], cpu * 4) and scaler._scale.device.type == "cpu"


@pytest.mark.parametrize("scale", [3.0, 7.0, 0.1, 1e-30, 2.0**-126, 3.0e38, 65536.0, 1.0 + 2.0**-23])
def test_inverse_scale_on_the_host_rounds_as_torch(scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU computes 1/S in Python; it must be the float32 torch's double-reciprocal-then-float gives."""
    scaler = GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    expected = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    assert torch.equal(scaler._inv_scale(), expected)
    monkeypatch.setenv("GRADSCALER_KERNEL", "generic")  # the device route, for a scale set up afresh
    device_route = GradScaler("cpu", init_scale=scale)
    device_route.scale(torch.ones(()))
    assert torch.equal(device_route._inv_scale(), expected)
