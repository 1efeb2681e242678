"""float16 models under ``patch_torch(master_weights=True)``: nanoGPT's loop, Accelerate and the HF Trainer.

Each framework's code is unchanged and driven down its CUDA fp16 path on the CPU as in
tests/test_integration_hf.py. With torch's scaler a float16 model raises "Attempting to unscale FP16
gradients."; under the patch the same code trains through float32 masters, the loss goes down, and
where the framework lets the recipe be written by hand (an optimizer over float32 copies, gradients
copied after backward, parameters copied back after the step) the run equals it bit for bit.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradscaler
from integration_helpers import (
    EARLY_OVERFLOW,
    TinyGPT,
    assert_bit_identical,
    fresh_accelerate_state,  # noqa: F401 (an autouse fixture)
    mlp,
    regression_batches,
    tiny_gpt2,
    token_batches,
)
from recipe import Copies

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- nanoGPT-style loop
def nanogpt_half_run(*, by_hand: bool, fused: bool, steps: int = 12, resume_at: int | None = None) -> dict[str, Any]:
    """nanoGPT's inner loop (2 micro-steps, its clipping) on a float16 TinyGPT; its scaler line is
    ``torch.amp.GradScaler(...)``, built while patched (or torch's own, by hand)."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any, Copies | None]:
        torch.manual_seed(0)
        model = TinyGPT().half()
        hand = Copies(model.parameters()) if by_hand else None
        params = hand.params() if hand else list(model.parameters())
        flags = {"fused": True} if fused else {"foreach": True}
        optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, **flags)
        return model, optimizer, torch.amp.GradScaler("cpu", **EARLY_OVERFLOW), hand

    model, optimizer, scaler, hand = build()
    data = token_batches(2 * steps)
    losses, scales = [], []
    for it in range(steps):
        if it == resume_at:
            buffer = io.BytesIO()
            torch.save({"m": model.state_dict(), "o": optimizer.state_dict(), "s": scaler.state_dict()}, buffer)
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            model, optimizer, scaler, hand = build()
            model.load_state_dict(checkpoint["m"])
            optimizer.load_state_dict(checkpoint["o"])
            scaler.load_state_dict(checkpoint["s"])
        for micro in range(2):
            x, y = data[2 * it + micro]
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
                loss = loss / 2
            scaler.scale(loss).backward()
            losses.append(loss.item())
        if hand:
            hand.move_grads()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(hand.params() if hand else model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if hand:
            hand.copy_back()
        scales.append(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "scales": scales, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def test_torchs_scaler_refuses_the_float16_model() -> None:
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\.$"):
        nanogpt_half_run(by_hand=False, fused=False, steps=1)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_nanogpt_float16_model_under_patch_equals_the_recipe_by_hand_and_resumes(fused: bool) -> None:
    reference = nanogpt_half_run(by_hand=True, fused=fused)
    with gradscaler.patch_torch(master_weights=True):
        run = nanogpt_half_run(by_hand=False, fused=fused)
        resumed = nanogpt_half_run(by_hand=False, fused=fused, resume_at=7)
    assert reference["scales"][0] < EARLY_OVERFLOW["init_scale"]
    assert sum(reference["losses"][-4:]) < sum(reference["losses"][2:6])  # after the overflowing steps
    assert_bit_identical(run, reference)
    assert_bit_identical(resumed, reference)


# ------------------------------------------------------------------------------------ Accelerate
accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402


def accelerate_half_run(make_scaler: Callable[[], Any], *, by_hand: bool, steps: int = 16) -> dict[str, Any]:
    """Accelerate's fp16 path (``native_amp`` and the scaler set as CUDA would) on a float16 MLP."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.native_amp = True
    accelerator.scaler = scaler = make_scaler()
    model = mlp().half()
    hand = Copies(model.parameters()) if by_hand else None
    optimizer = torch.optim.AdamW(hand.params() if hand else model.parameters(), lr=1e-2, foreach=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, scales = [], []
    for x, y in regression_batches(steps):
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        accelerator.backward(loss)
        if hand:
            hand.move_grads()
        accelerator.clip_grad_norm_(hand.params() if hand else model.parameters(), 1.0)
        optimizer.step()
        if hand:
            hand.copy_back()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def test_accelerate_float16_model_under_patch_equals_the_recipe_by_hand() -> None:
    make = lambda: torch.amp.GradScaler("cpu", **EARLY_OVERFLOW)  # noqa: E731
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\.$"):
        accelerate_half_run(make, by_hand=False, steps=1)
    AcceleratorState._reset_state(True)
    reference = accelerate_half_run(make, by_hand=True)
    AcceleratorState._reset_state(True)
    with gradscaler.patch_torch(master_weights=True):
        run = accelerate_half_run(make, by_hand=False)
    assert reference["scales"][0] < EARLY_OVERFLOW["init_scale"]
    assert sum(reference["losses"][-4:]) < sum(reference["losses"][4:8])
    assert_bit_identical(run, reference)


# ------------------------------------------------------------------------------------ HF Trainer
transformers = pytest.importorskip("transformers")


def trainer_half_run(
    tmp_path: Any,
    steps: int = 30,
    *,
    model: nn.Module | None = None,
    optim: str = "adamw_torch_fused",
    init_scale: float = 2.0**16,
    callbacks: tuple[Any, ...] = (),
) -> tuple[list[float], Any]:
    """``Trainer(fp16=True)`` on a tiny GPT-2 cast to float16 (or ``model``), its scaler built by torch's spelling."""
    from transformers import Trainer, TrainingArguments

    model = tiny_gpt2().to(torch.float16) if model is None else model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (4, 16), generator=g)  # a few sequences, repeated: the loss can fall
    data = [{"input_ids": ids[i % 4], "labels": ids[i % 4]} for i in range(steps * 2)]
    args = TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, optim=optim, learning_rate=3e-3,
        max_steps=steps, per_device_train_batch_size=2, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], scaler


