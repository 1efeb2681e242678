"""``gradscaler.with_master_weights`` in each client's own bfloat16 mode (issue 45): Accelerate
(``mixed_precision="bf16"``), the HF Trainer (``bf16=True``, ``MasterWeightsCallback``), Lightning Fabric and
the Lightning Trainer (``precision="bf16-true"``), on the CPU.

Every run trains the same bfloat16 model (parameters in ``torch.bfloat16``) on the same bfloat16 batches: 4
micro-batches of gradient accumulation per optimizer step, a clipping that bites (each step's norm is above
``CLIP``), AdamW. The oracle is one loop in plain torch, no client and no gradscaler: the recipe by hand
(float32 copies in the optimizer; after each backward ``m.grad = p.grad.float()`` or ``m.grad +
p.grad.float()``, ``p.grad = None``; torch's ``clip_grad_norm_`` over the copies' gradients, which is what each
client's clipping calls; the step over the copies; ``p.copy_(m)``; the copies' gradients cleared). The data is
bfloat16 already and the model's parameters are bfloat16, so each client's own forward (Accelerate's
autocast, Fabric's and Lightning's input conversion and default dtype) computes what the oracle computes: its
comparisons are bit for bit (``torch.equal``), and each client's run without the line is checked to differ
(the comparison has power).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

import gradscaler
from bf16_recipe import equal, run

pytestmark = pytest.mark.integration

MICRO = 4  # micro-batches per optimizer step
STEPS = 3
RESUME_STEPS = 4  # the resumed runs: 2 steps, a checkpoint, 2 more
CLIP = 0.05  # bites: the norms of this model's float32 sums are about 0.5
LR = 1e-2
BATCH = 5


def _net() -> torch.nn.Sequential:
    """Seeded, built in float32 (each client makes it bfloat16 its own way)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1)
    return [
        [
            (
                torch.randn(BATCH, 8, generator=generator).to(torch.bfloat16),
                torch.randn(BATCH, 4, generator=generator).to(torch.bfloat16),
            )
            for _ in range(MICRO)
        ]
        for _ in range(steps)
    ]


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y.float()) ** 2).mean()


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _bfloat16(params: list[torch.Tensor]) -> bool:
    return all(p.dtype == torch.bfloat16 for p in params)


def recipe(batches: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The recipe by hand in plain torch; the parameters after the run and each step's norm."""
    model = _net().to(torch.bfloat16)

    def backward(step: list, xy: tuple[torch.Tensor, torch.Tensor]) -> None:
        (_mse(model(xy[0]), xy[1]) / MICRO).backward()

    norms = run(model.parameters(), batches, backward, CLIP, lr=LR, weight_decay=0.0)
    return _state(model), norms


def equals_the_recipe_and_differs_without_the_line(client_run: Any) -> None:
    """``client_run(batches, line=...)`` (the parameters after the run, each step's norm) with the line equals
    the recipe, its clipping biting, and differs without it."""
    batches = _batches(STEPS)
    expected, expected_norms = recipe(batches)
    got, norms = client_run(batches)
    _bites(norms)
    assert all(torch.equal(a, b) for a, b in zip(norms, expected_norms, strict=True))
    assert equal(got, expected) and _bfloat16(got)
    without, _ = client_run(batches, line=False)
    assert not equal(without, expected)


def _bites(norms: list[Any]) -> None:
    assert all(float(n) > CLIP for n in norms), f"the clipping must bite: {norms}"


# ------------------------------------------------------------------------------------------------ Accelerate
accelerate = pytest.importorskip("accelerate")
from integration_helpers import fresh_accelerate_state  # noqa: E402, F401 (an autouse fixture: used by name)


def _accelerate_setup(line: bool) -> tuple[Any, Any, Any]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a fresh process: Accelerate's singletons forgotten
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=MICRO)
    model = _net().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if line:
        optimizer = gradscaler.with_master_weights(optimizer)  # the one line, before prepare
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _accelerate_train(accelerator: Any, model: Any, optimizer: Any, batches: list) -> list[torch.Tensor]:
    norms = []
    for step in batches:
        for x, y in step:
            with accelerator.accumulate(model):
                accelerator.backward(_mse(model(x), y))  # divides by gradient_accumulation_steps
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP))
                optimizer.step()  # AcceleratedOptimizer: steps on the synchronising micro-batch only
                optimizer.zero_grad()
    return norms


