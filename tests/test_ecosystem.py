"""Integration with the ecosystem: Lightning Fabric, Hugging Face Accelerate, torch.compile."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradscaler import GradScaler

pytestmark = pytest.mark.integration


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=gen) for _ in range(n)]


def test_lightning_fabric_mixed_precision_uses_our_scaler() -> None:
    fabric_mod = pytest.importorskip("lightning.fabric")
    from lightning.fabric.plugins.precision import MixedPrecision

    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    model, opt = model_and_opt()
    model, opt = fabric.setup(model, opt)
    weight = next(model.parameters()).detach().clone()
    for x in batches(6):
        opt.zero_grad()
        fabric.backward(model(x).float().pow(2).mean())
        opt.step()
    assert scaler.stats()["steps"] == 6 and scaler.get_scale() == 2.0**11
    assert not torch.equal(weight, next(model.parameters()))


def test_accelerate_takes_our_scaler_before_prepare() -> None:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    accelerator.scaler = scaler  # before prepare(): the wrapped optimizer keeps this reference
    model, opt = model_and_opt()
    model, opt = accelerator.prepare(model, opt)
    for x in batches(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        opt.step()
    assert scaler.stats()["steps"] == 4 and scaler.get_scale() == 2.0**10


def test_compiled_model_trains_bit_identically_to_torchs_scaler() -> None:
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        model, opt = model_and_opt()
        compiled = torch.compile(model)
        scaler = cls("cpu", init_scale=2.0**8, growth_interval=2)
        for step, x in enumerate(batches(6)):
            opt.zero_grad()
            scaler.scale(compiled(x).pow(2).mean()).backward()
            if step == 2:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert results[0][1] == results[1][1]
        for a, b in zip(results[0][0], results[1][0], strict=True):
            assert torch.equal(a, b)


def test_lightning_trainer_mixed_precision_plugin_uses_our_scaler(tmp_path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, _ = model_and_opt()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(batches(4), batch_size=None))
    assert scaler.stats()["steps"] == 4 and scaler.get_scale() == 2.0**10
