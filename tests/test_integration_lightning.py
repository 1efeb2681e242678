"""Lightning Fabric and Lightning Trainer with ``MixedPrecision("16-mixed", "cpu", scaler=...)``.

Lightning runs its AMP plugin on the CPU as on a GPU (autocast to float16, scaler), so nothing is
simulated here. Each run is compared bit for bit with the same run using torch.amp.GradScaler.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import gradscaler
from integration_helpers import (
    EARLY_OVERFLOW,
    SCALER_CLASSES,
    Record,
    adamw,
    assert_bit_identical,
    grad_norm,
    mlp,
    poison_,
    regression_batches,
)

pytestmark = pytest.mark.integration
lightning = pytest.importorskip("lightning")
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as TrainerMixedPrecision  # noqa: E402


def fabric_run(
    scaler: Any, tmp_path: Any, *, fused: bool, clip: bool, steps: int = 12, resume_at: int | None = None
) -> Record:
    """A Fabric loop; at ``resume_at`` ``fabric.save`` / ``fabric.load`` of model, optimizer and scaler
    into fresh objects."""

    def setup(seed: int) -> tuple[Any, Any, Any]:
        fabric = lightning.Fabric(
            accelerator="cpu", devices=1, plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=scaler)]
        )
        model = mlp(seed)
        model, optimizer = fabric.setup(model, adamw(model.parameters(), fused))
        return fabric, model, optimizer

    fabric, model, optimizer = setup(0)
    record = Record()
    for step, (x, y) in enumerate(regression_batches(steps)):
        if step == resume_at:
            # Fabric does not save the precision plugin's scaler by itself: it goes in the state
            fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "scaler": scaler})
            scaler.load_state_dict(type(scaler)("cpu").state_dict())  # forget, then restore from the file
            fabric, model, optimizer = setup(5)
            fabric.load(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "scaler": scaler})
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        if step == 9:
            poison_(model)
        if clip:  # error_if_nonfinite=False: the default raises on an overflow step (see the trap test)
            record.norms.append(fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False))
        else:
            record.norms.append(grad_norm(model))
        optimizer.step()
        optimizer.zero_grad()
        record.losses.append(loss.detach().clone())
        record.scales.append(scaler.get_scale())
    return record.finish(model, optimizer)


@pytest.mark.parametrize(("fused", "clip"), [(True, False), (False, True), (False, False)])
def test_fabric_is_bit_identical_to_torchs_scaler_through_a_checkpoint(fused: bool, clip: bool, tmp_path: Any) -> None:
    """Fabric refuses clip_gradients with a fused optimizer (NotImplementedError), so fused runs without."""
    records = {
        name: fabric_run(cls("cpu", **EARLY_OVERFLOW), tmp_path / name, fused=fused, clip=clip)
        for name, cls in SCALER_CLASSES.items()
    }
    assert records["torch"].scales[0] < EARLY_OVERFLOW["init_scale"]
    assert records["torch"].scales[9] == records["torch"].scales[8] / 2
    assert_bit_identical(records["torch"], records["ours"])
    resumed = fabric_run(
        gradscaler.GradScaler("cpu", **EARLY_OVERFLOW), tmp_path / "r", fused=fused, clip=clip, resume_at=6
    )
    assert_bit_identical(records["torch"], resumed)


@pytest.mark.parametrize("cls", list(SCALER_CLASSES.values()), ids=list(SCALER_CLASSES))
def test_trap_fabric_clip_gradients_raises_on_an_overflow_step_by_default(cls: Any) -> None:
    fabric = lightning.Fabric(
        accelerator="cpu", devices=1, plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=cls("cpu"))]
    )
    model = mlp()
    model, optimizer = fabric.setup(model, adamw(model.parameters(), False))
    x, y = regression_batches(1)[0]
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    poison_(model)
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)


def test_fabric_default_plugin_builds_ours_under_patch_torch() -> None:
    with gradscaler.patch_torch():
        plugin = FabricMixedPrecision("16-mixed", "cpu")  # calls torch.amp.GradScaler(device="cpu")
    assert type(plugin.scaler) is gradscaler.GradScaler
    assert type(FabricMixedPrecision("16-mixed", "cpu").scaler) is torch.amp.GradScaler


def trainer_run(scaler: Any, tmp_path: Any, *, fused: bool, clip: bool, steps: int = 10) -> Record:
    import lightning.pytorch as pl

    record = Record()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            record.losses.append(loss.detach().clone())
            return loss

        def on_after_backward(self) -> None:
            if self.global_step == 7:
                poison_(self.net)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            record.norms.append(grad_norm(self.net))  # after Lightning's unscale_ (non-fused)

        def on_train_batch_end(self, *args: Any) -> None:
            record.scales.append(scaler.get_scale())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self.parameters(), fused)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps,
        plugins=[TrainerMixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=1.0 if clip else None, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(regression_batches(steps), batch_size=None))
    return record.finish(module, trainer.optimizers[0])


@pytest.mark.parametrize(("fused", "clip"), [(True, False), (False, True)], ids=["fused", "foreach-clip"])
def test_lightning_trainer_is_bit_identical_to_torchs_scaler(fused: bool, clip: bool, tmp_path: Any) -> None:
    """Lightning refuses gradient clipping with fused optimizers, so fused runs without it."""
    records = {
        name: trainer_run(cls("cpu", **EARLY_OVERFLOW), tmp_path / name, fused=fused, clip=clip)
        for name, cls in SCALER_CLASSES.items()
    }
    assert records["torch"].scales[0] < EARLY_OVERFLOW["init_scale"]
    assert records["torch"].scales[7] == records["torch"].scales[6] / 2
    assert_bit_identical(records["torch"], records["ours"])


def test_on_the_cpu_the_16_mixed_string_is_bf16_without_a_scaler_and_the_plugin_keeps_fp16() -> None:
    """docs/integrations.md: on the CPU Lightning turns the string "16-mixed" into "bf16-mixed" (no scaler),
    patched or not; the plugin ``MixedPrecision("16-mixed", "cpu")`` keeps float16 and, patched, builds ours."""
    with gradscaler.patch_torch():
        with pytest.warns(UserWarning, match=r"precision='16-mixed'\)` but AMP with fp16 is not supported on CPU"):
            by_string = lightning.Fabric(accelerator="cpu", devices=1, precision="16-mixed")
        by_plugin = lightning.Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecision("16-mixed", "cpu")])
    assert by_string._precision.precision == "bf16-mixed" and by_string._precision.scaler is None
    assert by_plugin._precision.precision == "16-mixed"
    assert type(by_plugin._precision.scaler) is gradscaler.GradScaler


def half_fabric_losses(scaler: Any, steps: int = 25) -> tuple[list[float], Any]:
    """A float16 model under ``Fabric(precision="16-true")``, one batch repeated (the loss can fall)."""
    fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="16-true")
    module = mlp(0)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    x, y = regression_batches(1)[0]
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss if scaler is None else scaler.scale(loss))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_16_true_builds_no_scaler_and_fabric_with_your_own_scaler_trains_a_float16_model() -> None:
    """docs/integrations.md: ``precision="16-true"`` casts the model to float16 and builds no scaler, patched
    or not (AdamW's float16 step is NaN at once); it refuses the MixedPrecision plugin; Fabric with a scaler
    of your own, ``GradScaler("cpu", master_weights=True)``, trains the float16 model."""
    for patched in (False, True):  # patch_torch patches when called: a handle made early would patch both
        with gradscaler.patch_torch(master_weights=True) if patched else contextlib.nullcontext():
            fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="16-true")
            assert getattr(fabric._precision, "scaler", None) is None
            losses, model = half_fabric_losses(None, steps=3)
        assert losses[0] == losses[0] and losses[1] != losses[1]  # NaN from the second step
    with pytest.raises(ValueError, match=r"Received both `precision=16-true` and `plugins="):
        lightning.Fabric(
            accelerator="cpu", devices=1, precision="16-true", plugins=[FabricMixedPrecision("16-mixed", "cpu")]
        )
    losses, model = half_fabric_losses(gradscaler.GradScaler("cpu", master_weights=True))
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in model.parameters())
    assert all(loss == loss for loss in losses) and losses[-1] < 0.5 * losses[0], losses
