"""Overflow agreement across processes: real gloo processes on the CPU, loopback only.

One launch per world size (2 and 4 ranks) runs every scenario of ``dist_worker``; each join is
bounded, so a hung collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import multiprocessing
import socket
from typing import Any

import pytest
import torch

from dist_worker import BAD_STEP, STEPS

pytestmark = pytest.mark.distributed
JOIN_SECONDS = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    import dist_worker

    world = request.param
    out = tmp_path_factory.mktemp(f"dist{world}")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=dist_worker.main, args=(rank, world, port, str(out))) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(JOIN_SECONDS)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    loaded = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    for rank, item in enumerate(loaded):
        assert "error" not in item, f"rank {rank}:\n{item.get('error')}"
    return world, [item["scenarios"] for item in loaded]


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
