"""Hugging Face Accelerate and Trainer, driven down their CUDA fp16 code path on the CPU.

On a GPU, ``Accelerator(mixed_precision="fp16")`` sets ``native_amp = True`` and builds
``torch.amp.GradScaler("cuda")``; ``prepare(model)`` then wraps the forward in
``torch.autocast(device, float16)``, ``backward`` scales the loss, ``clip_grad_norm_`` unscales first and
the ``AcceleratedOptimizer`` steps through the scaler. On the CPU Accelerate keeps
``mixed_precision == "fp16"`` but leaves ``native_amp = False`` and no scaler: the run is plain float32.
The tests set the two attributes the GPU path would have set, before ``prepare``:
``accelerator.native_amp = True`` and ``accelerator.scaler = <scaler>("cpu", ...)``; every line of
Accelerate and of the Trainer that runs afterwards is the CUDA path's, with autocast on the CPU.
"""

from __future__ import annotations

import contextlib
import warnings
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
    mlp,
    poison_,
    regression_batches,
    tiny_gpt2,
)

pytestmark = pytest.mark.integration
accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402

from integration_helpers import fresh_accelerate_state  # noqa: E402, F401 (an autouse fixture: used by name)


def gpu_path_accelerator(scaler: Any) -> Any:
    """An Accelerator that runs its CUDA fp16 code path on the CPU (see the module docstring)."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.scaler is None and not accelerator.native_amp  # the CPU's silent fp32 fallback
    accelerator.native_amp = True
    accelerator.scaler = scaler  # before prepare(): the AcceleratedOptimizer keeps this reference
    return accelerator


def accelerate_run(
    scaler: Any, *, fused: bool, clip: bool, steps: int = 12, poison_at: int = 9, truthful: bool = False
) -> Record:
    accelerator = gpu_path_accelerator(scaler)
    model = mlp()
    optimizer = adamw(model.parameters(), fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    if truthful:
        from gradscaler.frameworks import report_skipped_steps

        report_skipped_steps(accelerator)
    record = Record(extra={"skipped": [], "lr": []})
    for step, (x, y) in enumerate(regression_batches(steps)):
        loss = torch.nn.functional.mse_loss(model(x), y)  # autocast inside the prepared forward
        accelerator.backward(loss)
        if step == poison_at:
            poison_(model)
        if clip:
            record.norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        record.losses.append(loss.detach().clone())
        record.scales.append(scaler.get_scale())
        record.extra["skipped"].append(accelerator.optimizer_step_was_skipped)
        record.extra["lr"].append(optimizer.param_groups[0]["lr"])
    return record.finish(model, optimizer)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
def test_accelerate_is_bit_identical_to_torchs_scaler(fused: bool, clip: bool) -> None:
    """Skip flags Accelerate reports and the LR schedule it holds on them are part of the record.

    fused: needs the scaler owner's change (``optimizer.step`` called on the iterations torch calls it)."""
    records = {
        name: accelerate_run(cls("cpu", **EARLY_OVERFLOW), fused=fused, clip=clip)
        for name, cls in SCALER_CLASSES.items()
    }
    assert records["torch"].scales[0] < EARLY_OVERFLOW["init_scale"]
    assert records["torch"].scales[9] == records["torch"].scales[8] / 2
    assert_bit_identical(records["torch"], records["ours"])


def test_report_skipped_steps_makes_accelerate_see_fused_skips() -> None:
    """Opt-in: with a fused optimizer torch's protocol hides skips from Accelerate (step_was_skipped
    False, the schedule advances: see the fused case above); report_skipped_steps tells it the truth,
    which is what Accelerate sees natively with a non-fused optimizer (not called when skipped)."""
    truthful_scaler = gradscaler.GradScaler("cpu", **EARLY_OVERFLOW)
    truthful = accelerate_run(truthful_scaler, fused=True, clip=True, truthful=True)
    AcceleratorState._reset_state(True)
    native = accelerate_run(torch.amp.GradScaler("cpu", **EARLY_OVERFLOW), fused=False, clip=True)
    assert truthful.extra["skipped"] == native.extra["skipped"]
    assert sum(truthful.extra["skipped"]) == truthful_scaler.stats()["skipped_steps"] > 1
    assert truthful.extra["lr"] == native.extra["lr"]
    assert truthful.scales == native.scales


def test_report_skipped_steps_refuses_torchs_scaler_and_is_idempotent() -> None:
    from gradscaler.frameworks import report_skipped_steps

    accelerator = gpu_path_accelerator(torch.amp.GradScaler("cpu"))
    model = mlp()
    _, optimizer = accelerator.prepare(model, adamw(model.parameters(), True))
    with pytest.raises(TypeError, match="gradscaler's GradScaler"):
        report_skipped_steps(optimizer)
    optimizer.scaler = gradscaler.GradScaler("cpu")
    report_skipped_steps(optimizer)
    first = optimizer.__dict__["step"]
    assert report_skipped_steps(optimizer) is optimizer and optimizer.__dict__["step"] is first


