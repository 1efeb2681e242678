"""``MasterWeightsCallback`` with TRL's ``SFTTrainer`` (issue 45), on the CPU.

The tiny GPT-2 of ``integration_helpers.tiny_gpt2`` cast to bfloat16, trained in full by ``SFTTrainer`` (TRL runs
the HF Trainer's loop) with ``bf16=True``, 4 micro-batches of gradient accumulation and a ``max_grad_norm`` that
bites, on a tiny in-memory dataset already tokenised (``datasets.Dataset.from_dict``; a word-level tokenizer built
in memory gives TRL its pad and EOS tokens). With the callback the run equals, bit for bit, the recipe by hand of
``test_bf16_clients`` (float32 copies, float32 sums, torch's ``clip_grad_norm_`` over them, AdamW over the copies,
copied back); without it, it differs.

The oracle computes TRL's forward: ``SFTTrainer`` patches the model with its fused LM head
(``trl.trainer.utils.add_fused_lm_head``: per-token log-probabilities of the shifted labels in tiles, no logits) and
calls it with the collator's all-ones ``attention_mask`` and ``use_cache=False``; its loss is the negative sum of
the micro-batch's log-probabilities over the Trainer's ``num_items_in_batch``, which the Trainer does not divide
again; Accelerate runs the forward under ``torch.autocast("cpu", torch.bfloat16)``. ``SFTConfig``'s default
``gradient_checkpointing=True`` stays on (it recomputes the same forward in the backward); the oracle does not
checkpoint.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from bf16_recipe import equal, run, trainer_items

pytestmark = pytest.mark.integration

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integration_helpers import fresh_accelerate_state, tiny_gpt2  # noqa: E402, F401 (an autouse fixture)

MICRO = 4  # micro-batches per optimizer step
STEPS = 3
BATCH = 2  # rows per micro-batch
SEQ = 8
VOCAB = 64  # tiny_gpt2's; its EOS (and so TRL's pad) token is 0
CLIP = 0.5  # bites: the norms of the float32 sums are about 1 to 2
LR = 1e-3
FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer asks its fused head for


def _state(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _batches(steps: int) -> list[list[torch.Tensor]]:
    """Token ids from 1: no pad (0) inside a row, so every label counts."""
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(MICRO)] for _ in range(steps)]


def recipe(batches: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The recipe by hand in plain torch around TRL's forward; the parameters after the run and each step's
    norm."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_gpt2().to(torch.bfloat16)
    add_fused_lm_head(model, outputs=FUSED_OUTPUTS)
    model.train()

    def backward(step: list[torch.Tensor], ids: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # Accelerate's forward for bf16
            out = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False, fused_lm_head=True
            )
        (-out.log_probs.sum() / trainer_items(step)).backward()

    norms = run(model.parameters(), batches, backward, CLIP, lr=LR, weight_decay=0.0)
    return _state(model), norms


def _tokenizer() -> Any:
    """A word-level tokenizer over the model's 64 ids, built in memory: TRL reads its EOS and pad tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), eos_token="t0")


def sft_run(batches: list, out: pathlib.Path, line: bool = True) -> tuple[Any, list[float]]:
    from trl import SFTConfig, SFTTrainer

    from gradscaler.frameworks import MasterWeightsCallback

    model = tiny_gpt2().to(torch.bfloat16)
    rows = [row.tolist() for step in batches for ids in step for row in ids]
    dataset = datasets.Dataset.from_dict({"input_ids": rows})
    args = SFTConfig(
        output_dir=str(out), bf16=True, use_cpu=True, gradient_accumulation_steps=MICRO, max_grad_norm=CLIP,
        optim="adamw_torch", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0,
        max_steps=len(batches), per_device_train_batch_size=BATCH, train_sampling_strategy="sequential",
        dataloader_drop_last=True, logging_steps=1, report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0, save_strategy="no", max_length=SEQ,
    )  # fmt: skip
    callbacks = [MasterWeightsCallback()] if line else []
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(), callbacks=callbacks
    )
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(norms) == len(batches)
    return trainer, norms


def test_trl_sft_bf16_equals_the_recipe_and_differs_without_the_callback(tmp_path: pathlib.Path) -> None:
    batches = _batches(STEPS)
    expected, expected_norms = recipe(batches)
    trainer, norms = sft_run(batches, tmp_path / "line")
    assert trainer.args.gradient_checkpointing  # SFTConfig's default, kept
    assert all(n > CLIP for n in norms), f"the clipping must bite: {norms}"
    assert norms == [n.item() for n in expected_norms]
    got = _state(trainer.model)
    assert all(p.dtype == torch.bfloat16 for p in got)
    assert equal(got, expected)
    without, _ = sft_run(batches, tmp_path / "without", line=False)
    assert not equal(_state(without.model), expected)
