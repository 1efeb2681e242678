"""``kernels.move_grads_``: float16/bfloat16 gradients into float32 ones times a factor, with the flag and norms.

The torch route (the CPU) and the Triton kernel (interpreted on the CPU with TRITON_INTERPRET=1) must
both equal torch's recipe bit for bit: ``g.float()`` then ``_amp_foreach_non_finite_check_and_unscale_``;
the norms of the same read must equal the route's own read pass (``grad_stats``) over the float32
copies bit for bit (clipping masters by hand reads those) and a float64 reference to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from gradscaler import kernels

triton_stats = pytest.importorskip("gradscaler.kernels.triton_stats")
# The torch route runs no Triton (make test-triton-ends leaves it out), on torch's own thread count (conftest.py),
# which its float64 tolerance was measured with.
ROUTES = [
    pytest.param("torch", marks=[pytest.mark.torch_route, pytest.mark.torch_threads]),
    pytest.param("triton", marks=pytest.mark.skipif(not triton_stats.AVAILABLE, reason="no triton")),
]
# Chunk edges: 70_001 spans two chunks (the first full), 131_072 is exactly two, 4_096 one block.
SHAPES = [(300, 50), (7,), (0,), (70_001,), (3, 4, 5), (131_072,), (4_096,)]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def on_the_device() -> Iterator[None]:
    """Every tensor on the GPU where there is one (the Triton route compiles for it; the interpreter,
    which reads CPU tensors, runs only where there is none)."""
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(None)


def grads(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, device="cpu") * 3000).to(DEVICE, dtype) for s in SHAPES]


def recipe(src: list[torch.Tensor], inv_scale: torch.Tensor | None) -> tuple[list[torch.Tensor], float]:
    out = [s.float() for s in src]
    flag = torch.zeros(())
    if inv_scale is not None:
        torch._amp_foreach_non_finite_check_and_unscale_(out, flag, inv_scale)
    return out, float(flag)


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("GRADSCALER_KERNEL", request.param)
    return str(request.param)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inv", [2.0**-13, 1.0, None, 3.0], ids=["pow2", "one", "none", "three"])
def test_equals_torchs_copy_and_unscale_bit_for_bit(route: str, dtype: torch.dtype, inv: float | None) -> None:
    src = grads(dtype)
    inv_scale = None if inv is None else torch.tensor(inv)
    dst = [torch.full(s.shape, 7.0) for s in src]
    stats = kernels.move_grads_(src, dst, inv_scale)
    expected, expected_flag = recipe(src, inv_scale)
    assert stats.norms is None
    assert float(stats.nonfinite) == expected_flag == 0.0
    for out, ref in zip(dst, expected, strict=True):
        assert out.dtype == torch.float32
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 3, 5], ids=["first", "two_chunks", "second_chunk_end"])
def test_flag_catches_every_nonfinite_value(route: str, bad: float, where: int) -> None:
    src = grads(torch.float16, seed=where)
    src[where].view(-1)[-1] = bad
    dst = [torch.empty(s.shape) for s in src]
    stats = kernels.move_grads_(src, dst, torch.tensor(2.0**-10))
    assert float(stats.nonfinite) == 1.0
    last = dst[where].view(-1)[-1]
    assert math.isnan(last) if math.isnan(bad) else last == bad


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("norm_type", [None, 2.0], ids=["flag", "norm"])
def test_flag_without_a_factor(route: str, bad: float, norm_type: float | None) -> None:
    src = grads(torch.float16, seed=7)
    dst = [torch.empty(s.shape) for s in src]
    assert float(kernels.move_grads_(src, dst, None, norm_type).nonfinite) == 0.0
    src[3].view(-1)[70_000] = bad
    assert float(kernels.move_grads_(src, dst, None, norm_type).nonfinite) == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.5], ids=["l2", "inf", "l1", "p3.5"])
@pytest.mark.parametrize("factor", [None, 2.0**-13], ids=["copy", "unscale"])
def test_norms_of_the_move_equal_the_read_pass_of_float32_copies(
    route: str, dtype: torch.dtype, norm_type: float, factor: float | None
) -> None:
    src = grads(dtype, seed=3)
    inv_scale = torch.tensor(2.0**-13)
    dst = [torch.full(s.shape, 7.0) for s in src]
    stats = kernels.move_grads_(src, dst, None if factor is None else torch.tensor(factor), norm_type, inv_scale)
    expected, _ = recipe(src, None if factor is None else torch.tensor(factor))
    for out, ref in zip(dst, expected, strict=True):  # the norms change nothing of what is written
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    read = kernels.grad_stats([s.float() for s in src], norm_type, inv_scale)  # what float32 masters give
    assert stats.norms is not None and read.norms is not None
    assert stats.norms.dtype == torch.float32
    assert torch.equal(stats.norms, read.norms)
    zero = torch.zeros((), dtype=torch.float64)  # an empty tensor's norm is 0 (the kernels' contract), inf too
    unscaled = [s.double() * 2.0**-13 for s in src]
    reference = torch.stack([torch.linalg.vector_norm(u, norm_type) if u.numel() else zero for u in unscaled])
    torch.testing.assert_close(stats.norms.double(), reference, rtol=2e-5, atol=0.0)  # as tests/test_kernels.py
