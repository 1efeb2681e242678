"""The scale in the frameworks' own logs: the Trainer's ``report_to`` and Accelerate's trackers.

Both run down their CUDA fp16 path on the CPU, as tests/test_integration_hf.py drives them (see its
docstring): ``native_amp`` and gradscaler's scaler set where CUDA would have set them. The logs are
written by the real TensorBoard integrations and read back from the event files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import gradscaler
from integration_helpers import EARLY_OVERFLOW, adamw, mlp, poison_, regression_batches, tiny_gpt2

pytestmark = pytest.mark.integration
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from integration_helpers import fresh_accelerate_state  # noqa: E402, F401 (an autouse fixture: used by name)


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every event of ``tag`` under ``log_dir`` (its one run directory)."""
    runs = {p.parent for p in log_dir.rglob("events.out.tfevents.*")}
    assert len(runs) == 1, runs
    events = EventAccumulator(str(runs.pop()))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def f32(value: float) -> float:
    """``value`` as TensorBoard stores it (float32)."""
    return float(torch.tensor(value, dtype=torch.float32))


def test_accelerate_log_scale_reaches_the_tensorboard_tracker(tmp_path: Path) -> None:
    from gradscaler.frameworks import log_scale

    accelerator = accelerate.Accelerator(
        cpu=True, mixed_precision="fp16", log_with="tensorboard", project_dir=str(tmp_path)
    )
    accelerator.native_amp = True
    scaler = gradscaler.GradScaler("cpu", **EARLY_OVERFLOW)
    accelerator.scaler = scaler
    model = mlp()
    model, optimizer = accelerator.prepare(model, adamw(model.parameters(), True))
    accelerator.init_trackers("run")
    assert log_scale(accelerator) is accelerator and log_scale(accelerator) is accelerator  # idempotent
    expected = []
    for step, (x, y) in enumerate(regression_batches(10)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        if step == 7:
            poison_(model)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)  # the user's one logging line, unchanged
        expected.append((step, scaler.get_scale(), scaler.stats()["skipped_steps"]))
    accelerator.end_training()
    assert scalars(tmp_path, "amp/scale") == [(s, f32(scale)) for s, scale, _ in expected]
    assert scalars(tmp_path, "amp/skipped_steps") == [(s, float(n)) for s, _, n in expected]
    assert expected[-1][2] > 1  # early overflows and the poisoned step were counted
    assert [s for s, _ in scalars(tmp_path, "loss")] == list(range(10))


