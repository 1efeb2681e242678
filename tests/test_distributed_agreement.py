"""Every rank issues the same collectives whatever gradients it holds; refusals change nothing; FSDP2 + TP.

Real gloo processes on the CPU (``dist_launch``), the scenarios in ``dist_agreement_worker``. The
empty-rank launch runs with a short collective timeout: a rank that skips a collective makes its
peer fail within it, instead of hanging until the hang guard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_agreement_worker as worker
from dist_launch import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("empty")
    return [item["scenarios"] for item in launch(2, out, worker.empty_ranks, worker.SHORT_TIMEOUT)]


@pytest.mark.parametrize("name", ["forloop-noclip", "forloop-clip", "fused-noclip", "fused-clip"])
def test_a_rank_without_gradients_joins_every_collective(empty: list[dict[str, Any]], name: str) -> None:
    """Issue 20.1: rank 1 with no gradient at all (an empty micro-batch), or only a Replicate one; then
    rank 0 with none while rank 1's shard holds an inf: no hang, and every rank skips that step only."""
    traces = [ranks[name] for ranks in empty]
    want = [step == worker.EMPTY_BAD[0] for step in range(worker.EMPTY_STEPS)]
    for rank, trace in enumerate(traces):
        assert trace["skipped"] == want, f"rank {rank} skipped {trace['skipped']}, every rank must skip {want}"
        assert trace["scale"] == traces[0]["scale"], f"rank {rank} scale diverged"
        assert trace["unchanged"][worker.EMPTY_BAD[0]], f"rank {rank} changed state at the skipped step"
        for step, (got, ref) in enumerate(zip(trace["norm"], trace["norm_ref"], strict=False)):
            if step != worker.EMPTY_BAD[0]:
                assert got == pytest.approx(ref, rel=1e-5), f"rank {rank} step {step}"


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return [item["scenarios"] for item in launch(2, tmp_path_factory.mktemp("refused"), worker.refusals)]


@pytest.mark.parametrize("call", ["unscale_", "step", "clip_grad_norm_"])
def test_a_refused_call_changes_nothing_on_any_rank(refused: list[dict[str, Any]], call: str) -> None:
    """Issue 20.2a: the refusal comes from the parameters, before any gradient is touched, with the same
    words on every rank; a retry once the optimizer is fixed unscales exactly once."""
    messages = [ranks[call] for ranks in refused]
    assert messages[0] is not None and "Partial placement" in messages[0] and "Parameter #1" in messages[0]
    assert messages == [messages[0]] * len(messages), "every rank must refuse with the same words"
    for rank, ranks in enumerate(refused):
        assert ranks[f"{call}-unchanged"], f"rank {rank}: the refused {call} changed the gradients"
        assert ranks["retry-once"], f"rank {rank}: the retry did not unscale exactly once"
        assert ranks["retry-stepped"], f"rank {rank}"


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return [item["scenarios"] for item in launch(4, tmp_path_factory.mktemp("fsdp2_tp"), worker.fsdp2_tp)]


def test_fsdp2_tp_parameters_are_sharded_over_both_dimensions(tp: list[dict[str, Any]]) -> None:
    placements = tp[0]["placements-clip"]
    assert any("Shard(dim=1)" in p and "Shard(dim=0)" in p for p in placements), placements  # dp and tp
    assert any("Replicate()" in p for p in placements), placements  # a bias sharded over dp only


@pytest.mark.parametrize("tag", ["noclip", "clip"])
def test_fsdp2_tp_every_rank_skips_and_matches_one_process(tp: list[dict[str, Any]], tag: str) -> None:
    """Issue 20.2b: an inf on one rank (in a dp+tp shard, then in a dp-only one) makes all 4 ranks skip;
    the clip norm is that of the full gradients; the run equals one process on the global batch."""
    single = tp[0][f"single-{tag}"]
    want = [step in worker.TP_BAD for step in range(worker.TP_STEPS)]
    assert single["skipped"] == want
    for rank, ranks in enumerate(tp):
        trace = ranks[tag]
        assert trace["skipped"] == want, f"rank {rank} skipped {trace['skipped']}, every rank must skip {want}"
        assert trace["scale"] == single["scale"], f"rank {rank} scale diverged from the single process"
        assert trace["unchanged"] == want, f"rank {rank}: a skipped step changed state or a clean one did not"
        for a, b in zip(trace["params"], single["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for step in range(worker.TP_STEPS):
            if tag == "clip" and step not in worker.TP_BAD:
                assert trace["norm"][step] == pytest.approx(trace["norm_ref"][step], rel=1e-5), f"rank {rank}"
                assert trace["norm"][step] == pytest.approx(single["norm"][step], rel=1e-5), f"rank {rank}"
