"""``patch_torch(master_weights=True, accumulate_grads_in_fp32=True)`` in real clients' accumulation loops:
nanoGPT's micro-steps, Accelerate's ``accumulate()``, the HF Trainer's ``gradient_accumulation_steps``,
Lightning Fabric's ``no_backward_sync`` accumulation and the Lightning Trainer's ``accumulate_grad_batches``
(its AMP plugin given ``scaler=GradScaler(..., master_weights=True, accumulate_grads_in_fp32=True)``).

Each framework's code is unchanged and driven down its CUDA fp16 path on the CPU as in
tests/test_integration_masters.py, and equals the recipe by hand with float32 accumulation (an optimizer
over float32 copies, each backward's gradients added into them in float32: ``recipe.Fp32Copies``) bit for
bit, written into the same loop (the Trainer's: a subclass that overrides its optimizer, ``training_step``
and clipping; the Lightning Trainer's: a LightningModule whose hooks do the same).
"""

from __future__ import annotations

import io
import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import gradscaler
from gradscaler.masters import SAVED_KEY
from integration_helpers import (
    EARLY_OVERFLOW,
    TinyGPT,
    assert_bit_identical,
    fresh_accelerate_state,  # noqa: F401 (an autouse fixture)
    mlp,
    regression_batches,
    token_batches,
)
from recipe import Fp32Copies

pytestmark = pytest.mark.integration
MICRO = 4


