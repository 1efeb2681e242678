"""``accumulate_grads_in_fp32=True`` under FSDP2 and DDP, 2 gloo ranks (``dist_accumulate_worker``): both
refused with FSDP2's own setting or what to do, every rank alike, changing nothing."""

from __future__ import annotations

from typing import Any

import pytest

import dist_accumulate_worker as worker
from dist_launch import launch

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = launch(WORLD, tmp_path_factory.mktemp("accumulate"), worker.scenarios)
    return [item["scenarios"] for item in results]


def test_fsdp2_is_refused_at_the_binding_with_its_own_setting(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        fsdp2 = rank["fsdp2"]
        assert fsdp2["refused"] is not None and "reduce_dtype=torch.float32" in fsdp2["refused"]
        assert fsdp2["masters"] == 0 and fsdp2["plain"]  # no master built: the optimizer holds FSDP2's DTensors
        assert fsdp2["grads"]  # the hooks are gone: the next backward is FSDP2's own


def test_ddp_is_refused_at_the_step_naming_ddp(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        ddp = rank["ddp"]
        assert ddp["refused"] is not None and "DistributedDataParallel" in ddp["refused"]
        assert ddp["unchanged"]
