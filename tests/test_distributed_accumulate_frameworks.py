"""``accumulate_grads_in_fp32=True`` under a framework's DDP, 2 gloo ranks
(``dist_accumulate_frameworks_worker``): Accelerate's ``accumulate()`` with the model ``prepare`` wrapped
in DDP and one line, ``accelerator.scaler.register_ddp(model)``, and Lightning Fabric's
``strategy="ddp"`` with ``scaler.register_ddp(model)`` on what ``fabric.setup`` returned, and the Lightning
Trainer's with ``scaler.register_ddp(self.trainer.strategy.model)`` in ``on_fit_start``: bit for bit the
recipe by hand that all-reduces its float32 sums, every rank alike."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dist_accumulate_frameworks_worker as worker
from dist_launch import launch
from integration_helpers import assert_bit_identical

pytestmark = [pytest.mark.distributed, pytest.mark.integration]
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = launch(WORLD, tmp_path_factory.mktemp("accumulate_frameworks"), worker.scenarios)
    return [item["scenarios"] for item in results]


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(map(torch.equal, x, y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", [*worker.CASES, *(f"fabric-{kind}" for kind in worker.FABRIC_CASES)])
def test_framework_ddp_with_register_ddp_equals_the_recipe_that_all_reduces_float32_sums(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for rank in ranks:
        ours, recipe = rank[case]["ours"], rank[case]["recipe"]
        assert same(ours["params"], recipe["params"])
        assert ours["scales"] == recipe["scales"]
        assert_bit_identical(ours["norms"], recipe["norms"])  # the framework's clipping (NaN == NaN)
        assert ours["skipped"] == [i == worker.BAD_ITERATION for i in range(worker.ITERATIONS)]  # rank 1's inf
        assert any(math.isfinite(n) and n > worker.MAX_NORM for n in ours["norms"]), ours["norms"]  # the clip bites
        assert all(grad is None for grad in ours["grads_left"])  # DDP's low-precision write dropped at the move
        assert all(not torch.equal(a, b) for a, b in zip(ours["params"][-1], recipe["initial"], strict=True))
    first, second = (rank[case]["ours"] for rank in ranks)
    assert same(first["params"], second["params"])  # the ranks agree on every weight


def test_lightning_trainer_ddp_with_register_ddp_in_on_fit_start_equals_the_recipe(
    ranks: list[dict[str, Any]],
) -> None:
    """``accumulate_grad_batches=4``, ``gradient_clip_val``, the AMP plugin with our scaler, a float16 network."""
    for rank in ranks:
        ours, recipe = rank["trainer"]["ours"], rank["trainer"]["recipe"]
        assert len(ours["params"]) == worker.ITERATIONS
        assert same(ours["params"], recipe["params"])
        assert ours["scales"] == recipe["scales"]
        assert ours["skipped"] == [i == worker.BAD_ITERATION for i in range(worker.ITERATIONS)]
        assert_bit_identical(ours["norms"], recipe["norms"])  # taken after unscale_, before the clip
        assert any(math.isfinite(n) and n > worker.MAX_NORM for n in ours["norms"]), ours["norms"]  # it bites
        assert all(grad is None for grad in ours["grads_left"])
        assert all(not torch.equal(a, b) for a, b in zip(ours["params"][-1], recipe["initial"], strict=True))
    first, second = (rank["trainer"]["ours"] for rank in ranks)
    assert same(first["params"], second["params"])


def test_a_module_holding_two_ddp_modules_is_refused_registering_nothing(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        message = rank["refusals"]["two"]
        assert message.startswith("Pass scaler.register_ddp the DDP-wrapped model")  # what to do, first
        assert "module is a TwoReplicas, not a torch.nn.parallel" in message
        assert "holds 2 among its submodules" in message and "Nothing was registered." in message
        assert not rank["refusals"]["registered"]
