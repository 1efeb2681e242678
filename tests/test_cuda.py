"""CUDA-only behaviour: sync-free calls, whole-step CUDA graph capture, bit-identity on the GPU.

Marked ``cuda``: skipped with a reason on machines without CUDA; ``GRADSCALER_REQUIRE_CUDA=1`` makes
the skip an error (``make gpu-test``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradscaler import GradScaler

pytestmark = pytest.mark.cuda


def model_and_data(seed: int = 0) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    data = [
        (torch.randn(32, 64, device="cuda", generator=gen), torch.randn(32, 8, device="cuda", generator=gen))
        for _ in range(8)
    ]
    return model, data


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, scaler: GradScaler, x: torch.Tensor, y: torch.Tensor, clip: bool
) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return loss.detach()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("recipe", ["plain", "unscale", "unscale_clip"])
def test_bit_identical_to_torch_on_cuda(fused: bool, recipe: str) -> None:
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        model, data = model_and_data()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
        scaler = cls("cuda", init_scale=2.0**14, growth_interval=3)
        scales = []
        for step in range(40):
            x, y = data[step % len(data)]
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if step in (5, 6, 17):
                model[2].weight.grad[0, step % 3] = (float("inf"), float("nan"), -float("inf"))[step % 3]
            if recipe != "plain":
                scaler.unscale_(opt)
            if recipe == "unscale_clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler._scale))
        results.append((scales, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_scaler_calls_make_no_sync(clip: bool) -> None:
    model, data = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    train_step(model, opt, scaler, *data[0], clip)  # first step: state creation (one documented sync)
    torch.cuda.synchronize()
    for step in range(1, 6):
        x, y = data[step]
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaled = scaler.scale(loss)
            torch.cuda.set_sync_debug_mode("default")
            scaled.backward()
            if step == 3:
                model[0].weight.grad[0, 0] = float("inf")
            torch.cuda.set_sync_debug_mode("error")
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert scaler.stats()["skipped_steps"] >= 1


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("set_to_none", [False, True], ids=["grads_kept", "grads_freed"])
def test_whole_step_captures_in_a_cuda_graph(clip: bool, set_to_none: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays equal eager steps bit for bit. Gradients kept allocated (``zero_grad(set_to_none=False)``)
    let the graph use the Triton kernel; gradients allocated inside the capture get torch's ops, so the
    eager reference is forced onto torch's ops too."""
    if set_to_none:
        monkeypatch.setenv("GRADSCALER_KERNEL", "torch")

    def make() -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
        model, _ = model_and_data()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        return model, opt, GradScaler("cuda", init_scale=2.0**10, growth_interval=3)

    _, data = model_and_data()
    eager_model, eager_opt, eager_scaler = make()
    eager_losses = []
    for step in range(12):
        eager_opt.zero_grad(set_to_none=set_to_none)
        eager_losses.append(train_step(eager_model, eager_opt, eager_scaler, *data[step % 8], clip))

    model, opt, scaler = make()
    static_x, static_y = data[0][0].clone(), data[0][1].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    losses = []
    with torch.cuda.stream(stream):  # warm-up steps, eager, on a side stream
        for step in range(3):
            static_x.copy_(data[step % 8][0])
            static_y.copy_(data[step % 8][1])
            opt.zero_grad(set_to_none=set_to_none)
            losses.append(train_step(model, opt, scaler, static_x, static_y, clip))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=set_to_none)
    with torch.cuda.graph(graph):
        if not set_to_none:
            opt.zero_grad(set_to_none=False)
        static_loss = train_step(model, opt, scaler, static_x, static_y, clip)
    for step in range(3, 12):
        static_x.copy_(data[step % 8][0])
        static_y.copy_(data[step % 8][1])
        graph.replay()
        losses.append(static_loss.clone())
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=0, atol=0)
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(scaler._scale) == float(eager_scaler._scale)
    assert scaler.stats()["steps"] == 4  # the host counts 3 eager updates + 1 capture; replays run on the device


def test_triton_kernel_reaches_bandwidth_target_shape() -> None:
    """Correctness of the Triton kernel at GPT-2-medium scale against float64 (timing is in bench)."""
    from gradscaler.kernels import triton_stats
    from gradscaler.tools.harness import gpt2_shapes

    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(s, device="cuda", generator=gen) for s in gpt2_shapes(1024, 24, 50257, 1024)]
    stats = triton_stats.grad_stats(grads, 2.0)
    expected = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
    torch.testing.assert_close(stats.norms.double(), expected, rtol=1e-5, atol=0)
    grads[100].view(-1)[12345] = float("nan")
    assert float(triton_stats.grad_stats(grads, None).nonfinite) == 1.0


