"""``master_weights=True`` across processes: DDP and FSDP2 over a float16 model, 2 gloo ranks on the CPU.

One launch (``dist_launch``: no ports, every wait bounded) runs every scenario of ``dist_masters_worker``.
The one-process reference trains the same model on the same global batch, as the ranks' two halves
with each half's loss divided by 2 and the gradients accumulated: the sum DDP's all-reduce and FSDP2's
reduce-scatter compute (a sum of two float16 values is the same in either order, and halving is exact).
So its gradients equal the ranks' bit for bit, and so does a DDP run, where every rank steps the same
whole tensors. Where the arithmetic differs, the tolerance is stated at the comparison. Last, an FSDP2
optimizer's state dict carries the float32 DTensor masters through ``torch.save`` and back.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_masters_worker as worker
from dist_launch import launch

pytestmark = pytest.mark.distributed

WORLD = 2
RUNS = [f"{kind}-{tag}" for kind in worker.OPTIMIZERS for tag in ("noclip", "clip")]
DDP_RUNS = RUNS + ["sgd-noclip-group"]  # the NaN in rank 1's reduced gradient; process_group=WORLD
WANT_SKIPPED = [step == worker.BAD_STEP for step in range(worker.STEPS)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = launch(WORLD, tmp_path_factory.mktemp("masters"), worker.scenarios)
    return [item["scenarios"] for item in results]


def reference_of(ranks: list[dict[str, Any]], run: str) -> dict[str, Any]:
    """The one-process run a distributed ``run`` is compared with (the injection site does not matter:
    the step is skipped either way)."""
    return ranks[0][f"reference-{run.removesuffix('-group')}"]


def assert_equal_tensors(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} tensors, want {len(want)}"
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{index}]: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        assert torch.equal(a, b), f"{what}[{index}] differs by up to {(a.double() - b.double()).abs().max().item()}"


def assert_every_rank_skips_the_bad_step_only(traces: list[dict[str, Any]]) -> None:
    """Every rank skips exactly ``BAD_STEP``, leaves parameters, masters and optimizer state untouched
    there (and only there), and holds the same scale after every update."""
    for rank, trace in enumerate(traces):
        assert trace["skipped"] == WANT_SKIPPED, f"rank {rank} skipped {trace['skipped']}, want {WANT_SKIPPED}"
        assert trace["unchanged"] == WANT_SKIPPED, f"rank {rank}: unchanged {trace['unchanged']}, want {WANT_SKIPPED}"
        assert trace["scale"] == traces[0]["scale"], f"rank {rank}'s scales {trace['scale']} != rank 0's"
    scales = traces[0]["scale"]
    assert scales[worker.BAD_STEP] == scales[worker.BAD_STEP - 1] / 2, f"no backoff at the skipped step: {scales}"


def assert_masters_of_the_float16_parameters(trace: dict[str, Any], sharded: bool) -> None:
    """Exactly the float16 parameters got masters: float32, in the optimizer's param_groups in their place,
    the only keys of float32 optimizer state; under FSDP2 DTensors with the float16 parameter's mesh,
    placements (Shard(0)) and local shape; plain tensors under DDP."""
    assert trace["mastered"] == [True, True, False, False, True, True, True, True], trace[
        "mastered"
    ]  # not the LayerNorm
    assert trace["masters_in_groups"] and not trace["low_in_groups"], "the masters must replace the float16 parameters"
    assert trace["state_dtypes"] == ["torch.float32"], trace["state_dtypes"]
    for index, kind in enumerate(trace["kinds"]):
        assert kind["dtype"] == torch.float32, (index, kind)
        assert kind["local_shape"] == kind["low_local_shape"], (index, kind)
        if sharded:
            assert kind["type"] == kind["low_type"] == "DTensor", (index, kind)
            assert kind["placements"] == kind["low_placements"] == "(Shard(dim=0),)", (index, kind)
            assert kind["same_mesh"], (index, kind)
        else:
            assert kind["type"] == "Tensor" and kind["placements"] == "None", (index, kind)


@pytest.mark.parametrize("run", DDP_RUNS)
def test_ddp_every_rank_skips_together_and_equals_one_process(ranks: list[dict[str, Any]], run: str) -> None:
    """DDP: the NaN of one rank (in backward, before the all-reduce; or, with process_group, after it)
    makes both ranks skip with parameters, masters and state untouched; the ranks' parameters and masters
    are identical, and the run equals the one-process run bit for bit (scales, skips, clip norms, values)."""
    traces = [r[f"ddp-{run}"] for r in ranks]
    assert_every_rank_skips_the_bad_step_only(traces)
    for rank, trace in enumerate(traces):
        assert_equal_tensors(trace["params"], traces[0]["params"], f"rank {rank} parameters")
        assert_equal_tensors(trace["masters"], traces[0]["masters"], f"rank {rank} masters")
        assert trace["rounded"], f"rank {rank}: the float16 parameters are not their masters rounded"
    single = reference_of(ranks, run)
    assert single["skipped"] == WANT_SKIPPED and single["scale"] == traces[0]["scale"]
    assert_equal_tensors(traces[0]["params"], single["params"], "parameters vs one process")
    assert_equal_tensors(traces[0]["masters"], single["masters"], "masters vs one process")
    if run.endswith("-clip"):
        clean = [step for step in range(worker.STEPS) if step != worker.BAD_STEP]
        assert [traces[0]["norm"][s] for s in clean] == [single["norm"][s] for s in clean]


@pytest.mark.parametrize("run", [run for run in DDP_RUNS if "noclip" in run])
def test_ddp_masters_are_built_from_the_reduced_gradients(ranks: list[dict[str, Any]], run: str) -> None:
    """At the first step the masters are bound after backward, when DDP has all-reduced the float16
    gradients: each master's gradient is exactly its parameter's reduced gradient over the scale, the
    same on both ranks (whose own halves of the batch differ) and equal to the one-process gradient."""
    single = reference_of(ranks, run)
    for rank, item in enumerate(ranks):
        trace = item[f"ddp-{run}"]
        assert_masters_of_the_float16_parameters(trace, sharded=False)
        assert trace["moved_exactly"], f"rank {rank}: a master's gradient is not its reduced float16 gradient"
        assert_equal_tensors(trace["master_grads"], single["master_grads"], f"rank {rank} master gradients")


@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_float16_dtensors_get_float32_dtensor_masters_of_their_shard(
    ranks: list[dict[str, Any]], run: str
) -> None:
    for item in ranks:
        assert_masters_of_the_float16_parameters(item[f"fsdp2-{run}"], sharded=True)


@pytest.mark.parametrize("run", [run for run in RUNS if "noclip" in run])
def test_fsdp2_masters_hold_their_shard_of_the_reduced_gradient(ranks: list[dict[str, Any]], run: str) -> None:
    """Each rank's master gradient is its Shard(0) piece of the one-process gradient, bit for bit."""
    single = reference_of(ranks, run)
    for rank, item in enumerate(ranks):
        trace = item[f"fsdp2-{run}"]
        assert trace["moved_exactly"], f"rank {rank}: a master's gradient is not its float16 gradient shard"
        pieces = [grad.chunk(WORLD)[rank] for grad in single["master_grads"]]
        assert_equal_tensors(trace["master_grads"], pieces, f"rank {rank} master gradient shards")


