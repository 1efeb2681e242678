"""``gradscaler.with_master_weights(optimizer)``: float32 masters and float32 gradient sums for a bfloat16
model that no scaler steps (issue 45), against the recipe by hand, in the loop shapes users write.

The recipe by hand: float32 copies in the optimizer; after each backward ``m.grad = p.grad.float()`` (or
``m.grad + p.grad.float()``), ``p.grad = None``; torch's clipping over the copies' gradients; the step; each
copy written back into its parameter. Every comparison is bit for bit, and each is checked to differ from
the same run without the line (the comparison has power)."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch

import gradscaler
from bf16_recipe import Copies, equal, run
from gradscaler.masters import checks
from gradscaler.masters.checks import HELD_ATTR
from gradscaler.masters.standalone import NOTHING_MESSAGE

MICRO = 4
STEPS = 3
CLIP = 0.05  # bites: the norms of this model's sums are about 1


def _model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model.to(dtype)


def _batches(steps: int = STEPS) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(5, 8, generator=generator), torch.randn(5, 4, generator=generator)) for _ in range(MICRO)]
        for _ in range(steps)
    ]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x.to(torch.bfloat16))
    return ((out.float() - y) ** 2).mean() / MICRO


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def recipe(model: torch.nn.Module, batches: list, clip: float | None = CLIP) -> tuple[list[torch.Tensor], list]:
    """The recipe by hand; returns the parameters after the run and each step's clipping norm."""
    norms = run(model.parameters(), batches, lambda step, xy: _loss(model, *xy).backward(), clip, lr=1e-2)
    return _state(model), norms


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, clip: float | None = CLIP) -> list:
    """The plain loop a user writes: the micro-batches' backwards, torch's clipping over the model's
    parameters, the step, ``zero_grad``; returns each step's norm."""
    norms = []
    for step in batches:
        for x, y in step:
            _loss(model, x, y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def ours(model: torch.nn.Module, batches: list, line: bool = True, clip: float | None = CLIP) -> tuple[list, list]:
    """The plain loop with the one line (or without it: ``line=False``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if line:
        optimizer = gradscaler.with_master_weights(optimizer)
    norms = train(model, optimizer, batches, clip)
    return _state(model), norms


@pytest.mark.parametrize("clip", [CLIP, None], ids=["clip", "no-clip"])
def test_a_plain_loop_equals_the_recipe_and_differs_without_the_line(clip: float | None) -> None:
    batches = _batches()
    expected, expected_norms = recipe(_model(), batches, clip)
    got, norms = ours(_model(), batches, clip=clip)
    assert equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(norms, expected_norms, strict=True))
    if clip is not None:
        assert all(n > clip for n in norms), "the clipping must bite"
    without, _ = ours(_model(), batches, line=False, clip=clip)
    assert not equal(without, expected)
    assert all(p.dtype == torch.bfloat16 for p in got)


def test_the_gradients_are_the_optimizers_parameters_and_the_model_holds_none() -> None:
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y), *_ = _batches(1)[0]
    _loss(model, x, y).backward()
    masters = [m for group in optimizer.param_groups for m in group["params"]]
    assert all(m.dtype == torch.float32 and m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    assert all(p.grad is None for p in model.parameters())
    optimizer.zero_grad()
    assert all(m.grad is None for m in masters)


def test_a_step_inside_the_closure_as_lightning_calls_it_equals_the_recipe() -> None:
    """Lightning's automatic optimization: the last micro-batch's backward and the clipping run inside the
    closure that ``optimizer.step(closure)`` calls, after the step's pre-hook."""
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in batches:
        for x, y in step[:-1]:
            _loss(model, x, y).backward()

        def closure(last: tuple = step[-1]) -> torch.Tensor:
            loss = _loss(model, *last)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], CLIP)
            return loss

        optimizer.step(closure)
        optimizer.zero_grad()
    assert equal(_state(model), expected)


@pytest.mark.parametrize("scaler", ["torch-disabled", "gradscaler-disabled"])
def test_nanogpts_bfloat16_loop_with_its_disabled_scaler_equals_the_recipe(scaler: str) -> None:
    """nanoGPT builds ``GradScaler(enabled=(dtype == 'float16'))``: disabled in bfloat16, still called."""
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    grad_scaler = (torch.amp.GradScaler if scaler == "torch-disabled" else gradscaler.GradScaler)("cpu", enabled=False)
    for step in batches:
        for x, y in step:
            grad_scaler.scale(_loss(model, x, y)).backward()
        grad_scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert equal(_state(model), expected)