def test_the_telemetrys_computed_records_are_the_cuda_kernels_scales() -> None:
    """On CUDA the telemetry computes each record's scale on the host (``ScaleRule.next_on_host``) instead of
    copying it: with a growth factor whose float64 products round (1.1), overflows, a growth interval changed
    mid-run (it clamps the tracker) and a read under way, ``history()`` ends at the scale the device holds, and
    every record is what the CPU kernel gives for the same flags."""
    scaler = GradScaler("cuda", init_scale=3.0, growth_factor=1.1, backoff_factor=0.9, growth_interval=2, history=80)
    param = nn.Parameter(torch.ones(4, device="cuda"))
    opt = torch.optim.SGD([param], lr=0.01)
    flags = [step % 5 == 4 for step in range(70)]
    for step, overflow in enumerate(flags):
        if step == 30:
            scaler.set_growth_interval(1)
        if step == 45:
            scaler.stats()  # a read sends the pending records early
        opt.zero_grad()
        scaler.scale(param.sum() * (float("inf") if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    scales = scaler.history()["scale"]
    assert scales[-1] == scaler.get_scale()
    scale, tracker, expected = torch.tensor(3.0), torch.zeros((), dtype=torch.int32), []
    hysteresis = torch.ones((), dtype=torch.int32)
    from gradscaler.rule import ScaleRule, update_scale_

    for step, overflow in enumerate(flags):
        rule = ScaleRule(growth_factor=1.1, backoff_factor=0.9, growth_interval=1 if step >= 30 else 2)
        if step == 30:
            tracker.clamp_(max=0)
        update_scale_(scale, tracker, hysteresis, torch.tensor(float(overflow)), rule)
        expected.append(scale.item())
    assert scales == expected


def test_the_host_form_of_torchs_kernel_is_the_cuda_kernel_bit_for_bit() -> None:
    """``ScaleRule.next_on_host`` against torch's CUDA ``_amp_update_scale_`` and the clamp (tests/test_rule.py holds
    it against the CPU kernel): random float32 scales up to float32's max, factors whose products round, trackers at
    the interval, overflows."""
    import random
    import struct

    from gradscaler.rule import FLOAT32_MAX, SCALE_FLOOR, ScaleRule, update_scale_

    rng = random.Random(0)
    for _ in range(2000):
        policy = ScaleRule(
            growth_factor=rng.choice([2.0, 1.1, 1.0 + rng.random() * 10]),
            backoff_factor=rng.choice([0.5, 0.9, max(rng.random(), 1e-6)]),
            growth_interval=rng.randint(1, 3),
        )
        bits = rng.randint(struct.unpack("<I", struct.pack("<f", SCALE_FLOOR))[0], 0x7F7F_FFFF)
        held = min(max(struct.unpack("<f", struct.pack("<I", bits))[0], policy.lower), FLOAT32_MAX)
        tracker, skipped = rng.randint(0, policy.growth_interval - 1), rng.random() < 0.3
        scale = torch.tensor(held, device="cuda")
        t = torch.tensor(tracker, dtype=torch.int32, device="cuda")
        flag = torch.tensor(float(skipped), device="cuda")
        update_scale_(scale, t, torch.ones((), dtype=torch.int32, device="cuda"), flag, policy)
        assert policy.next_on_host(held, tracker, skipped) == (scale.item(), int(t.item())), (policy, held, tracker)


def test_the_one_op_inverse_is_torchs_three_for_every_float32_on_cuda() -> None:
    """``rule.inverse_scale`` on CUDA is one float32 ``reciprocal``, which must round as torch's float64 reciprocal
    rounded to float32 (``rule.ROUNDED_DIVISION_DEVICES``): every positive finite float32, vectorized, and a sample
    through the one-element scale the scaler holds."""
    import random
    import struct

    from gradscaler.rule import inverse_scale

    top, chunk = 0x7F7F_FFFF, 1 << 26  # about 1.5 GiB a chunk at most
    for start in range(1, top + 1, chunk):
        bits = torch.arange(start, min(start + chunk, top + 1), dtype=torch.int32, device="cuda")
        values = bits.view(torch.float32)
        expected = values.double().reciprocal().float()
        assert torch.equal(values.reciprocal().view(torch.int32), expected.view(torch.int32)), start
    rng = random.Random(0)
    for _ in range(500):
        held = torch.tensor(struct.unpack("<f", struct.pack("<I", rng.randint(1, top)))[0], device="cuda")
        assert torch.equal(inverse_scale(held, on_host=False), held.double().reciprocal().float()), held.item()
