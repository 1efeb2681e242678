"""patch_torch at its edges: stale handles, torch's own scalers pickled while patched, subclasses."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch

import gradscaler
from gradscaler import drop_in

TORCH_AMP = torch.amp.grad_scaler.GradScaler
TORCH_CUDA_AMP = torch.cuda.amp.grad_scaler.GradScaler


def test_a_stale_handle_leaves_a_later_patch_alone() -> None:
    stale = gradscaler.patch_torch()
    gradscaler.unpatch_torch()
    with gradscaler.patch_torch() as later:
        stale.undo()
        assert drop_in.is_torch_patched() and torch.amp.GradScaler is gradscaler.GradScaler
        assert later.applied and not stale.applied
    assert not drop_in.is_torch_patched() and torch.amp.GradScaler is TORCH_AMP


def used_torch_scaler() -> Any:
    scaler = TORCH_AMP("cpu", init_scale=2.0**10, growth_interval=3)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    return scaler


def test_torchs_own_scaler_pickles_while_patched_and_comes_back_as_torchs() -> None:
    scaler = used_torch_scaler()
    with gradscaler.patch_torch():
        data = pickle.dumps(scaler)
        inside = pickle.loads(data)
    outside = pickle.loads(data)
    for copy in (inside, outside):
        assert type(copy) is TORCH_AMP
        assert copy.state_dict() == scaler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of the torch.cuda.amp spelling; no CUDA here
        legacy = TORCH_CUDA_AMP()
    with gradscaler.patch_torch():
        assert type(pickle.loads(pickle.dumps(legacy))) is TORCH_CUDA_AMP


def test_torchs_scaler_pickled_before_the_patch_unpickles_as_torchs_while_patched() -> None:
    scaler = used_torch_scaler()
    data = pickle.dumps(scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = pickle.dumps(TORCH_CUDA_AMP())
    with gradscaler.patch_torch():
        restored = pickle.loads(data)
        restored_legacy = pickle.loads(legacy)
    assert type(restored) is TORCH_AMP and restored.state_dict() == scaler.state_dict()
    assert type(restored_legacy) is TORCH_CUDA_AMP and not restored_legacy.is_enabled()
    ours = gradscaler.GradScaler("cpu", init_scale=8.0)
    with gradscaler.patch_torch():
        assert type(pickle.loads(pickle.dumps(ours))) is gradscaler.GradScaler


def hooked_subclass(base: type, hooks: str) -> type:
    """A ShardedGradScaler-style subclass overriding torch's hooks (``hooks``: "unscale", "opt_step" or
    both): each records its calls and defers to the base class."""

    class Hooked(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.calls: list[tuple[Any, ...]] = []

    def _unscale_grads_(self: Any, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool) -> Any:
        self.calls.append(("_unscale_grads_", inv_scale.item(), found_inf.item(), allow_fp16))
        return super(Hooked, self)._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def _maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
        flags = sorted(v.item() for v in optimizer_state["found_inf_per_device"].values())
        self.calls.append(("_maybe_opt_step", flags))
        return ("hooked", super(Hooked, self)._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs))

    if hooks in ("unscale", "both"):
        Hooked._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]
    if hooks in ("opt_step", "both"):
        Hooked._maybe_opt_step = _maybe_opt_step  # type: ignore[method-assign]
    return Hooked


def hooked_run(scaler: Any, *, fused: bool, explicit_unscale: bool) -> tuple[list[Any], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=not fused)
    returned = []
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(2, 4)).pow(2).sum()).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        if explicit_unscale:
            scaler.unscale_(optimizer)
        returned.append(scaler.step(optimizer))
        scaler.update()
    return returned, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hooks", ["unscale", "opt_step", "both"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("explicit_unscale", [False, True], ids=["step", "unscale"])
def test_a_subclass_defined_while_patched_has_its_hooks_called_where_torch_calls_them(
    hooks: str, fused: bool, explicit_unscale: bool
) -> None:
    theirs = hooked_subclass(TORCH_AMP, hooks)("cpu", init_scale=2.0**8)
    with gradscaler.patch_torch():
        ours_class = hooked_subclass(torch.amp.GradScaler, hooks)
    assert issubclass(ours_class, gradscaler.GradScaler)
    ours = ours_class("cpu", init_scale=2.0**8)
    expected = hooked_run(theirs, fused=fused, explicit_unscale=explicit_unscale)
    got = hooked_run(ours, fused=fused, explicit_unscale=explicit_unscale)
    assert ours.calls == theirs.calls
    assert len(theirs.calls) >= 4 or (hooks == "opt_step" and fused)  # torch's fused step calls neither
    assert got[0] == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))


def test_without_overrides_the_hooks_stay_off_the_fast_path() -> None:
    ours = gradscaler.GradScaler("cpu")
    with pytest.warns(FutureWarning):
        legacy = drop_in.CpuAmpGradScaler()
    assert not any(s._custom_unscale or s._custom_opt_step for s in (ours, legacy))

    class OnlyStep(gradscaler.GradScaler):
        def _maybe_opt_step(self, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    only_step = OnlyStep("cpu")
    assert only_step._custom_opt_step and not only_step._custom_unscale


def test_is_torch_patched_is_public_and_says_whether_the_patch_is_in_effect() -> None:
    assert "is_torch_patched" in gradscaler.__all__ and gradscaler.is_torch_patched.__doc__
    assert not gradscaler.is_torch_patched()
    with gradscaler.patch_torch():
        assert gradscaler.is_torch_patched()
    assert not gradscaler.is_torch_patched()


@pytest.mark.parametrize("master_weights", [False, True])
def test_a_spelling_bound_to_ours_already_is_patched_and_restored_as_it_was(master_weights: bool) -> None:
    """A user's alias ``torch.amp.GradScaler = gradscaler.GradScaler`` before ``patch_torch``: the patch
    went half in and raised ``KeyError`` (looking for torch's function of a clipping it is not)."""
    original = torch.amp.GradScaler
    torch.amp.GradScaler = gradscaler.GradScaler  # type: ignore[misc]
    try:
        with gradscaler.patch_torch(master_weights=master_weights):
            assert gradscaler.is_torch_patched() and issubclass(torch.GradScaler, gradscaler.GradScaler)
        assert torch.amp.GradScaler is gradscaler.GradScaler  # as the user left it
        assert not gradscaler.is_torch_patched() and torch.GradScaler is original
    finally:
        torch.amp.GradScaler = original  # type: ignore[misc]


@pytest.mark.parametrize("accumulate", [False, True], ids=["masters", "masters_and_sums"])
def test_a_scaler_built_by_its_own_name_under_a_patch_takes_the_patch_arguments(accumulate: bool) -> None:
    """docs/integrations.md builds ``gradscaler.GradScaler("cpu", master_weights=True)`` after
    ``patch_torch(master_weights=True)``: with ``accumulate_grads_in_fp32=True`` added to the patch line alone,
    that scaler summed in float16, silently. Arguments not given now come from the active patch."""
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=accumulate):
        given_masters = gradscaler.GradScaler("cpu", master_weights=True)
        bare = gradscaler.GradScaler("cpu")
        refused = gradscaler.GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=False)
        without = gradscaler.GradScaler("cpu", master_weights=False)
    after = gradscaler.GradScaler("cpu")
    assert given_masters._masters.active and bare._masters.active
    assert (given_masters._masters._sums is not None) == accumulate
    assert (bare._masters._sums is not None) == accumulate
    assert refused._masters._sums is None  # an argument given wins
    assert not without._masters.active
    assert not after._masters.active  # unpatched: torch's defaults again