def test_zero_grad_to_zeros_and_a_scheduler_made_before_the_line() -> None:
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0)
    optimizer = gradscaler.with_master_weights(inner)
    assert optimizer is inner and isinstance(optimizer, torch.optim.AdamW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in batches:
            for x, y in step:
                _loss(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=False)
    assert equal(_state(model), expected)


def _save(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(order: str) -> None:
    batches = _batches(4)
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))

    train(model, optimizer, batches[:2])
    saved = torch.load(io.BytesIO(_save(model, optimizer)), weights_only=True)
    plain = _model()
    plain.load_state_dict(saved["model"])  # the model saved alone is a plain bfloat16 model
    assert all(p.dtype == torch.bfloat16 for p in plain.parameters())

    resumed = _model()  # a fresh process: the model built again, the optimizer wrapped again
    again = gradscaler.with_master_weights(torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    if order == "model-first":
        resumed.load_state_dict(saved["model"])
        again.load_state_dict(saved["optimizer"])
    else:
        again.load_state_dict(saved["optimizer"])
        resumed.load_state_dict(saved["model"])
    train(resumed, again, batches[2:])
    assert equal(_state(resumed), expected)


def test_a_scaler_with_master_weights_over_it_is_refused_and_one_without_is_the_recipes_scaler() -> None:
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y), *_ = _batches(1)[0]
    scaler = gradscaler.GradScaler("cpu", master_weights=True)
    scaler.scale(_loss(model, x, y)).backward()
    with pytest.raises(ValueError, match="Build the scaler without master_weights"):
        scaler.step(optimizer)
    assert checks.HELD_MESSAGE.split(" ", 1)[0] == "Build"


def test_an_optimizer_of_float32_parameters_gets_no_masters_and_is_told_what_to_do() -> None:
    model = _model(torch.float32)
    with pytest.warns(UserWarning, match="after the model is cast to bfloat16") as caught:
        optimizer = gradscaler.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(caught[0].message) == NOTHING_MESSAGE.format(name="SGD")
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())


def test_calling_it_twice_changes_nothing_and_a_non_optimizer_is_refused() -> None:
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gradscaler.with_master_weights(optimizer)
    gradscaler.with_master_weights(optimizer)
    train(model, optimizer, batches)
    assert equal(_state(model), expected)
    with pytest.raises(TypeError, match=r"Pass the torch\.optim\.Optimizer"):
        gradscaler.with_master_weights(model)  # type: ignore[arg-type]


def test_a_deep_copied_model_and_optimizer_train_apart() -> None:
    """A framework that deep-copies the model (an EMA, a swa model) leaves the original's masters alone."""
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    shadow = copy.deepcopy(model)
    train(model, optimizer, batches)
    assert equal(_state(model), expected)
    assert equal(_state(shadow), _state(_model()))