def test_log_scale_refuses_what_is_not_an_accelerator() -> None:
    from gradscaler.frameworks import log_scale

    with pytest.raises(TypeError, match=r"needs an accelerate\.Accelerator, got object"):
        log_scale(object())


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("position", ["alone", "after_another"])
def test_trainer_scale_log_callback_reaches_report_to_tensorboard(
    position: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Trainer(callbacks=[ScaleLogCallback()], report_to=["tensorboard"])``: the Trainer's own
    TensorBoard integration writes ``train/amp/scale`` and ``train/amp/skipped_steps`` at every log."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradscaler.frameworks import ScaleLogCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (24, 16), generator=g)]
    scaler = gradscaler.GradScaler("cpu", **EARLY_OVERFLOW)
    expected: list[tuple[int, float, int]] = []

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            expected.append((state.global_step, scaler.get_scale(), scaler.stats()["skipped_steps"]))

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, optim="adamw_torch_fused", learning_rate=1e-3,
        max_steps=12, per_device_train_batch_size=2, max_grad_norm=1.0, logging_steps=2,
        report_to=["tensorboard"], save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [ScaleLogCallback(), Recorder()] if position == "alone" else [Recorder(), ScaleLogCallback()]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    trainer.train()
    logged = [e for e in expected if e[0] % 2 == 0]
    assert scalars(tmp_path / "tb", "train/amp/scale") == [(s, f32(scale)) for s, scale, _ in logged]
    assert scalars(tmp_path / "tb", "train/amp/skipped_steps") == [(s, float(n)) for s, _, n in logged]
    assert logged[-1][2] >= 1 and len({scale for _, scale, _ in logged}) > 1  # the scale moved and steps skipped


def train_with_scale_log(tmp_path: Path, data: list[dict[str, torch.Tensor]], **logging: Any) -> tuple[Any, dict]:
    """12 fp16 Trainer steps of the tiny GPT-2 with our scaler and ``ScaleLogCallback``, checkpointed at
    step 12; returns the trainer and, by step, the (scale, skipped steps) the scaler held at its end."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradscaler.frameworks import ScaleLogCallback

    scaler = gradscaler.GradScaler("cpu", **EARLY_OVERFLOW)
    expected: dict[int, tuple[float, int]] = {}

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            expected[state.global_step] = (scaler.get_scale(), scaler.stats()["skipped_steps"])

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, optim="adamw_torch_fused", learning_rate=1e-3,
        max_steps=12, per_device_train_batch_size=2, max_grad_norm=1.0, report_to=[], save_strategy="steps",
        save_steps=12, disable_tqdm=True, seed=0, dataloader_num_workers=0, **logging,
    )  # fmt: skip
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[Recorder(), ScaleLogCallback()])
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    trainer.train()
    return trainer, expected


def test_trainer_scale_log_callback_reaches_log_history_and_trainer_state_json(tmp_path: Path) -> None:
    """What W&B, MLflow and the console show through the Trainer's reporters, and what a checkpoint
    keeps: ``trainer.state.log_history`` and the saved ``trainer_state.json`` hold the scale at each log."""
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (24, 16), generator=g)]
    trainer, expected = train_with_scale_log(tmp_path, data, logging_steps=3)
    training_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in training_logs] == [3, 6, 9, 12]
    for entry in training_logs:
        assert (entry["amp/scale"], entry["amp/skipped_steps"]) == expected[entry["step"]], entry
    assert all("amp/scale" not in entry for entry in trainer.state.log_history if "loss" not in entry)
    saved = json.loads((tmp_path / "out" / "checkpoint-12" / "trainer_state.json").read_text())
    keys = ("step", "loss", "amp/scale", "amp/skipped_steps")  # not grad_norm: NaN on a skipped step
    saved_logs = [entry for entry in saved["log_history"] if "loss" in entry]
    assert [[e[k] for k in keys] for e in saved_logs] == [[e[k] for k in keys] for e in training_logs]
    assert training_logs[-1]["amp/skipped_steps"] >= 1 and len({e["amp/scale"] for e in training_logs}) > 1


def test_trainer_scale_log_callback_keeps_the_scale_in_log_history_when_the_loss_is_nan(tmp_path: Path) -> None:
    """The logs a user reads when a run goes wrong: with ``logging_nan_inf_filter=False`` a NaN loss
    reaches the log (and stays NaN in every later one), and each of those entries in ``log_history``
    and ``trainer_state.json`` still holds the scale (NaN != NaN once dropped it from all of them)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (24, 16), generator=g)
    # Every label ignored in half the examples: a batch of two such examples has no token to average
    # over, and its loss is 0/0 (NaN); unfiltered, the running loss stays NaN from then on.
    data = [{"input_ids": x, "labels": torch.full_like(x, -100) if i >= 12 else x} for i, x in enumerate(ids)]
    trainer, expected = train_with_scale_log(tmp_path, data, logging_steps=1, logging_nan_inf_filter=False)
    training_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in training_logs] == list(range(1, 13))
    nan_logs = [entry["step"] for entry in training_logs if math.isnan(entry["loss"])]
    assert 1 < len(nan_logs) < 12, nan_logs  # the case under test is there, beside finite ones
    for entry in training_logs:
        assert (entry.get("amp/scale"), entry.get("amp/skipped_steps")) == expected[entry["step"]], entry
    saved = json.loads((tmp_path / "out" / "checkpoint-12" / "trainer_state.json").read_text())
    saved_logs = [entry for entry in saved["log_history"] if "loss" in entry]
    assert [(e["step"], e.get("amp/scale")) for e in saved_logs] == [(s, scale) for s, (scale, _) in expected.items()]