def accelerate_run(batches: list, line: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    accelerator, model, optimizer = _accelerate_setup(line)
    assert accelerator.mixed_precision == "bf16"
    norms = _accelerate_train(accelerator, model, optimizer, batches)
    assert len(norms) == len(batches)
    return _state(model), norms


def test_accelerate_bf16_equals_the_recipe_and_differs_without_the_line() -> None:
    equals_the_recipe_and_differs_without_the_line(accelerate_run)


def test_accelerate_save_state_load_state_resume_equals_the_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    batches = _batches(RESUME_STEPS)
    expected, _ = recipe(batches)
    accelerator, model, optimizer = _accelerate_setup(line=True)
    _accelerate_train(accelerator, model, optimizer, batches[:2])
    accelerator.save_state(str(tmp_path / "state"))
    accelerator, model, optimizer = _accelerate_setup(line=True)  # a fresh process: built and wrapped again
    accelerator.load_state(str(tmp_path / "state"))
    _accelerate_train(accelerator, model, optimizer, batches[2:])
    assert equal(_state(model), expected)


# ------------------------------------------------------------------------------------------------ HF Trainer
transformers = pytest.importorskip("transformers")


class _Regressor(torch.nn.Module):
    """The oracle's network, as the Trainer calls a model: batch dict in, ``{"loss": ...}`` out. Its forward
    takes no ``**kwargs``, so the Trainer divides the loss by the accumulation steps itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": _mse(self.net(x), y)}


def _rows(batches: list) -> list[dict[str, torch.Tensor]]:
    """The batches as dataset rows, in order: with the sequential sampler and ``BATCH`` rows per batch, the
    Trainer's micro-batches are the oracle's."""
    return [{"x": row_x, "y": row_y} for step in batches for x, y in step for row_x, row_y in zip(x, y, strict=True)]


def trainer_run(
    batches: list, out: pathlib.Path, line: bool = True, resume: str | None = None, save_steps: int = 0
) -> tuple[Any, list[dict[str, Any]]]:
    from transformers import Trainer, TrainingArguments

    from gradscaler.frameworks import MasterWeightsCallback

    model = _Regressor().to(torch.bfloat16)
    args = TrainingArguments(
        output_dir=str(out), bf16=True, use_cpu=True, gradient_accumulation_steps=MICRO, max_grad_norm=CLIP,
        optim="adamw_torch", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0,
        max_steps=len(batches), per_device_train_batch_size=BATCH, train_sampling_strategy="sequential",
        dataloader_drop_last=True, logging_steps=1, report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
    )  # fmt: skip
    callbacks = [MasterWeightsCallback()] if line else []
    trainer = Trainer(model=model, args=args, train_dataset=_rows(batches), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs


def test_hf_trainer_bf16_equals_the_recipe_logs_its_norms_and_differs_without_the_line(tmp_path: pathlib.Path) -> None:
    """The oracle is the plain-torch recipe, which computes the Trainer's math: the same batches in the same
    order (sequential sampler), the loss divided by the accumulation steps, ``optim="adamw_torch"`` (torch's
    AdamW, default betas and eps, weight decay 0 in both of its groups), a constant learning rate, torch's
    ``clip_grad_norm_`` at ``max_grad_norm`` (Accelerate's, over ``model.parameters()``). The ``grad_norm``
    the Trainer logs is the recipe's norm of the float32 sums."""
    batches = _batches(STEPS)
    expected, expected_norms = recipe(batches)
    trainer, logs = trainer_run(batches, tmp_path / "line")
    assert trainer.accelerator.mixed_precision == "bf16"
    norms = [entry["grad_norm"] for entry in logs]
    assert len(norms) == STEPS
    _bites(norms)
    assert norms == [n.item() for n in expected_norms]
    got = _state(trainer.model)
    assert equal(got, expected) and _bfloat16(got)
    without, _ = trainer_run(batches, tmp_path / "without", line=False)
    assert not equal(_state(without.model), expected)


def test_hf_trainer_resume_from_checkpoint_equals_the_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    """A run saving every 2 steps; a fresh Trainer resumed from ``checkpoint-2`` ends where the uninterrupted
    run (and the recipe) ends; the checkpoint's model loads into a plain bfloat16 model: the recipe's after 2
    steps."""
    from safetensors.torch import load_file

    batches = _batches(RESUME_STEPS)
    expected, _ = recipe(batches)
    halfway, _ = recipe(batches[:2])
    trainer, uninterrupted = trainer_run(batches, tmp_path, save_steps=2)
    assert equal(_state(trainer.model), expected)
    checkpoint = tmp_path / "checkpoint-2"
    plain = _Regressor().to(torch.bfloat16)
    plain.load_state_dict(load_file(str(checkpoint / "model.safetensors")))
    assert _bfloat16(_state(plain)) and equal(_state(plain), halfway)
    resumed, logs = trainer_run(batches, tmp_path / "resumed", resume=str(checkpoint), save_steps=2)
    assert [entry["step"] for entry in logs] == [1, 2, 3, 4]  # steps 1 and 2: the checkpoint's log history
    assert [entry["grad_norm"] for entry in logs] == [entry["grad_norm"] for entry in uninterrupted]
    assert equal(_state(resumed.model), expected)


# ------------------------------------------------------------------------------------------------ Fabric
lightning = pytest.importorskip("lightning")


def _fabric_setup(line: bool) -> tuple[Any, Any, Any]:
    fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    with fabric.init_module():  # the parameters are bfloat16 when the optimizer is built
        model = _net()
    assert _bfloat16(list(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if line:
        optimizer = gradscaler.with_master_weights(optimizer)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _fabric_train(fabric: Any, model: Any, optimizer: Any, batches: list) -> list[torch.Tensor]:
    norms = []
    for step in batches:
        for x, y in step:
            fabric.backward(_mse(model(x), y) / MICRO)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=CLIP))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def fabric_run(batches: list, line: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    fabric, model, optimizer = _fabric_setup(line)
    norms = _fabric_train(fabric, model, optimizer, batches)
    return _state(model), norms


def test_fabric_bf16_true_equals_the_recipe_and_differs_without_the_line() -> None:
    equals_the_recipe_and_differs_without_the_line(fabric_run)


def test_fabric_save_load_resume_equals_the_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    batches = _batches(RESUME_STEPS)
    expected, _ = recipe(batches)
    fabric, model, optimizer = _fabric_setup(line=True)
    _fabric_train(fabric, model, optimizer, batches[:2])
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    fabric, model, optimizer = _fabric_setup(line=True)  # a fresh process
    fabric.load(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    _fabric_train(fabric, model, optimizer, batches[2:])
    assert equal(_state(model), expected)


# ------------------------------------------------------------------------------------------------ Lightning Trainer


def lightning_run(batches: list, line: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``precision="bf16-true"`` converts the module before ``configure_optimizers``; Lightning divides the
    loss by ``accumulate_grad_batches``, runs the last micro-batch's backward and the clipping inside the
    closure ``optimizer.step(closure)`` calls, and clips the optimizer's parameters (the masters). The norm
    is read in ``on_before_optimizer_step``, just before Lightning clips."""
    import lightning.pytorch as pl

    norms: list[torch.Tensor] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return _mse(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            assert _bfloat16(list(self.parameters()))
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)
            return gradscaler.with_master_weights(optimizer) if line else optimizer

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))

    xs = torch.cat([x for step in batches for x, _ in step])
    ys = torch.cat([y for step in batches for _, y in step])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH, shuffle=False)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="bf16-true", accumulate_grad_batches=MICRO,
        gradient_clip_val=CLIP, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader)
    assert trainer.global_step == len(batches)
    return _state(module.net), norms


def test_lightning_trainer_bf16_true_equals_the_recipe_and_differs_without_the_line() -> None:
    equals_the_recipe_and_differs_without_the_line(lightning_run)