def _steps_warnings(line: bool, scaler: bool = False) -> list[str]:
    model = _model(torch.float16 if scaler else torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if line:
        gradscaler.with_master_weights(optimizer)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None  # gradscaler's: patched
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in _batches(2):
            for x, y in step:
                loss = ((model(x.to(model[0].weight.dtype)).float() - y) ** 2).mean()
                (loss if grad_scaler is None else grad_scaler.scale(loss)).backward()
            if grad_scaler is None:
                optimizer.step()
            else:
                grad_scaler.step(optimizer)
                grad_scaler.update()
            optimizer.zero_grad()
    return [str(w.message) for w in caught if "patch_torch(master_weights=True) did not reach" in str(w.message)]


def test_patch_torch_with_master_weights_says_at_the_first_step_what_a_loop_without_a_scaler_needs() -> None:
    """Issue 45 item 4: no silent no-op. A bfloat16 loop builds no scaler, so the patch cannot reach it: one
    line at the optimizer's first step says what to do; none with the line, none for a float16 loop whose
    scaler the patch made, none once unpatched."""
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        told = _steps_warnings(line=False)
        assert len(told) == 1 and told[0].startswith("Call gradscaler.with_master_weights(optimizer)"), told
        assert "did not reach AdamW" in told[0] and "4 bfloat16 parameter(s) with gradients" in told[0], told
        assert _steps_warnings(line=True) == []
        assert _steps_warnings(line=False, scaler=True) == []
    assert _steps_warnings(line=False) == []
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks


def _partial_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """Step 1's micro-batches reach the last layer only: its first layer gets no gradient in that iteration."""
    if step == 1:
        return ((model[2](torch.tanh(x.to(torch.bfloat16)).repeat(1, 2)).float() - y) ** 2).mean() / MICRO
    return _loss(model, x, y)


@pytest.mark.parametrize("clearing", ["model.zero_grad", "none"])
def test_model_zero_grad_clears_the_sums_and_a_loop_that_clears_nothing_adds_up(clearing: str) -> None:
    """The HF Trainer calls ``model.zero_grad()``, which means the gradients the masters hold: it clears their
    sums (``torch.nn.Module.zero_grad`` reaches them), as the recipe clears its copies'. A loop that clears
    nothing adds every backward up across steps, as autograd adds into ``p.grad`` (and so does the recipe).
    Step 1 reaches the last layer only: the first layer's sum of step 0 is stepped again or not."""
    batches = _batches()
    model = _model()
    params = list(model.parameters())
    recipe_copies = Copies(params)
    masters = recipe_copies.masters
    reference = torch.optim.AdamW(masters, lr=1e-2)
    for index, step in enumerate(batches):
        for x, y in step:
            _partial_loss(model, x, y, index).backward()
            recipe_copies.add()
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        reference.step()
        recipe_copies.write_back()
        if clearing == "model.zero_grad":
            reference.zero_grad()
    expected = _state(model)

    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for index, step in enumerate(batches):
        for x, y in step:
            _partial_loss(model, x, y, index).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if clearing == "model.zero_grad":
            model.zero_grad()
            assert all(m.grad is None for g in optimizer.param_groups for m in g["params"])
    assert equal(_state(model), expected)


@pytest.mark.parametrize("skip", ["continue", "torch-scaler"])
def test_a_step_not_taken_leaves_nothing_behind_once_the_model_is_zeroed(skip: str) -> None:
    """A loop that skips the step of a bad batch (``continue`` past a NaN loss, or torch's scaler finding an
    inf) and clears with ``model.zero_grad()`` at the top of each iteration equals the recipe, whose zeroing
    clears its copies: the bad sums go with the zeroing (before, they stayed in the masters and every later
    step was bad)."""
    batches = _batches(4)
    dtype = torch.float16 if skip == "torch-scaler" else torch.bfloat16

    def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, index: int) -> torch.Tensor:
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean() / MICRO
        return loss * float("nan" if skip == "continue" else "inf") if index == 1 else loss

    def run(line: bool) -> tuple[list[torch.Tensor], list[float]]:
        model = _model(dtype)
        if line:
            optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
        else:  # the recipe by hand
            copies = Copies(model.parameters())
            optimizer = torch.optim.AdamW(copies.masters, lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0) if skip == "torch-scaler" else None
        scales = []
        for index, step in enumerate(batches):
            model.zero_grad()
            if not line:
                optimizer.zero_grad()
            for x, y in step:
                loss = loss_of(model, x, y, index)
                (loss if scaler is None else scaler.scale(loss)).backward()
                if not line:
                    copies.add()
            if scaler is not None:
                scaler.step(optimizer)
                applied = not scaler._found_inf_per_device(optimizer)[torch.device("cpu")].item()
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                applied = index != 1
                if applied:
                    optimizer.step()
            if applied and not line:
                copies.write_back()
        return _state(model), scales

    got, scales = run(line=True)
    expected, expected_scales = run(line=False)
    assert all(bool(torch.isfinite(p).all()) for p in got)
    assert equal(got, expected) and scales == expected_scales
    if skip == "torch-scaler":
        assert scales == [8.0, 4.0, 4.0, 4.0], scales  # one skip, then applied steps


