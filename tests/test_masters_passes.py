"""master_weights=True: how many passes the scaler makes over the gradients, and interrupted iterations.

The move into the masters is the only pass that reads the float16 gradients, and it gives the flag
and (when clipping) the norms: no later pass of the scaler reads a master's gradient again, except
the clip multiply an optimizer that reads ``.grad`` needs. An iteration interrupted after the move
(an exception between ``unscale_``/``clip_grad_norm_`` and ``step``), followed by ``zero_grad`` and a
new backward, steps the new gradients once unscaled: bit-identical to the run never interrupted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradscaler import GradScaler, clipping, grads
from gradscaler.masters import lifecycle
from test_masters import (
    INIT_SCALE,
    OPTIMIZERS,
    HalfNet,
    assert_same_run,
    batches,
    by_hand,
    loss_of,
    ours,
    snapshot,
    states_by_position,
)


class PassLog:
    """Which gradients each of the scaler's passes was given: the move, the read passes, the multiplies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.moves: list[tuple[int, float | None]] = []  # (tensors moved, norm_type) per call
        self.reads: list[torch.Tensor] = []
        self.multiplied: list[torch.Tensor] = []
        real_move, real_read, real_scale = lifecycle.move_grads_, grads.grad_stats, clipping.scale_grads_

        def move(src: list[torch.Tensor], dst: list[torch.Tensor], *args: Any) -> Any:
            self.moves.append((len(src), args[1] if len(args) > 1 else None))
            return real_move(src, dst, *args)

        def read(tensors: list[torch.Tensor], *args: Any) -> Any:
            self.reads.extend(tensors)
            return real_read(tensors, *args)

        def scale(groups: grads.GradGroups, factor: torch.Tensor) -> None:
            self.multiplied.extend(t for by_dtype in groups.values() for ts in by_dtype.values() for t in ts)
            real_scale(groups, factor)

        monkeypatch.setattr(lifecycle, "move_grads_", move)
        monkeypatch.setattr(grads, "grad_stats", read)
        monkeypatch.setattr(clipping, "scale_grads_", scale)

    def touched(self, tensors: list[torch.Tensor], among: list[torch.Tensor]) -> int:
        """How many of ``tensors`` share memory with one of ``among``."""
        pointers = {t.data_ptr() for t in among}
        found = sum(t.data_ptr() in pointers for t in tensors)
        assert found <= len(tensors)
        return found


def one_clipped_step(
    name: str, log_from: pytest.MonkeyPatch | None, mixed: bool = True
) -> tuple[PassLog | None, list[torch.Tensor]]:
    """One clipped iteration after a first (binding) one; the log covers the second only. ``mixed``: the
    float32 LayerNorm trains beside the float16 layers (else it is frozen: every gradient a master's)."""
    model = HalfNet()
    model.norm.requires_grad_(mixed)
    opt = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
    scaler = GradScaler("cpu", init_scale=2.0**10, master_weights=True)
    log = None
    for step, (x, y) in enumerate(batches(2)):
        if step == 1 and log_from is not None:
            log = PassLog(log_from)
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.clip_grad_norm_(opt, 0.5)
        master_grads = [m.grad for _, m in scaler.master_weights(opt)]
        scaler.step(opt)
        scaler.update()
    assert scaler.stats()["skipped_steps"] == 0
    return log, master_grads  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["adamw_fused", "adamw_foreach", "sgd_momentum_forloop"])