def nanogpt_run(*, by_hand: bool, steps: int = 8, resume_at: int | None = None) -> dict[str, Any]:
    """nanoGPT's inner loop (``MICRO`` micro-steps, loss divided by their count, its clipping) on a
    bfloat16 TinyGPT; its scaler line is ``torch.amp.GradScaler(...)``, built while patched (or torch's
    own over the recipe's float32 copies)."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any, Fp32Copies | None]:
        torch.manual_seed(0)
        model = TinyGPT().to(torch.bfloat16)
        hand = Fp32Copies(model.parameters()) if by_hand else None
        optimizer = torch.optim.AdamW(hand.params() if hand else list(model.parameters()), lr=3e-3, fused=True)
        return model, optimizer, torch.amp.GradScaler("cpu", **EARLY_OVERFLOW), hand

    model, optimizer, scaler, hand = build()
    data = token_batches(MICRO * steps)
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
        for micro in range(MICRO):
            x, y = data[MICRO * it + micro]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
                loss = loss / MICRO
            scaler.scale(loss).backward()
            if hand:
                hand.accumulate()
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


def test_nanogpt_micro_steps_equal_the_recipe_with_float32_accumulation_and_resume() -> None:
    reference = nanogpt_run(by_hand=True)
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        run = nanogpt_run(by_hand=False)
        resumed = nanogpt_run(by_hand=False, resume_at=5)
    assert sum(reference["losses"][-MICRO:]) < sum(reference["losses"][:MICRO])
    assert_bit_identical(run, reference)
    assert_bit_identical(resumed, reference)


accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402


def accelerate_run(*, by_hand: bool, steps: int = 64) -> dict[str, Any]:
    """Accelerate's fp16 path with ``gradient_accumulation_steps=MICRO`` and ``accumulate()`` on a float16
    MLP: ``optimizer.step()`` and ``zero_grad()`` act on every ``MICRO``-th batch only."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=MICRO)
    accelerator.native_amp = True
    accelerator.scaler = scaler = torch.amp.GradScaler("cpu", **EARLY_OVERFLOW)
    model = mlp().half()
    hand = Fp32Copies(model.parameters()) if by_hand else None
    optimizer = torch.optim.AdamW(hand.params() if hand else model.parameters(), lr=1e-2, foreach=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, scales = [], []
    for x, y in regression_batches(steps):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
            accelerator.backward(loss)
            if hand:
                hand.accumulate()
            if accelerator.sync_gradients:
                if hand:
                    hand.move_grads()
                accelerator.clip_grad_norm_(hand.params() if hand else model.parameters(), 1.0)
            optimizer.step()
            if hand and accelerator.sync_gradients and not optimizer.step_was_skipped:
                hand.copy_back()
            optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def test_accelerate_accumulate_equals_the_recipe_with_float32_accumulation() -> None:
    reference = accelerate_run(by_hand=True)
    AcceleratorState._reset_state(True)
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        run = accelerate_run(by_hand=False)
    assert min(reference["scales"]) < EARLY_OVERFLOW["init_scale"]  # an overflow reached the float32 sums
    initial = mlp().half().state_dict()
    assert all(not torch.equal(v, initial[k]) for k, v in reference["params"].items())  # steps were applied
    assert_bit_identical(run, reference)


transformers = pytest.importorskip("transformers")


def trainer_run(tmp_path: Any, *, by_hand: bool, steps: int = 12) -> dict[str, Any]:
    """``Trainer(fp16=True, gradient_accumulation_steps=MICRO)`` on a tiny GPT-2 in float16, its scaler built
    by torch's spelling (``GradScaler`` while patched). By hand (``by_hand``), a Trainer subclass writes the
    recipe inside the Trainer's own loop: its optimizer (the Trainer's, with its weight-decay groups) steps
    float32 copies; after each ``training_step`` (forward and backward) each gradient is added into the
    copies in float32 and released; the Trainer's clipping (``accelerator.clip_grad_norm_(model.parameters())``)
    clips the copies instead; an applied step (the scale did not back off) is copied back."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from integration_helpers import tiny_gpt2

    model = tiny_gpt2().to(torch.float16)
    hand = Fp32Copies(model.parameters()) if by_hand else None
    scales: list[float] = []

    class RecipeTrainer(Trainer):
        def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
            optimizer = super().create_optimizer(model)
            assert hand is not None
            copy_of = {id(p): c for p, c in hand.pairs}
            for group in optimizer.param_groups:
                group["params"] = [copy_of.get(id(p), p) for p in group["params"]]
            return optimizer

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            assert hand is not None
            hand.accumulate()
            return loss

        def _clip_grad_norm(self, model: nn.Module) -> Any:
            assert hand is not None
            hand.move_grads()
            return self.accelerator.clip_grad_norm_(hand.params(), self.args.max_grad_norm)

    class Record(TrainerCallback):
        before = 0.0

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.before = scaler.get_scale()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if hand and scaler.get_scale() >= self.before:  # applied: torch's rule backs off on every skip
                hand.copy_back()
            scales.append(scaler.get_scale())

    ids = torch.randint(0, 8, (4, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[i % 4], "labels": ids[i % 4]} for i in range(steps * 2 * MICRO)]
    args = TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, optim="adamw_torch_fused", learning_rate=3e-3,
        weight_decay=0.01, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=MICRO,
        max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = (RecipeTrainer if by_hand else Trainer)(model=model, args=args, train_dataset=data, callbacks=[Record()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", **EARLY_OVERFLOW)
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    trainer.train()
    history = trainer.state.log_history
    return {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "norms": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
        "scales": scales,
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [p.grad for p in model.parameters()],
        "scaler": scaler,
    }


def test_hf_trainer_gradient_accumulation_steps_equals_the_recipe_with_float32_accumulation(tmp_path: Any) -> None:
    """The unchanged Trainer under the patch: its ``model.zero_grad()``, its clipping over
    ``model.parameters()`` (the float32 sums' norm, logged) and Accelerate's step, bit for bit the recipe."""
    from integration_helpers import tiny_gpt2

    reference = trainer_run(tmp_path / "hand", by_hand=True)
    AcceleratorState._reset_state(True)
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        run = trainer_run(tmp_path / "ours", by_hand=False)
    scaler = run.pop("scaler")
    reference.pop("scaler")
    assert isinstance(scaler, gradscaler.GradScaler) and scaler.stats()["steps"] == 12
    assert min(reference["scales"]) < EARLY_OVERFLOW["init_scale"]  # an overflow reached the float32 sums
    assert 0 < scaler.stats()["skipped_steps"] < 12
    initial = tiny_gpt2().half().state_dict()
    assert all(not torch.equal(v, initial[k]) for k, v in reference["params"].items())  # steps were applied
    assert sum(reference["losses"][-3:]) < sum(reference["losses"][:3]), reference["losses"]
    assert len(run["norms"]) == 12 and any(n == n and n > 1.0 for n in run["norms"])  # finite, clipped
    assert all(grad is None for grad in run["grads"])
    assert_bit_identical(run, reference)


def resumable_trainer_run(out: str, *, save_at: int | None = None, resume: str | None = None) -> dict[str, Any]:
    """The unchanged Trainer under the patch (float16 tiny GPT-2, ``gradient_accumulation_steps=MICRO``, 16
    steps, a checkpoint every ``save_at`` steps, or resumed from ``resume``): the parameters and the scale after
    each optimizer step, by global step."""
    from accelerate.state import GradientState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from integration_helpers import tiny_gpt2

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = tiny_gpt2().to(torch.float16)
    after: dict[int, tuple[dict[str, torch.Tensor], float]] = {}

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            params = {k: v.detach().clone() for k, v in model.state_dict().items()}
            after[state.global_step] = (params, scaler.get_scale())

    ids = torch.randint(0, 8, (4, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[i % 4], "labels": ids[i % 4]} for i in range(16 * 2 * MICRO)]
    args = TrainingArguments(
        output_dir=out, fp16=True, use_cpu=True, optim="adamw_torch_fused", learning_rate=3e-3, max_steps=16,
        per_device_train_batch_size=2, gradient_accumulation_steps=MICRO, max_grad_norm=1.0, report_to=[],
        save_strategy="steps" if save_at else "no", save_steps=save_at or 1, disable_tqdm=True, seed=0,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Record()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", **EARLY_OVERFLOW)
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    trainer.train(resume_from_checkpoint=resume)
    return after


def test_hf_trainer_resume_from_checkpoint_equals_the_uninterrupted_run(tmp_path: Any) -> None:
    """``Trainer.train(resume_from_checkpoint=...)`` after step 10 (four applied steps before it: the masters are
    no longer the float16 weights) goes on as the run that saved, bit for bit: the masters travel in the
    Trainer's optimizer.pt. Without them (the key taken out of the checkpoint) the resumed run differs."""
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        full = resumable_trainer_run(str(tmp_path / "full"), save_at=10)
        checkpoint = tmp_path / "full" / "checkpoint-10"
        resumed = resumable_trainer_run(str(tmp_path / "resumed"), resume=str(checkpoint))
        saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        assert all(SAVED_KEY in group for group in saved["param_groups"])
        for group in saved["param_groups"]:
            del group[SAVED_KEY]
        torch.save(saved, checkpoint / "optimizer.pt")
        stripped = resumable_trainer_run(str(tmp_path / "stripped"), resume=str(checkpoint))
    assert sorted(resumed) == list(range(11, 17))
    assert len({full[step][1] for step in range(1, 11)}) > 1  # steps were skipped and applied before the save
    for step in range(11, 17):
        assert_bit_identical(resumed[step], full[step], f"step {step}")
    assert any(not torch.equal(stripped[16][0][k], full[16][0][k]) for k in full[16][0])


lightning = pytest.importorskip("lightning")


def fabric_run(*, by_hand: bool, steps: int = 10) -> dict[str, Any]:
    """Lightning Fabric with ``precision="16-true"`` (a float16 model, no scaler of its own) and gradient
    accumulation as Fabric writes it: ``no_backward_sync`` on all but the last of ``MICRO`` micro-batches,
    then the step; the scaler is the user's own (``GradScaler`` while patched, or torch's over the
    recipe's float32 copies)."""
    fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="16-true")
    model = fabric.setup_module(mlp(0))
    hand = Fp32Copies(model.parameters()) if by_hand else None
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(hand.params() if hand else model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", **EARLY_OVERFLOW)
    batches = regression_batches(steps * MICRO)
    losses, scales = [], []
    for step in range(steps):
        for micro in range(MICRO):
            x, y = batches[step * MICRO + micro]
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                loss = torch.nn.functional.mse_loss(model(x), y) / MICRO
                fabric.backward(scaler.scale(loss))
            if hand:
                hand.accumulate()
            losses.append(loss.item())
        if hand:
            hand.move_grads()
        scaler.step(optimizer)
        if hand and not sum(f.item() for f in scaler._found_inf_per_device(optimizer).values()):
            hand.copy_back()
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def test_lightning_fabric_accumulation_equals_the_recipe_with_float32_accumulation() -> None:
    reference = fabric_run(by_hand=True)
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        run = fabric_run(by_hand=False)
    assert min(reference["scales"]) < EARLY_OVERFLOW["init_scale"]
    assert all(v.dtype == torch.float16 for v in reference["params"].values())
    initial = mlp(0).half().state_dict()
    assert all(not torch.equal(v, initial[k]) for k, v in reference["params"].items())
    assert_bit_identical(run, reference)


def lightning_trainer_run(tmp_path: Any, *, by_hand: bool, fused: bool, steps: int = 12) -> dict[str, Any]:
    """``pl.Trainer(accumulate_grad_batches=MICRO)`` with the AMP plugin ``MixedPrecision("16-mixed", "cpu",
    scaler=...)`` on a LightningModule whose network is float16; Lightning divides each loss by ``MICRO``,
    clears the gradients (``optimizer.zero_grad()``) before the first backward of a window and runs the
    last micro-batch inside ``optimizer_step`` (its closure), then ``unscale_``, ``on_before_optimizer_step``,
    its clipping (to 0.2) over the optimizer's parameters (not with a fused optimizer: Lightning refuses it), the
    scaler's ``step`` and ``update``. Ours: ``scaler=GradScaler("cpu", master_weights=True,
    accumulate_grads_in_fp32=True)``, the module unchanged. By hand: torch's scaler, ``configure_optimizers``
    over the float32 copies, each backward's gradients added into them in ``on_after_backward`` (Lightning's
    hook after every backward), the window closed in ``on_before_optimizer_step`` (every parameter gets a
    gradient in each micro-batch here, so closing it after ``unscale_`` changes no copy's gradient), and an
    applied step (the scale did not back off) copied back after ``optimizer_step``."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    net = mlp(0).half()
    hand = Fp32Copies(net.parameters()) if by_hand else None
    if hand:
        scaler: Any = torch.amp.GradScaler("cpu", **EARLY_OVERFLOW)
    else:
        scaler = gradscaler.GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True, **EARLY_OVERFLOW)
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    scales: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            losses.append(loss.detach().clone())
            return loss

        def on_after_backward(self) -> None:
            if hand:
                hand.accumulate()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if hand:
                hand.move_grads()
            if fused:  # no unscale_ before the step: in the first window nothing has met the optimizer yet
                return
            trained = [p for g in optimizer.param_groups for p in g["params"]]
            assert all(p.dtype == torch.float32 for p in trained)  # the copies, or our masters
            grads = [p.grad.float() for p in trained if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            before = scaler.get_scale()
            super().optimizer_step(*args, **kwargs)
            if hand and scaler.get_scale() >= before:  # applied: torch's rule backs off on every skip
                hand.copy_back()
            scales.append(scaler.get_scale())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            params = hand.params() if hand else list(self.parameters())
            flags = {"fused": True} if fused else {"foreach": True}
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, **flags)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=MICRO,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], gradient_clip_val=None if fused else 0.2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(regression_batches(steps * MICRO), batch_size=None))
    return {
        "losses": losses,
        "norms": norms,
        "scales": scales,
        "params": {k: v.clone() for k, v in net.state_dict().items()},
        "grads": [p.grad for p in net.parameters()],
    }


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-clip", "fused"])
def test_lightning_trainer_accumulate_grad_batches_equals_the_recipe_with_float32_accumulation(
    tmp_path: Any, fused: bool
) -> None:
    reference = lightning_trainer_run(tmp_path / "hand", by_hand=True, fused=fused)
    run = lightning_trainer_run(tmp_path / "ours", by_hand=False, fused=fused)
    assert len(reference["losses"]) == 12 * MICRO and len(reference["scales"]) == 12
    assert min(reference["scales"]) < EARLY_OVERFLOW["init_scale"]  # an overflow reached the float32 sums
    assert any(s2 >= s1 for s1, s2 in itertools.pairwise(reference["scales"]))  # and steps were applied
    initial = mlp(0).half().state_dict()
    assert all(v.dtype == torch.float16 and not torch.equal(v, initial[k]) for k, v in reference["params"].items())
    if not fused:  # the clip bites: some finite norm above the limit (taken after unscale_, before the clip)
        assert any(n.isfinite() and n > 0.2 for n in reference["norms"]), reference["norms"]
    assert all(grad is None for grad in run["grads"])
    assert_bit_identical(run, reference)
