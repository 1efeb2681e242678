"""Overflow agreement across processes: real gloo processes on the CPU, no network ports.

One launch per world size (2 and 4 ranks) runs every scenario of ``dist_worker`` (``dist_launch``:
no ports, every wait bounded, a hang fails the test instead of hanging CI).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_launch import launch
from dist_worker import BAD_STEP, MIXED_BAD_STEPS, MIXED_ORDERS, STEPS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"dist{world}")
    return world, [item["scenarios"] for item in launch(world, out)]


SHARDED = [f"{kind}-{tag}" for kind in ("hand_sharded",) for tag in ("noclip", "clip")] + [
    f"{kind}-{opt}-{tag}" for kind in ("ddp", "fsdp2") for opt in ("forloop", "fused") for tag in ("noclip", "clip")
]


@pytest.mark.parametrize("scenario", SHARDED)
def test_every_rank_skips_the_step_one_rank_overflowed(results: tuple[int, list[dict]], scenario: str) -> None:
    world, ranks = results
    traces = [r[scenario] for r in ranks]
    assert len(traces) == world
    for rank, trace in enumerate(traces):
        assert trace["skipped"][BAD_STEP], f"rank {rank} did not skip"
        assert sum(trace["skipped"]) == 1, f"rank {rank} skipped {trace['skipped']}"
        assert trace["unchanged"][BAD_STEP], f"rank {rank} changed parameters or state at the skipped step"
        assert not any(trace["unchanged"][:BAD_STEP]), "clean steps must update"
        assert trace["scale"] == traces[0]["scale"], f"rank {rank} scale diverged"
    assert traces[0]["scale"][BAD_STEP] == traces[0]["scale"][BAD_STEP - 1] / 2


@pytest.mark.parametrize("scenario", ["hand_sharded-clip", "fsdp2-forloop-clip", "fsdp2-fused-clip"])
def test_sharded_norm_equals_the_unsharded_norm(results: tuple[int, list[dict]], scenario: str) -> None:
    _, ranks = results
    for trace in (r[scenario] for r in ranks):
        for step, (got, want) in enumerate(zip(trace["norm"], trace["norm_ref"], strict=True)):
            if step == BAD_STEP:
                continue
            assert got == pytest.approx(want, rel=1e-5), f"step {step}"


@pytest.mark.parametrize("tag", ["noclip", "clip"])
@pytest.mark.parametrize("kind", ["ddp-forloop", "fsdp2-forloop"])
def test_n_rank_run_matches_single_process_run(results: tuple[int, list[dict]], kind: str, tag: str) -> None:
    """Same global batch: scales and skips exactly equal; parameters to float32 reduction-order rounding."""
    _, ranks = results
    single: dict[str, Any] = ranks[0][f"single-{tag}"]
    multi: dict[str, Any] = ranks[0][f"{kind}-{tag}"]
    assert multi["scale"] == single["scale"] and multi["skipped"] == single["skipped"]
    for a, b in zip(multi["params"], single["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if tag == "clip":
        for step in range(STEPS):
            if step != BAD_STEP:
                assert multi["norm"][step] == pytest.approx(single["norm"][step], rel=1e-5)


MIXED = [
    (mesh, order, opt, tag)
    for mesh in ("mesh1d", "mesh2d")
    for order in MIXED_ORDERS
    for opt in ("forloop", "fused")
    for tag in ("noclip", "clip")
    if not (opt == "fused" and "plain" in order)  # torch's fused AdamW refuses plain tensors mixed with DTensors
]


@pytest.mark.parametrize(("mesh", "order", "opt", "tag"), MIXED, ids=["-".join(case) for case in MIXED])
def test_mixed_placements_skip_together_whatever_the_order(
    results: tuple[int, list[dict]], mesh: str, order: str, opt: str, tag: str
) -> None:
    """D12: plain or Replicate parameters before or after a Shard(0) one; the inf is in one shard only."""
    world, ranks = results
    if mesh == "mesh2d" and world != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    traces = [r[f"mixed-{mesh}-{order}-{opt}-{tag}"] for r in ranks]
    single = ranks[0][f"mixed-single-{opt}-{tag}"]
    want = [step in MIXED_BAD_STEPS for step in range(STEPS)]
    assert single["skipped"] == want
    for rank, trace in enumerate(traces):
        assert trace["skipped"] == want, f"rank {rank} skipped {trace['skipped']}, every rank must skip {want}"
        assert trace["scale"] == single["scale"], f"rank {rank} scale diverged from the single process"
        assert trace["unchanged"] == want, f"rank {rank}: a skipped step changed state or a clean one did not"
        if tag == "noclip":
            for a, b in zip(trace["params"], single["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


MIXED_CLIP = [case for case in MIXED if case[3] == "clip"]


@pytest.mark.parametrize(("mesh", "order", "opt", "tag"), MIXED_CLIP, ids=["-".join(case) for case in MIXED_CLIP])
def test_mixed_placements_clip_norm_equals_the_unsharded_norm(
    results: tuple[int, list[dict]], mesh: str, order: str, opt: str, tag: str
) -> None:
    # Only sharded gradients' norms are reduced over the mesh; a plain or Replicate gradient (whole on
    # every rank) counts once, so the norm and the run equal the single process's.
    world, ranks = results
    if mesh == "mesh2d" and world != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    single = ranks[0][f"mixed-single-{opt}-{tag}"]
    for trace in (r[f"mixed-{mesh}-{order}-{opt}-{tag}"] for r in ranks):
        for step, (got, want) in enumerate(zip(trace["norm"], trace["norm_ref"], strict=True)):
            if step not in MIXED_BAD_STEPS:
                assert got == pytest.approx(want, rel=1e-5), f"step {step}"
        for a, b in zip(trace["params"], single["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_shards_over_two_mesh_dimensions_reduce_over_both_groups(results: tuple[int, list[dict]]) -> None:
    world, ranks = results
    if world != 4:
        pytest.skip("two shard groups of a 2x2 mesh need 4 ranks")
    for rank, item in enumerate(ranks):
        found = item["two-dims"]
        assert found["row-col"] == found["want-row-col"], f"rank {rank}"
        assert found["col-row"] == found["want-col-row"], f"rank {rank}"
        assert found["explicit"], f"rank {rank}: an explicit process_group must win"
        assert found["same-ranks"] == found["want-ranks"], f"rank {rank}"