def test_report_skipped_steps_before_prepare_says_to_call_it_after() -> None:
    """It patches the optimizers prepared so far: before prepare() there are none, and it used to do nothing."""
    from gradscaler.frameworks import report_skipped_steps

    accelerator = gpu_path_accelerator(gradscaler.GradScaler("cpu"))
    with pytest.raises(
        ValueError,
        match=r"^Call report_skipped_steps\(accelerator\) after `accelerator\.prepare\(.*no prepared optimizer",
    ):
        report_skipped_steps(accelerator)
    model = mlp()
    _, optimizer = accelerator.prepare(model, adamw(model.parameters(), True))
    assert report_skipped_steps(accelerator) is accelerator and "step" in optimizer.__dict__


def test_accelerate_fsdp1_builds_torchs_sharded_scaler_under_patch_torch_and_the_helpers_say_so() -> None:
    """Accelerate's FSDP (v1) path builds ShardedGradScaler, torch's subclass, which the patch leaves alone."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from accelerate.utils import DistributedType, get_grad_scaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from gradscaler.frameworks import report_skipped_steps

    with gradscaler.patch_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" on this machine
        sharded = get_grad_scaler(DistributedType.FSDP)
    assert type(sharded) is ShardedGradScaler and not isinstance(sharded, gradscaler.GradScaler)
    accelerator = gpu_path_accelerator(sharded)
    model = mlp()
    accelerator.prepare(model, adamw(model.parameters(), True))
    with pytest.raises(TypeError, match=r"FSDP \(version 1\) path builds torch's ShardedGradScaler, which gradscaler"):
        report_skipped_steps(accelerator)


def test_accelerate_get_grad_scaler_builds_ours_under_patch_torch() -> None:
    """Accelerate builds its scaler with ``torch.amp.GradScaler("cuda", **kwargs)`` (get_grad_scaler)."""
    from accelerate.utils import get_grad_scaler

    with gradscaler.patch_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" on this machine
        scaler = get_grad_scaler(init_scale=2.0**10)
    assert type(scaler) is gradscaler.GradScaler and scaler._device == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert type(get_grad_scaler()) is not gradscaler.GradScaler


def test_trap_scaler_set_after_prepare_is_never_used_for_the_step() -> None:
    """The trap in docs/integrations.md: prepare() hands the optimizer the scaler it has then.

    On the CPU that is None: backward scales by ours, the optimizer steps on scaled gradients, and the
    first overflow writes inf/NaN into the weights silently. (On a GPU it is torch's scaler, which has
    never scaled a loss: its step raises AssertionError "_scale is None".)"""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.native_amp = True
    model = mlp()
    model, optimizer = accelerator.prepare(model, adamw(model.parameters(), False))
    accelerator.scaler = gradscaler.GradScaler("cpu", init_scale=2.0**24)  # too late
    for x, y in regression_batches(2):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_trap_cpu_fp16_is_fp32_and_clip_grad_norm_sees_scaled_gradients() -> None:
    """On the CPU ``mixed_precision="fp16"`` gives no autocast and no scaler (fp32 training, no
    warning); a scaler set by hand without ``native_amp`` is used by backward but not unscaled by
    ``clip_grad_norm_``, which then clips (and reports) gradients still multiplied by the scale."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None
    model = accelerator.prepare(mlp())
    x, y = regression_batches(1)[0]
    assert model(x).dtype == torch.float32
    reference = mlp()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    accelerator.scaler = gradscaler.GradScaler("cpu", init_scale=2.0**8)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    reported = accelerator.clip_grad_norm_(model.parameters(), float("inf"))
    torch.testing.assert_close(reported, true_norm * 2.0**8)


# ------------------------------------------------------------------------------------ HF Trainer
transformers = pytest.importorskip("transformers")


