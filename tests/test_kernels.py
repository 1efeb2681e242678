"""``grad_stats``: the torch path and the Triton kernel (interpreted on the CPU) against float64."""

from __future__ import annotations

import math

import pytest
import torch

from gradscaler.kernels import torch_stats

triton_stats = pytest.importorskip("gradscaler.kernels.triton_stats")
pytestmark = pytest.mark.skipif(not triton_stats.AVAILABLE, reason="triton is not installed")

# Chunk edges: 70_001 spans two chunks (the first full), 131_072 is exactly two, 4_096 one block.
SHAPES = [(300, 50), (7,), (0,), (70_001,), (3, 4, 5), (1,), (131_072,), (4_096,)]
NORMS = [None, 1.0, 2.0, 3.0, math.inf]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def grads(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 100).to(DEVICE, dtype) for s in SHAPES]


def reference(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """float64 norms; an empty tensor's norm is 0 (vector_norm refuses an empty inf-norm)."""
    return torch.stack(
        [
            torch.linalg.vector_norm(t.double().cpu().reshape(-1), p)
            if t.numel()
            else torch.zeros((), dtype=torch.float64)
            for t in tensors
        ]
    )


@pytest.mark.parametrize("impl", [torch_stats, triton_stats], ids=["torch", "triton"])
@pytest.mark.parametrize("p", NORMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_norms_match_float64(impl, p: float | None, dtype: torch.dtype) -> None:
    tensors = grads(seed=NORMS.index(p) + 7, dtype=dtype)
    stats = impl.grad_stats(tensors, p)
    assert float(stats.nonfinite) == 0.0
    if p is None:
        assert stats.norms is None
        return
    expected = reference(tensors, p)
    # float32 accumulation over <= 70k values; p not in {1, 2, inf} goes through exp2/log2.
    tolerance = 1e-5 if p in (1.0, 2.0, math.inf) else 1e-4
    torch.testing.assert_close(stats.norms.double().cpu(), expected, rtol=tolerance, atol=0)


@pytest.mark.parametrize("impl", [torch_stats, triton_stats], ids=["torch", "triton"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 3, 6], ids=["first", "big", "two_chunks"])
@pytest.mark.parametrize("p", [None, 2.0, math.inf], ids=str)
def test_flag_catches_every_nonfinite_value(impl, bad: float, where: int, p: float | None) -> None:
    tensors = grads(seed=where)
    before = [t.clone() for t in tensors]
    index = tensors[where].numel() - 1
    tensors[where].view(-1)[index] = bad
    before[where].view(-1)[index] = bad
    stats = impl.grad_stats(tensors, p)
    assert float(stats.nonfinite) == 1.0
    for a, b in zip(tensors, before, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), "the check must not write"


def test_large_finite_values_are_not_flagged_by_the_check() -> None:
    tensors = [torch.full((10,), 3e38, device=DEVICE)]
    assert float(triton_stats.grad_stats(tensors, None).nonfinite) == 0.0
    assert float(torch_stats.grad_stats(tensors, None).nonfinite) == 0.0


def test_triton_norms_are_deterministic() -> None:
    tensors = grads(seed=3)
    first = triton_stats.grad_stats(tensors, 2.0).norms
    for _ in range(3):
        assert torch.equal(triton_stats.grad_stats(tensors, 2.0).norms, first)


def test_unaligned_views() -> None:
    flat = torch.randn(100_003, device=DEVICE)
    tensors = [flat[1:70_000], flat[3:]]  # 4- and 12-byte offsets: not 16-byte aligned
    stats = triton_stats.grad_stats(tensors, 2.0)
    torch.testing.assert_close(stats.norms.double().cpu(), reference(tensors, 2.0), rtol=1e-5, atol=0)


def test_non_contiguous_tensors() -> None:
    base = torch.randn(64, 32, device=DEVICE)
    tensors = [base.t(), base[:, ::2]]
    stats = triton_stats.grad_stats(tensors, 2.0)
    torch.testing.assert_close(stats.norms.double().cpu(), reference(tensors, 2.0), rtol=1e-5, atol=0)
