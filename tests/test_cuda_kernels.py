"""The Triton kernels and the CUDA telemetry on real GPU memory (``make gpu-check``).

Marked ``cuda``: skipped without a CUDA device, an error under ``GRADSCALER_REQUIRE_CUDA=1``.

- The read pass against torch's device path (``torch_stats._generic``) on the same tensors: the flag
  bit for bit (inf, -inf, NaN anywhere, every dtype and norm type); the norms against float64 (the
  two paths sum in different orders, docs/migration.md).
- The move against torch's recipe (``g.float()`` then ``_amp_foreach_non_finite_check_and_unscale_``)
  bit for bit, and its norms against the read pass over the float32 copies bit for bit (what clipping
  masters by hand gives; both kernels compiled with contraction off).
- The fallback on a real device: a capability check that fails sends it to the torch path.
- The telemetry: pinned host mirrors and events; records land without a sync on the hot path.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradscaler import GradScaler, kernels
from gradscaler.kernels import torch_stats

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
NORMS = [None, 1.0, 2.0, 3.0, math.inf]
# Chunk edges (65536 values a chunk): one and two chunks, a partial last block, an empty tensor.
SHAPES = [(300, 50), (7,), (0,), (70_001,), (131_072,), (4_096,), (1,)]


def grads(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(s, device="cuda", generator=gen) * 300).to(dtype) for s in SHAPES]


def reference(tensors: list[torch.Tensor], p: float, inv: float) -> torch.Tensor:
    out = []
    for t in tensors:
        v = t.double().reshape(-1) * inv
        out.append(torch.linalg.vector_norm(v, p) if v.numel() else torch.zeros((), dtype=torch.float64, device="cuda"))
    return torch.stack(out)


@pytest.fixture(autouse=True)
def auto_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADSCALER_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_FALLBACK", {})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", NORMS, ids=str)
def test_read_pass_against_torchs_device_path(dtype: torch.dtype, p: float | None) -> None:
    tensors = grads(dtype, seed=NORMS.index(p))
    inv = torch.tensor(2.0**-8, device="cuda")
    ours = kernels.grad_stats(tensors, p, inv)
    theirs = torch_stats._generic(tensors, p, inv)
    assert torch.equal(ours.nonfinite, theirs.nonfinite) and float(ours.nonfinite) == 0.0
    if p is not None:
        assert ours.norms is not None and theirs.norms is not None
        tolerance = 1e-5 if p in (1.0, 2.0, math.inf) else 1e-4
        expected = reference(tensors, p, 2.0**-8)
        torch.testing.assert_close(ours.norms.double(), expected, rtol=tolerance, atol=0)
        torch.testing.assert_close(theirs.norms.double(), expected, rtol=tolerance, atol=0)
    for where in (0, 3, 4):
        for bad in (math.inf, -math.inf, math.nan):
            spoiled = [t.clone() for t in tensors]
            spoiled[where].view(-1)[-1] = bad
            flag = kernels.grad_stats(spoiled, p, inv).nonfinite
            assert torch.equal(flag, torch_stats._generic(spoiled, p, inv).nonfinite) and float(flag) == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", NORMS, ids=str)
@pytest.mark.parametrize("factor", [None, 2.0**-13, 3.0], ids=["copy", "pow2", "three"])
def test_move_bit_for_bit_on_gpu(dtype: torch.dtype, p: float | None, factor: float | None) -> None:
    src = grads(dtype, seed=5)
    src[3].view(-1)[17] = math.inf if factor == 3.0 else src[3].view(-1)[17]
    scale = None if factor is None else torch.tensor(factor, device="cuda")
    norm_inv = torch.tensor(2.0**-13, device="cuda")
    dst = [torch.full(s.shape, 7.0, device="cuda") for s in src]
    stats = kernels.move_grads_(src, dst, scale, p, norm_inv)
    expected = [s.float() for s in src]
    flag = torch.zeros((), device="cuda")
    if scale is not None:
        torch._amp_foreach_non_finite_check_and_unscale_(expected, flag, scale)
    for out, ref in zip(dst, expected, strict=True):
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    read = kernels.grad_stats([s.float() for s in src], p, norm_inv)
    assert torch.equal(stats.nonfinite, read.nonfinite)
    assert float(stats.nonfinite) == float(factor == 3.0)
    if p is not None:
        assert stats.norms is not None and read.norms is not None
        assert torch.equal(stats.norms.view(torch.int32), read.norms.view(torch.int32))


def test_a_device_below_the_supported_capabilities_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "MIN_CAPABILITY", (99, 0))
    monkeypatch.setattr(kernels, "_SUPPORTED", set())
    tensors = grads(torch.float32, seed=9)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = kernels.grad_stats(tensors, 2.0)
        second = kernels.grad_stats(tensors, 2.0)
    ours = [w for w in record if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert len(ours) == 1 and "99.0" in str(ours[0].message)
    expected = torch_stats.grad_stats(tensors, 2.0, None)  # the path a device without the kernels takes
    assert torch.equal(first.norms, expected.norms) and torch.equal(second.norms, expected.norms)


def test_telemetry_records_land_without_a_sync() -> None:
    """A scaler on CUDA with a logger: 40 steps (overflows at 5, 6 and 17) make no host sync in
    ``scale``/``unscale_``/``step``/``update`` (the records travel in pinned mirrors, each with an
    event); every record reaches the logger, in order, with the right skip flags."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    records: list[dict] = []
    scaler.add_logger(records.append)
    x = torch.randn(16, 64, device="cuda")
    for step in range(40):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaled = scaler.scale(loss)
        scaled.backward()
        if step in (5, 6, 17):
            model.weight.grad[0, 0] = math.inf
        if step == 0:  # the first step creates the optimizer state (one documented sync)
            scaler.step(opt)
            scaler.update()
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    telemetry = scaler._telemetry
    buffers = [b.host for b in telemetry._in_flight] + [h for free in telemetry._buffers.values() for h in free]
    assert buffers and all(host.is_pinned() for host in buffers)  # in flight, or landed and kept for reuse
    assert all(b.event is not None for b in telemetry._in_flight)
    stats = scaler.stats()  # delivers the records still in flight
    assert [r["step"] for r in records] == list(range(1, 41))
    assert [i for i, r in enumerate(records) if r["skipped"]] == [5, 6, 17]
    assert stats["skipped_steps"] == 3 and records[-1]["scale"] == stats["scale"]