def assert_close_to_one_process(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    """float32 values to rtol 1e-5 / atol 1e-6; float16 values within one float16 rounding (rtol 2**-10).

    Why not bit for bit: the optimizers step each rank's shard, not the whole tensor, and with clipping
    the total norm is summed from the ranks' parts in another order (a few float32 ulps apart), so the
    clip coefficient, hence every later master, may differ in its last bits; a master that close to a
    float16 rounding boundary can round its parameter the other way.
    """
    assert len(got) == len(want), what
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, (what, index)
        if a.dtype == torch.float16:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-10, atol=2**-24, msg=f"{what}[{index}]")
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{what}[{index}]")


@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_every_rank_skips_together_and_matches_one_process(ranks: list[dict[str, Any]], run: str) -> None:
    """FSDP2, no process_group: the NaN in rank 1's shard makes both ranks skip (the agreement comes from
    the masters' mesh); scales and skips equal the one-process run's exactly, the values to tolerance."""
    traces = [r[f"fsdp2-{run}"] for r in ranks]
    assert_every_rank_skips_the_bad_step_only(traces)
    for rank, trace in enumerate(traces):  # whole tensors, gathered: every rank must hold the same
        assert_equal_tensors(trace["params"], traces[0]["params"], f"rank {rank} parameters")
        assert_equal_tensors(trace["masters"], traces[0]["masters"], f"rank {rank} masters")
        assert trace["rounded"], f"rank {rank}: the float16 shards are not their masters rounded"
    single = reference_of(ranks, run)
    assert single["skipped"] == WANT_SKIPPED and single["scale"] == traces[0]["scale"]
    assert_close_to_one_process(traces[0]["params"], single["params"], "parameters")
    assert_close_to_one_process(traces[0]["masters"], single["masters"], "masters")


@pytest.mark.parametrize("run", [run for run in RUNS if run.endswith("-clip")])
def test_fsdp2_clip_norm_equals_the_one_process_norm(ranks: list[dict[str, Any]], run: str) -> None:
    """The total norm of the masters' sharded gradients, reduced over the mesh, is the one-process norm
    (to float32 rounding: the ranks' parts are summed in another order) and the same on both ranks."""
    single = reference_of(ranks, run)
    norms = [item[f"fsdp2-{run}"]["norm"] for item in ranks]
    assert len(norms[0]) == worker.STEPS
    for step in range(worker.STEPS):
        if step == worker.BAD_STEP:
            continue
        assert norms[1][step] == norms[0][step], f"step {step}: the ranks' norms differ"
        assert norms[0][step] == pytest.approx(single["norm"][step], rel=1e-6), f"step {step}"


def test_fsdp2_optimizer_state_dict_round_trips_the_masters(ranks: list[dict[str, Any]]) -> None:
    """A bound optimizer's state dict (through torch.save) holds float32 DTensor masters; loaded back (with
    the model's and the scaler's), masters, parameters and state are restored bit for bit and the replayed
    step equals the first; a new model, optimizer and scaler resumed from it take the same step.
    torch.distributed.checkpoint's get_optimizer_state_dict is refused with what to use instead."""
    for rank, item in enumerate(ranks):
        found = item["fsdp2-checkpoint"]
        assert found["saved_masters"] == [("DTensor", torch.float32, "(Shard(dim=0),)")] * 6, found["saved_masters"]
        assert found["beyond_half"], f"rank {rank}: the saved masters hold float16 values only: the test proves nothing"
        assert found["moved_on"], f"rank {rank}: the steps after the save changed nothing"
        assert found["restored"], f"rank {rank}: loading did not restore masters, parameters and state"
        assert found["replayed"], f"rank {rank}: the replayed step differs from the first"
        assert found["resumed"], f"rank {rank}: the resumed run's step differs"
        assert found["rounded"], f"rank {rank}: the float16 shards are not their masters rounded"
        assert found["dcp"] == ("ValueError", True), f"rank {rank}: get_optimizer_state_dict gave {found['dcp']}"