def test_under_ddp_the_step_refuses_ddps_gradient_and_names_the_scalers_route(tmp_path: Any) -> None:
    """DDP reduces after the sums took each backward's gradient, so it writes its (zero) reduction into
    ``p.grad``; nothing averages the sums across ranks on this route: the step refuses, naming the route
    that does (one gloo rank, in this process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = gradscaler.with_master_weights(torch.optim.SGD(ddp.parameters(), lr=0.1))
        (x, y), *_ = _batches(1)[0]
        _loss(ddp, x, y).backward()
        before = _state(model)
        with pytest.raises(ValueError, match=r"^Use the scaler's route under DDP: .*register_ddp") as raised:
            optimizer.step()
        assert "optimizer.param_groups[0]['params'][0]" in str(raised.value)
        assert equal(_state(model), before)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("clip", ["scaler.clip_grad_norm_", "unscale_+torch"])
def test_a_scaler_without_masters_over_it_is_the_recipes_scaler_over_the_copies(clip: str) -> None:
    """Issue 45 item 3, "and ours": ``GradScaler.for_bf16`` (no masters) with its own one-pass clipping over an
    optimizer given masters equals the recipe whose optimizer of copies the same kind of scaler steps."""
    batches = _batches()
    model = _model()
    params = list(model.parameters())
    recipe_copies = Copies(params)
    copies = recipe_copies.masters
    theirs = torch.optim.AdamW(copies, lr=1e-2)
    theirs_scaler = gradscaler.GradScaler.for_bf16("cpu")
    for step in batches:
        for x, y in step:
            theirs_scaler.scale(_loss(model, x, y)).backward()
            recipe_copies.add()
        if clip == "scaler.clip_grad_norm_":
            theirs_scaler.clip_grad_norm_(theirs, CLIP)
        else:
            theirs_scaler.unscale_(theirs)
            torch.nn.utils.clip_grad_norm_(copies, CLIP)
        theirs_scaler.step(theirs)
        theirs_scaler.update()
        recipe_copies.write_back()
        theirs.zero_grad()
    expected = _state(model)

    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = gradscaler.GradScaler.for_bf16("cpu")
    norms = []
    for step in batches:
        for x, y in step:
            scaler.scale(_loss(model, x, y)).backward()
        if clip == "scaler.clip_grad_norm_":
            norms.append(scaler.clip_grad_norm_(optimizer, CLIP))
        else:
            scaler.unscale_(optimizer)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert all(n > CLIP for n in norms)
    assert equal(_state(model), expected)
    assert not equal(ours(_model(), batches, line=False)[0], expected)


def test_refusals_before_anything_changes() -> None:
    """LBFGS re-evaluates its closure at new points inside a step (the masters reach the parameters only after
    it); an optimizer already stepping a scaler's masters would be bound twice."""
    model = _model()
    with pytest.raises(TypeError, match=r"^Use an optimizer that evaluates its closure once per step"):
        gradscaler.with_master_weights(torch.optim.LBFGS(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gradscaler.GradScaler("cpu", master_weights=True)
    (x, y), *_ = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(ValueError, match=r"^Leave out either gradscaler\.with_master_weights"):
        gradscaler.with_master_weights(optimizer)
    assert vars(optimizer).get(HELD_ATTR) is None


def test_a_scaler_with_float32_sums_is_refused_at_its_step_and_the_masters_keep_training() -> None:
    """The scaler's ``scale()`` leaves the hooks of the line's masters alone (another's: its optimizer may
    be another one, whose loss runs through these parameters); its step over this optimizer is refused
    before anything changes, and after ``zero_grad`` the loop trains as the recipe."""
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = gradscaler.GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True)
    (x, y), *_ = batches[0]
    scaler.scale(_loss(model, x, y)).backward()
    before = _state(model)
    with pytest.raises(ValueError, match=r"^Build the scaler without master_weights"):
        scaler.step(optimizer)
    assert equal(_state(model), before)
    del scaler
    optimizer.zero_grad()
    train(model, optimizer, batches)
    assert equal(_state(model), expected)


def test_called_again_after_the_cast_it_binds_then() -> None:
    """The warning for an optimizer of float32 parameters says to call it after the cast: that call binds."""
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="after the model is cast"):
        gradscaler.with_master_weights(optimizer)
    model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradscaler.with_master_weights(optimizer)
        train(model, optimizer, batches)
    assert equal(_state(model), expected)


def test_a_frozen_parameter_written_inside_the_closure_keeps_the_write() -> None:
    """Lightning runs the training step inside ``optimizer.step(closure)``: an in-place update of a frozen
    parameter there (a running statistic kept as a parameter) is not overwritten by its master."""
    model = _model()
    model[2].bias.requires_grad_(False)
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    written = []
    for step in _batches():

        def closure(step: list = step) -> torch.Tensor:
            for x, y in step:
                _loss(model, x, y).backward()
            with torch.no_grad():
                model[2].bias.add_(1.0)
            written.append(model[2].bias.detach().clone())
            return torch.zeros(())

        optimizer.step(closure)
        assert torch.equal(model[2].bias, written[-1])
        optimizer.zero_grad()


def test_torchs_clipping_imported_by_name_is_warned_about() -> None:
    """Bound by name before the route (a user's module that ran ``from torch.nn.utils import clip_grad_norm_``
    first), torch's own clip_grad_norm_ finds no gradient in the parameters: the line warns, naming it."""
    loop = {"__name__": "user_loop"}
    exec(  # a module of the user's, whose import ran before the route was installed
        "import gradscaler\n"
        "from gradscaler.masters import torch_clip_grad_norm_ as clip_grad_norm_\n"
        "def wrap(optimizer):\n"
        "    return gradscaler.with_master_weights(optimizer)\n",
        loop,
    )
    with pytest.warns(UserWarning, match="module user_loop holds torch's own clip_grad_norm_ as clip_grad_norm_"):
        loop["wrap"](torch.optim.SGD(_model().parameters(), lr=0.1))


def test_a_deep_copied_model_and_optimizer_train_once_the_line_is_called_on_the_copy() -> None:
    """torch's ``Optimizer.__getstate__`` keeps no hook: the copy's masters are bound again by the line."""
    batches = _batches()
    expected, _ = recipe(_model(), batches)
    model = _model()
    optimizer = gradscaler.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    copied_model, copied = copy.deepcopy((model, optimizer))
    gradscaler.with_master_weights(copied)
    train(copied_model, copied, batches)
    assert equal(_state(copied_model), expected)
    assert equal(_state(model), _state(_model()))  # the original untouched