def test_clipping_a_float16_model_reads_each_gradient_once_and_never_rereads_a_master(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    log, master_grads = one_clipped_step(name, monkeypatch, mixed=False)
    assert log is not None
    assert log.moves == [(len(master_grads), 2.0)]  # one move of every float16 gradient, with its norm
    assert log.touched(log.reads, master_grads) == 0
    fused = name.endswith("fused")  # the clip factor goes to the kernel in grad_scale: nothing written
    assert log.touched(log.multiplied, master_grads) == (0 if fused else len(master_grads))


@pytest.mark.parametrize("name", ["adamw_fused", "sgd_momentum_forloop"])
def test_clipping_with_float32_parameters_norms_every_gradient_in_one_pass_after_the_move(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """As clipping by hand norms them: one pass over all the optimizer's float32 gradients, masters' and
    LayerNorm's together (on the CPU a tensor's result depends on which tensors share its pass)."""
    log, master_grads = one_clipped_step(name, monkeypatch, mixed=True)
    assert log is not None
    assert log.moves == [(len(master_grads), None)]  # moved with the flag only
    assert log.touched(log.reads, master_grads) == len(master_grads)
    assert len(log.reads) == len(master_grads) + 2  # and the LayerNorm's two


def test_a_fused_step_takes_its_flag_from_the_move(monkeypatch: pytest.MonkeyPatch) -> None:
    model = HalfNet()
    opt = OPTIMIZERS["adamw_fused"]([p for p in model.parameters() if p.requires_grad])
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, master_weights=True)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    log = PassLog(monkeypatch)
    scaler.step(opt)
    scaler.update()
    master_grads = [m.grad for _, m in scaler.master_weights(opt)]
    assert log.moves == [(len(master_grads), None)]
    assert log.touched(log.reads, master_grads) == 0
    assert scaler.last_step_skipped()  # 2**24 overflows float16: the move's flag decided it


@pytest.mark.parametrize("name", ["adamw_fused", "sgd_momentum_forloop"])
def test_one_pass_clipping_equals_clipping_the_masters_by_hand(name: str) -> None:
    assert_same_run(ours(name, clip=0.5), by_hand(name, clip=0.5, scaler_clips=True))


# Interrupted iterations -----------------------------------------------------------------------------


class Interrupt(Exception):
    """Stands for an error in the user's code between two scaler calls."""


def interrupted_run(
    name: str, how: str, zero: str, interrupt_at: int | None, scale_first: bool = False
) -> dict[str, Any]:
    """Eight iterations; at ``interrupt_at`` the iteration stops after ``how`` and runs again from
    ``zero`` (``optimizer``, ``optimizer_in_place`` or ``model`` zero_grad) and a new backward; with
    ``scale_first`` the loss is scaled before the ``zero_grad``."""
    model = HalfNet()
    opt = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, master_weights=True)

    def zero_grad() -> None:
        if zero == "model":
            model.zero_grad()
            opt.zero_grad()  # the masters' gradients too, as a loop zeroing both would
        else:
            opt.zero_grad(set_to_none=zero == "optimizer")

    def prepare() -> None:
        if how == "unscale":
            scaler.unscale_(opt)
        else:
            scaler.clip_grad_norm_(opt, 0.5)

    trace: dict[str, Any] = {"scales": [], "params": [], "skipped": []}
    for step, (x, y) in enumerate(batches(8)):
        zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        prepare()
        if step == interrupt_at:
            with pytest.raises(Interrupt):
                raise Interrupt  # the loop catches it and runs the iteration again
            scaled = scaler.scale(loss_of(model, x, y)) if scale_first else None
            zero_grad()
            (scaled if scaled is not None else scaler.scale(loss_of(model, x, y))).backward()
            prepare()
        scaler.step(opt)
        scaler.update()
        trace["scales"].append(scaler.get_scale())
        trace["skipped"].append(scaler.last_step_skipped())
        trace["params"].append(snapshot(model))
    trace["state"] = states_by_position(opt)
    return trace


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum_forloop", "adamw_fused"])
@pytest.mark.parametrize("how", ["unscale", "clip"])
@pytest.mark.parametrize("zero", ["optimizer", "optimizer_in_place", "model"])
@pytest.mark.parametrize("scale_first", [False, True], ids=["zero_first", "scale_first"])
def test_a_new_backward_after_an_interrupted_move_is_moved_once(
    name: str, how: str, zero: str, scale_first: bool
) -> None:
    assert_same_run(interrupted_run(name, how, zero, 4, scale_first), interrupted_run(name, how, zero, None))


# torch's unscaling hook -----------------------------------------------------------------------------


class HookedScaler(GradScaler):
    """A subclass that overrides torch's hook (ShardedGradScaler style), counting what it unscales."""

    unscaled: list[torch.Tensor]

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        self.unscaled = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum_forloop"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["unscale", "clip"])
def test_a_subclass_unscaling_hook_unscales_the_masters_once(name: str, clip: float | None) -> None:
    model = HalfNet()
    opt = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
    scaler = HookedScaler("cpu", init_scale=INIT_SCALE, growth_interval=3, master_weights=True)
    trace: dict[str, Any] = {"scales": [], "params": [], "skipped": []}
    for x, y in batches():
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if clip is not None:
            scaler.clip_grad_norm_(opt, clip)
        scaler.step(opt)
        scaler.update()
        trace["scales"].append(scaler.get_scale())
        trace["skipped"].append(scaler.last_step_skipped())
        trace["params"].append(snapshot(model))
        assert all(g.dtype == torch.float32 for g in scaler.unscaled)  # the hook saw the masters' gradients
    trace["state"] = states_by_position(opt)
    assert_same_run(trace, ours(name, clip=clip))


def test_the_model_gradients_are_fresh_after_an_interrupted_unscale() -> None:
    """The float16 gradients moved before the interruption are dropped when the next backward begins: it
    writes them anew instead of adding to them."""
    model = HalfNet()
    opt = OPTIMIZERS["adamw_foreach"]([p for p in model.parameters() if p.requires_grad])
    scaler = GradScaler("cpu", init_scale=2.0**10, master_weights=True)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.unscale_(opt)
    opt.zero_grad()
    scaled = scaler.scale(loss_of(model, x, y))
    assert all(p.grad is None for p in (model.fc1.weight, model.fc2.weight))
    scaled.backward()
    reference = HalfNet()
    torch.amp.GradScaler("cpu", init_scale=2.0**10).scale(loss_of(reference, x, y)).backward()
    for ours_, theirs in ((model.fc1.weight, reference.fc1.weight), (model.fc2.weight, reference.fc2.weight)):
        assert torch.equal(ours_.grad, theirs.grad)