def test_hf_trainer_float16_model_trains_under_patch(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\.$"):
        trainer_half_run(tmp_path / "torch", steps=1)
    with gradscaler.patch_torch(master_weights=True):
        losses, scaler = trainer_half_run(tmp_path / "ours")
    assert isinstance(scaler, gradscaler.GradScaler)
    assert all(loss == loss for loss in losses)  # no NaN logged
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    assert scaler.stats()["steps"] == 30


def test_hf_trainer_leaves_a_dropped_layer_alone_on_the_steps_it_sits_out(tmp_path: Any) -> None:
    """LayerDrop in the real Trainer (which clears gradients with ``model.zero_grad()``): the second
    block is skipped on every other step, and on those steps its float16 weights must not move, as with
    float32 weights or the recipe by hand (before, its master was stepped with the last gradient it had)."""
    from transformers import TrainerCallback

    model = tiny_gpt2().to(torch.float16)
    block = model.transformer.h[1]
    calls = {"forward": 0}

    def layerdrop(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        calls["forward"] += 1
        if calls["forward"] % 2 == 1:
            return output  # used
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden  # dropped: no gradient

    block.register_forward_hook(layerdrop, with_kwargs=True)
    snapshots: list[list[torch.Tensor]] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            snapshots.append([p.detach().clone() for p in block.parameters()])

    with gradscaler.patch_torch(master_weights=True):
        _, scaler = trainer_half_run(
            tmp_path, 8, model=model, optim="adamw_torch", init_scale=2.0**10, callbacks=(Snapshot(),)
        )
    assert calls["forward"] == 8 and len(snapshots) == 8
    assert scaler.stats()["skipped_steps"] == 0
    for step in range(1, 8):
        same = all(torch.equal(a, b) for a, b in zip(snapshots[step], snapshots[step - 1], strict=True))
        assert same == (step % 2 == 1), f"step {step}: the block {'moved' if not same else 'stood still'}"
