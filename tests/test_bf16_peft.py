"""``MasterWeightsCallback`` with a PEFT LoRA model through the HF Trainer (issue 45), on the CPU.

A tiny GPT-2 (``integration_helpers.tiny_gpt2``) cast to bfloat16 and wrapped with ``get_peft_model``: LoRA on
the attention's ``c_attn``, the base frozen. With ``autocast_adapter_dtype=False`` the adapters are bfloat16;
the Trainer (``bf16=True``, 4 micro-batches of gradient accumulation, a ``max_grad_norm`` that bites) with the
callback equals, bit for bit over the adapters, the recipe by hand of ``test_bf16_clients`` (float32 copies of
the trainable parameters, float32 sums, torch's ``clip_grad_norm_`` over them, AdamW over the copies, copied
back), and differs without the callback. With PEFT's default (``autocast_adapter_dtype=True``) the adapters are
float32: the callback binds nothing and says nothing, and the run is the run without it, bit for bit.

The oracle computes the Trainer's forward: GPT-2 takes ``**kwargs``, so the Trainer passes
``num_items_in_batch`` (the count of the step's labels over its 4 micro-batches,
``bf16_recipe.trainer_items``) and does not divide the loss itself; Accelerate runs the forward under
``torch.autocast("cpu", torch.bfloat16)``.
"""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import pytest
import torch

from bf16_recipe import equal, run, trainer_items

pytestmark = pytest.mark.integration

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradscaler.masters.checks import HELD_ATTR  # noqa: E402
from integration_helpers import fresh_accelerate_state, tiny_gpt2  # noqa: E402, F401 (an autouse fixture)

MICRO = 4  # micro-batches per optimizer step
STEPS = 3
BATCH = 2  # rows per micro-batch
SEQ = 8
VOCAB = 64  # tiny_gpt2's
CLIP = 0.02  # bites: the norms of the adapters' float32 sums are about 0.05
LR = 1e-2
TARGETS = ["c_attn"]


def peft_model(bf16_adapters: bool) -> Any:
    """The tiny GPT-2 in bfloat16 with LoRA adapters: bfloat16 ones (``autocast_adapter_dtype=False``) or
    PEFT's default float32 ones. Seeded (``tiny_gpt2`` seeds, the adapters' initialisation follows)."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, fan_in_fan_out=True, task_type="CAUSAL_LM"
    )  # fan_in_fan_out: GPT-2's Conv1D stores its weight transposed
    return peft.get_peft_model(tiny_gpt2().to(torch.bfloat16), config, autocast_adapter_dtype=not bf16_adapters)


def _trainable(model: Any) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _state(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _trainable(model)]


def _dtypes(model: Any) -> set[torch.dtype]:
    return {p.dtype for p in _trainable(model)}


def _batches(steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(MICRO)] for _ in range(steps)]


def recipe(batches: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The recipe by hand in plain torch over the trainable parameters; the adapters after the run and each
    step's norm."""
    model = peft_model(bf16_adapters=True)
    model.train()
    params = _trainable(model)
    assert params and all(p.dtype == torch.bfloat16 for p in params)

    def backward(step: list[torch.Tensor], ids: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # Accelerate's forward for bf16
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=trainer_items(step)).loss
        loss.backward()

    norms = run(params, batches, backward, CLIP, lr=LR, weight_decay=0.0)
    return _state(model), norms


def _rows(batches: list) -> list[dict[str, torch.Tensor]]:
    """The batches as dataset rows, in order: the sequential sampler and ``BATCH`` rows per batch give the
    Trainer the oracle's micro-batches."""
    return [{"input_ids": row, "labels": row} for step in batches for ids in step for row in ids]


def trainer_run(
    batches: list, out: pathlib.Path, line: bool = True, bf16_adapters: bool = True
) -> tuple[Any, list[float]]:
    from transformers import Trainer, TrainingArguments

    from gradscaler.frameworks import MasterWeightsCallback

    model = peft_model(bf16_adapters)
    assert _dtypes(model) == {torch.bfloat16 if bf16_adapters else torch.float32}
    args = TrainingArguments(
        output_dir=str(out), bf16=True, use_cpu=True, gradient_accumulation_steps=MICRO, max_grad_norm=CLIP,
        optim="adamw_torch", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0,
        max_steps=len(batches), per_device_train_batch_size=BATCH, train_sampling_strategy="sequential",
        dataloader_drop_last=True, logging_steps=1, report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0, save_strategy="no",
    )  # fmt: skip
    callbacks = [MasterWeightsCallback()] if line else []
    trainer = Trainer(model=model, args=args, train_dataset=_rows(batches), callbacks=callbacks)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(norms) == len(batches)
    return trainer, norms


def test_peft_bf16_adapters_equal_the_recipe_and_differ_without_the_callback(tmp_path: pathlib.Path) -> None:
    batches = _batches(STEPS)
    expected, expected_norms = recipe(batches)
    trainer, norms = trainer_run(batches, tmp_path / "line")
    assert all(n > CLIP for n in norms), f"the clipping must bite: {norms}"
    assert norms == [n.item() for n in expected_norms]
    got = _state(trainer.model)
    assert _dtypes(trainer.model) == {torch.bfloat16}
    assert equal(got, expected)
    without, _ = trainer_run(batches, tmp_path / "without", line=False)
    assert not equal(_state(without.model), expected)


def test_peft_float32_adapters_the_callback_does_nothing_and_says_nothing(tmp_path: pathlib.Path) -> None:
    batches = _batches(STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, norms = trainer_run(batches, tmp_path / "line", bf16_adapters=False)
    ours = [w for w in caught if "gradscaler" in str(w.message) or w.category.__module__.startswith("gradscaler")]
    assert not ours, [str(w.message) for w in ours]
    assert vars(trainer.optimizer.optimizer).get(HELD_ATTR) is None  # no masters bound
    assert _dtypes(trainer.model) == {torch.float32}
    without, norms_without = trainer_run(batches, tmp_path / "without", line=False, bf16_adapters=False)
    assert norms == norms_without
    assert equal(_state(trainer.model), _state(without.model))
    assert not equal(_state(trainer.model), _state(peft_model(bf16_adapters=False)))  # it trained
