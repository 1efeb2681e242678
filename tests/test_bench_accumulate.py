"""``gradscaler bench --sections accumulation`` (tools/bench_accumulate.py), on sizes a test affords:
what each cell measures, not how fast."""

from __future__ import annotations

import pytest
import torch

from gradscaler.tools import bench_accumulate

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", list(bench_accumulate.DTYPES))
def test_precision_cells_tell_the_two_accumulations_apart(dtype: str) -> None:
    low = bench_accumulate.precision_cell(CPU, dtype, 16, False, 4096)
    fp32 = bench_accumulate.precision_cell(CPU, dtype, 16, True, 4096)
    assert low > 1e-4  # rounded at every add in float16/bfloat16
    assert fp32 < 1e-7  # float32 sums of values exact in their dtype


def test_memory_rows_hold_the_float32_sum_instead_of_both_gradients() -> None:
    """AdamW: parameters 2 + masters 4 + moments 8, plus 2 (float16 gradients) and/or 4 (float32 ones)."""
    today, accumulating = bench_accumulate.memory_section(CPU, micro=2, width=32, layers=1)
    assert today["between_micro_batches"] == pytest.approx(2 + 2 + 4 + 8, abs=0.05)
    assert today["in_step"] == pytest.approx(2 + 2 + 4 + 4 + 8, abs=0.05)
    assert today["after_step"] == pytest.approx(2 + 4 + 4 + 8, abs=0.05)
    for point in ("between_micro_batches", "in_step", "after_step"):
        assert accumulating[point] == pytest.approx(2 + 4 + 4 + 8, abs=0.05)


def test_the_section_reports_every_cell() -> None:
    result = {
        "precision": bench_accumulate.precision_section(CPU, 1024, (2,)),
        "training": bench_accumulate.training_section(CPU, steps=2, micro=2),
        "memory": bench_accumulate.memory_section(CPU, micro=2, width=32, layers=1),
        "time": bench_accumulate.time_section(CPU, 1, micro=2, width=32, layers=1),
        "ddp": {"world": 2, "micro_batches": 2, "exit_codes": [1, None], "failed": "no result from rank 0"},
        "fsdp2": {"world": 2, "width": 8, "exit_codes": [None, 1], "failed": "no result from rank 0"},
    }
    lines = "\n".join(bench_accumulate.accumulation_lines(result))
    assert lines.count("| float16 (scale 1024) | 2 |") == 1 and lines.count("| bfloat16 | 2 |") == 1
    assert "| autograd (low precision) |" in lines and "| float32 |" in lines and "ratio" in lines
    assert len(result["training"]["float32_accumulation"]) == 2
    assert "DDP, 2 gloo processes on the CPU, 2 micro-batches (no_sync but the last): FAILED, no result" in lines
    assert "gradient sync on the last micro-batch only: FAILED, no result" in lines


@pytest.mark.distributed
def test_the_ddp_cell_times_both_systems_on_two_processes_and_the_ranks_agree() -> None:
    cell = bench_accumulate.ddp_section(2, world=2, micro=2, width=32, layers=1)
    assert "failed" not in cell, cell
    assert cell["exit_codes"] == [0, 0] and cell["ranks_agree"] is True
    assert cell["tensors"] == 2 + 12 + 2  # two embeddings, one block, the final norm (the head is tied)
    assert all(value > 0 for key in ("masters_ms", "float32_ms", "ratio") for value in cell[key])
    line = "\n".join(bench_accumulate.ddp_lines(cell))
    assert "masters alone (DDP's bfloat16 all-reduce)" in line and "ranks agree on the weights" in line


@pytest.mark.distributed
def test_fsdp2s_own_reduce_dtype_float32_sums_in_float32_as_the_refusal_says() -> None:
    """The setting the refusal points at (``reduce_dtype=torch.float32`` with bfloat16 compute) accumulates the
    unsynced micro-batches in float32: float32 rounding only, where ``reduce_dtype=bfloat16`` sums in bfloat16
    (benchmarks/results/cpu-2026-11-28-fsdp2-accumulation.txt, at width 64)."""
    cell = bench_accumulate.fsdp2_section(world=2, micro_batches=(8,), width=32)
    assert "failed" not in cell, cell  # rank 0's result came (an abort in gloo's teardown after it is torch's)
    (row,) = cell["rows"]
    assert row["float32"] < 1e-7 < 1e-4 < row["bfloat16"], row
    assert "| 8 |" in "\n".join(bench_accumulate.fsdp2_lines(cell))
