"""``gradscaler bench --sections bf16`` (tools/bench_bf16.py), on sizes a test affords: the bytes are exact
counts of storages; the times are only checked to be there (speed lives in the bench, not in tests)."""

from __future__ import annotations

import torch

from gradscaler.tools import bench_bf16


def test_the_line_costs_ten_bytes_a_parameter_with_adamw() -> None:
    """bfloat16 parameter 2 + its gradient 2 + AdamW's bfloat16 moments 4 without the line; with it the
    parameter 2, the float32 master 4, its float32 sum 4 and float32 moments 8 (the LayerNorms, float32 on
    both sides, move the figures off the round numbers by a hundredth)."""
    rows = bench_bf16.memory_section(torch.device("cpu"), micro=2, width=32, layers=1)
    without, line = (rows[0], rows[1])
    assert (without["system"], line["system"]) == bench_bf16.SYSTEMS
    for point in ("between_micro_batches", "before_step", "after_step"):
        assert abs(without[point] - 8.0) < 0.2, without
        assert abs(line[point] - 18.0) < 0.2, line


def test_the_time_cells_and_their_lines_cover_both_loops() -> None:
    result = {
        "memory": bench_bf16.memory_section(torch.device("cpu"), micro=2, width=32, layers=1),
        "time": bench_bf16.time_section(torch.device("cpu"), rounds=2, micro=2, width=32, layers=1),
    }
    assert len(result["time"]["micro_ms"]) == len(result["time"]["step_ms"]) == 2
    text = "\n".join(bench_bf16.bf16_lines(result))
    for name in bench_bf16.SYSTEMS:
        assert text.count(f"| {name} |") == 2, text
    assert "| ratio, with / without |" in text