def trainer_run(
    scaler: Any, tmp_path: Any, *, steps: int = 24, callbacks: list[Any] | None = None, optim: str = "adamw_torch_fused"
) -> Record:
    """``Trainer(fp16=True, optim=...)`` on a 2-layer, 32-dim GPT-2, down the CUDA fp16 path (module
    docstring): after the Trainer built its Accelerator, ``native_amp`` and the scaler are set as CUDA
    would have set them; ``train()`` prepares the model and optimizer afterwards."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (steps * 2, 16), generator=g)]
    record = Record(extra={"lr": []})

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.scales.append(scaler.get_scale())

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, optim=optim, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=2, max_steps=steps, per_device_train_batch_size=2,
        max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0,
    )  # fmt: skip
    assert isinstance(args, TrainingArguments)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Recorder(), *(callbacks or [])])
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == steps
    record.losses = [entry["loss"] for entry in logs]
    record.norms = [entry["grad_norm"] for entry in logs]
    record.extra["lr"] = [entry["learning_rate"] for entry in logs]
    return record.finish(trainer.model, trainer.optimizer.optimizer)


def test_hf_trainer_fused_adamw_is_bit_identical_to_torchs_scaler(tmp_path: Any) -> None:
    """The acceptance case of issue 11: tiny GPT-2, adamw_torch_fused, init_scale 2**24, growth
    interval 4, 24 steps. Needs the scaler owner's change (fused optimizer called on skipped steps,
    as torch calls it): before it, the LR schedule differs from step 8 on."""
    records = {name: trainer_run(cls("cpu", **EARLY_OVERFLOW), tmp_path / name) for name, cls in SCALER_CLASSES.items()}
    scales = records["torch"].scales
    assert scales[0] < EARLY_OVERFLOW["init_scale"] and max(scales[8:]) > min(scales)
    assert_bit_identical(records["torch"], records["ours"])


def test_hf_trainer_skipped_steps_callback_holds_the_schedule_on_skipped_steps(tmp_path: Any) -> None:
    """Opt-in: with SkippedStepsCallback the Trainer steps its LR schedule only after real steps."""
    from transformers import TrainerCallback

    from gradscaler.frameworks import SkippedStepsCallback

    scaler = gradscaler.GradScaler("cpu", **EARLY_OVERFLOW)
    skipped: list[bool] = []

    class Skips(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            skipped.append(scaler.last_step_skipped())

    record = trainer_run(scaler, tmp_path, steps=10, callbacks=[SkippedStepsCallback(), Skips()])
    assert sum(skipped) == scaler.stats()["skipped_steps"] > 1
    lrs = record.extra["lr"]  # logged before the step's scheduler call: moves after each real step only
    assert [lrs[i] != lrs[i - 1] for i in range(1, len(lrs))] == [not s for s in skipped[:-1]]


def test_hf_trainer_skipped_steps_callback_with_torchs_scaler_says_to_patch_before_trainer(tmp_path: Any) -> None:
    """Without patch_torch() the Trainer's scaler is torch's (on a GPU): the first optimizer step says what to do."""
    from gradscaler.frameworks import SkippedStepsCallback

    with pytest.raises(TypeError, match=r"call gradscaler\.patch_torch\(\) before Trainer\(\.\.\.\)"):
        trainer_run(torch.amp.GradScaler("cpu"), tmp_path, steps=2, callbacks=[SkippedStepsCallback()])


def cpu_half_trainer(tmp_path: Any, recipe: bool, patched: bool = False) -> list[float]:
    """A float16 tiny GPT-2 under ``Trainer(fp16=True)`` on the CPU; ``recipe``: docs/integrations.md's
    way to train it there (the patch for the Trainer's clipping, CPU fp16 back on, a scaler with masters)."""
    from transformers import Trainer, TrainingArguments

    model = tiny_gpt2().to(torch.float16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (4, 16), generator=g)  # a few sequences, repeated: the loss can fall
    data = [{"input_ids": ids[i % 4], "labels": ids[i % 4]} for i in range(40)]
    args = TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, optim="adamw_torch_fused", learning_rate=3e-3,
        max_steps=20, per_device_train_batch_size=2, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    with gradscaler.patch_torch(master_weights=True) if recipe or patched else contextlib.nullcontext():
        trainer = Trainer(model=model, args=args, train_dataset=data)
        assert trainer.accelerator.scaler is None and not trainer.accelerator.native_amp  # Accelerate's CPU fallback
        if recipe:
            trainer.accelerator.native_amp = True
            trainer.accelerator.scaler = gradscaler.GradScaler("cpu", master_weights=True)
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_trap_cpu_fp16_float16_model_trains_in_float16_unscaled_and_the_documented_recipe_trains_it(
    tmp_path: Any, patched: bool
) -> None:
    """docs/integrations.md: on the CPU, ``fp16=True`` keeps a float32 model in float32, but a float16
    model steps in float16 with no scaler (patched or not): it breaks within a few steps and logs loss 0.0."""
    broken = cpu_half_trainer(tmp_path / "broken", recipe=False, patched=patched)
    assert broken[-1] == 0.0 and broken[0] > 1.0, broken
    trained = cpu_half_trainer(tmp_path / "trained", recipe=True)
    assert all(0.0 < loss == loss for loss in trained) and sum(trained[-4:]) < 0.75 * sum(trained[:4]), trained
