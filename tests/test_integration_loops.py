"""patch_torch (unchanged code gets our scaler), a nanoGPT-style hand loop and timm's NativeScaler.

Each run is compared bit for bit with the same seeded run using torch.amp.GradScaler("cpu", ...):
losses, grad norms and scales every step, final parameters and optimizer state.
"""

from __future__ import annotations

import importlib
import io
import itertools
import pickle
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gradscaler
from gradscaler import drop_in
from integration_helpers import (
    EARLY_OVERFLOW,
    SCALER_CLASSES,
    Record,
    TinyGPT,
    adamw,
    assert_bit_identical,
    grad_norm,
    poison_,
    token_batches,
)

pytestmark = pytest.mark.integration

SPELLINGS = [
    ("torch", "GradScaler"),
    ("torch.amp", "GradScaler"),
    ("torch.amp.grad_scaler", "GradScaler"),
    ("torch.cuda.amp", "GradScaler"),
    ("torch.cuda.amp.grad_scaler", "GradScaler"),
    ("torch.cpu.amp", "GradScaler"),
    ("torch.cpu.amp.grad_scaler", "GradScaler"),
]


def current() -> dict[str, Any]:
    return {f"{m}.{a}": getattr(importlib.import_module(m), a) for m, a in SPELLINGS}


@pytest.fixture(autouse=True)
def never_leave_torch_patched() -> Iterator[None]:
    before = current()
    yield
    gradscaler.unpatch_torch()
    after = current()
    assert all(after[k] is before[k] for k in before)


# ------------------------------------------------------------------------------------ patch_torch
def test_patch_replaces_every_spelling_and_unpatch_restores_the_same_objects() -> None:
    originals = current()
    assert originals["torch.GradScaler"] is originals["torch.amp.GradScaler"]
    handle = gradscaler.patch_torch()
    assert handle.applied and drop_in.is_torch_patched()
    patched = current()
    for name in ("torch.GradScaler", "torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler"):
        assert patched[name] is gradscaler.GradScaler
    assert patched["torch.cuda.amp.GradScaler"] is drop_in.CudaAmpGradScaler
    assert patched["torch.cuda.amp.grad_scaler.GradScaler"] is drop_in.CudaAmpGradScaler
    assert patched["torch.cpu.amp.GradScaler"] is drop_in.CpuAmpGradScaler
    assert patched["torch.cpu.amp.grad_scaler.GradScaler"] is drop_in.CpuAmpGradScaler
    gradscaler.unpatch_torch()
    assert not drop_in.is_torch_patched()
    restored = current()
    assert all(restored[k] is originals[k] for k in originals)
    gradscaler.unpatch_torch()  # a no-op when not patched
    assert all(current()[k] is originals[k] for k in originals)


def test_patch_is_idempotent_and_nested_blocks_restore_on_the_outer_exit() -> None:
    originals = current()
    with gradscaler.patch_torch() as outer:
        once = current()
        with gradscaler.patch_torch() as inner:
            assert not inner.applied
            assert current() == once
        assert current() == once  # the inner exit changed nothing
        assert outer.applied
    assert all(current()[k] is originals[k] for k in originals)
    gradscaler.patch_torch()
    gradscaler.patch_torch()
    gradscaler.unpatch_torch()  # twice patched is once patched: one unpatch restores torch
    assert all(current()[k] is originals[k] for k in originals)


def test_context_manager_restores_torch_when_the_block_raises() -> None:
    original = torch.amp.GradScaler
    with pytest.raises(KeyError), gradscaler.patch_torch():
        assert torch.amp.GradScaler is gradscaler.GradScaler
        raise KeyError("boom")
    assert torch.amp.GradScaler is original


def test_unchanged_script_gets_our_scaler_under_every_spelling_with_torchs_signatures() -> None:
    with gradscaler.patch_torch():
        # nanoGPT's line, on a machine without CUDA: torch's deprecation warning, then disabled.
        deprecated = r"torch\.cuda\.amp\.GradScaler\(args\.\.\.\)` is deprecated"
        with pytest.warns(FutureWarning, match=deprecated), pytest.warns(UserWarning, match="CUDA is not available"):
            cuda_legacy = torch.cuda.amp.GradScaler(enabled=True)
        assert isinstance(cuda_legacy, gradscaler.GradScaler) and cuda_legacy._device == "cuda"
        assert not cuda_legacy.is_enabled()
        with pytest.warns(UserWarning, match="CUDA is not available"):
            cuda_new = torch.amp.GradScaler("cuda")  # Accelerate's and timm's call on a GPU machine
        assert type(cuda_new) is gradscaler.GradScaler and not cuda_new.is_enabled()
        with pytest.warns(FutureWarning, match=r"torch\.cpu\.amp\.GradScaler"):
            cpu_legacy = torch.cpu.amp.GradScaler(2.0**10, 3.0, 0.25, 7)  # torch's positional order
        assert cpu_legacy._device == "cpu" and cpu_legacy.is_enabled()
        assert (cpu_legacy.get_scale(), cpu_legacy.get_growth_factor()) == (2.0**10, 3.0)
        assert (cpu_legacy.get_backoff_factor(), cpu_legacy.get_growth_interval()) == (0.25, 7)
        by_keyword = torch.GradScaler(device="cpu", init_scale=4.0, growth_interval=3)
        assert type(by_keyword) is gradscaler.GradScaler and by_keyword.get_scale() == 4.0
        # gradscaler's own keyword-only options pass through the legacy spelling too.
        with pytest.warns(FutureWarning):
            assert torch.cpu.amp.GradScaler(hysteresis=2)._rule.hysteresis == 2
        # built while patched, still ours (and picklable by name) once torch is restored
        restored = pickle.loads(pickle.dumps(cpu_legacy))
        assert type(restored) is drop_in.CpuAmpGradScaler and restored.get_scale() == 2.0**10
    assert type(torch.amp.GradScaler("cpu")) is not gradscaler.GradScaler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert type(torch.cuda.amp.GradScaler()).__module__.startswith("torch.")


def test_unpatch_leaves_a_name_someone_else_rebound() -> None:
    class Theirs:
        pass

    original = torch.amp.GradScaler
    gradscaler.patch_torch()
    torch.amp.GradScaler = Theirs  # type: ignore[misc,assignment]
    try:
        with pytest.warns(RuntimeWarning, match=r"torch\.amp\.GradScaler was rebound"):
            gradscaler.unpatch_torch()
        assert torch.amp.GradScaler is Theirs
        assert torch.cuda.amp.GradScaler is not drop_in.CudaAmpGradScaler
    finally:
        torch.amp.GradScaler = original  # type: ignore[misc]


def test_torch_subclasses_imported_later_still_subclass_torchs_class() -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    with gradscaler.patch_torch():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    assert gradscaler.GradScaler not in ShardedGradScaler.__mro__


# --------------------------------------------------------------------------- nanoGPT-style loop
def nanogpt_run(
    make_scaler: Callable[[], Any],
    *,
    fused: bool,
    grad_clip: float,
    steps: int = 13,
    poison_at: int = 11,
    resume_at: int | None = None,
) -> Record:
    """nanoGPT's train.py inner loop (2 micro-steps of gradient accumulation, its LR schedule, its
    clipping), on TinyGPT. ``resume_at``: at that step save model/optimizer/scaler state dicts through
    ``torch.save`` + ``torch.load(weights_only=True)`` and continue with fresh objects built from them."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = adamw(model.parameters(), fused, lr=3e-3)
    scaler = make_scaler()
    data = token_batches(2 * steps)
    record = Record()
    for it in range(steps):
        if it == resume_at:
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                buffer,
            )
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            torch.manual_seed(123)  # the fresh model starts elsewhere: the checkpoint must restore it
            model = TinyGPT()
            model.load_state_dict(checkpoint["model"])
            optimizer = adamw(model.parameters(), fused, lr=3e-3)
            optimizer.load_state_dict(checkpoint["optimizer"])
            scaler = make_scaler()
            scaler.load_state_dict(checkpoint["scaler"])
        lr = 3e-3 * min(1.0, (it + 1) / 4)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(2):
            x, y = data[2 * it + micro]
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
                loss = loss / 2
            scaler.scale(loss).backward()
            record.losses.append(loss.detach().clone())
        if it == poison_at:
            poison_(model)
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            record.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        scaler.step(optimizer)
        scaler.update()
        if grad_clip == 0.0:
            record.norms.append(grad_norm(model))
        record.scales.append(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
    return record.finish(model, optimizer)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("grad_clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_nanogpt_loop_is_bit_identical_with_overflows_and_a_resume(fused: bool, grad_clip: float) -> None:
    records = {}
    for name, cls in SCALER_CLASSES.items():
        make = lambda cls=cls: cls("cpu", **EARLY_OVERFLOW)  # noqa: E731
        records[name] = nanogpt_run(make, fused=fused, grad_clip=grad_clip)
    make_ours = lambda: gradscaler.GradScaler("cpu", **EARLY_OVERFLOW)  # noqa: E731
    assert_bit_identical(records["torch"], nanogpt_run(make_ours, fused=fused, grad_clip=grad_clip, resume_at=6))
    scales = records["torch"].scales
    assert scales[0] < EARLY_OVERFLOW["init_scale"]  # the first step overflowed (and backed off)
    assert scales[11] == scales[10] / 2  # the injected inf at step 11 backed off
    assert any(b > a for a, b in itertools.pairwise(scales))  # and the scale grew in between
    assert_bit_identical(records["torch"], records["ours"])


def test_nanogpt_unchanged_script_under_patch_torch_builds_our_scaler() -> None:
    """nanoGPT's own line, ``torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))``, untouched."""

    def script() -> Any:
        dtype = "float16"
        return torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))

    with gradscaler.patch_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(script(), drop_in.CudaAmpGradScaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not isinstance(script(), gradscaler.GradScaler)


# ------------------------------------------------------------------------------- timm NativeScaler
def load_timm_native_scaler() -> tuple[type, Callable[..., Any]]:
    """timm's own ``NativeScaler`` and ``dispatch_clip_grad``.

    Imported normally when timm imports (it needs torchvision). Without torchvision (no CPU wheel for
    torch 2.13 here) timm's package ``__init__`` fails, so the three real modules NativeScaler uses
    (timm/utils/cuda.py, clip_grad.py, agc.py, none of which needs torchvision) are loaded from the
    installed timm under stand-in parent packages: the code under test is timm's, unchanged.
    """
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        pytest.skip("timm is not installed (pip install --no-deps timm==1.0.31)")
    try:
        from timm.utils import NativeScaler, dispatch_clip_grad

        return NativeScaler, dispatch_clip_grad
    except ImportError:
        pass
    root = Path(spec.origin).parent
    saved = {name: mod for name, mod in sys.modules.items() if name == "timm" or name.startswith("timm.")}
    for name in saved:
        del sys.modules[name]
    try:
        for name, path in (("timm", root), ("timm.utils", root / "utils")):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
        cuda = importlib.import_module("timm.utils.cuda")
        clip = importlib.import_module("timm.utils.clip_grad")
        return cuda.NativeScaler, clip.dispatch_clip_grad
    finally:
        for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def timm_run(
    native_scaler: Any, *, fused: bool, clip_grad: float | None, clip_mode: str, steps: int = 10, resume_at: int = 5
) -> Record:
    """timm's train.py step: ``loss_scaler(loss, optimizer, clip_grad=..., clip_mode=..., parameters=...)``,
    and at ``resume_at`` what CheckpointSaver saves and resume_checkpoint loads (the scaler under
    ``loss_scaler.state_dict_key``, torch.load with weights_only=True)."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = adamw(model.parameters(), fused)
    loss_scaler = native_scaler()
    record = Record()
    for step, (x, y) in enumerate(token_batches(steps)):
        if step == resume_at:
            buffer = io.BytesIO()
            save_state = {"epoch": step, "optimizer": optimizer.state_dict(), "version": 2}
            save_state[loss_scaler.state_dict_key] = loss_scaler.state_dict()
            save_state["state_dict"] = model.state_dict()
            torch.save(save_state, buffer)
            buffer.seek(0)
            checkpoint = torch.load(buffer, map_location="cpu", weights_only=True)
            torch.manual_seed(7)
            model = TinyGPT()
            model.load_state_dict(checkpoint["state_dict"])
            optimizer = adamw(model.parameters(), fused)
            optimizer.load_state_dict(checkpoint["optimizer"])
            loss_scaler = native_scaler()
            loss_scaler.load_state_dict(checkpoint[loss_scaler.state_dict_key])
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, y)
        if step == 7:  # late overflow: a loss scaled to inf makes every gradient non-finite
            loss = loss * float("inf")
        loss_scaler(loss, optimizer, clip_grad=clip_grad, clip_mode=clip_mode, parameters=model.parameters())
        record.losses.append(loss.detach().clone())
        record.norms.append(grad_norm(model))
        record.scales.append(loss_scaler._scaler.get_scale())
        optimizer.zero_grad()
    return record.finish(model, optimizer)


@pytest.mark.parametrize(
    ("fused", "clip_grad", "clip_mode"),
    [(True, None, "norm"), (True, 1.0, "norm"), (False, 0.01, "value"), (False, 0.05, "agc")],
    ids=["fused-noclip", "fused-norm", "foreach-value", "foreach-agc"],
)
def test_timm_native_scaler_is_bit_identical_through_a_checkpoint(
    fused: bool, clip_grad: float | None, clip_mode: str
) -> None:
    native_scaler, _ = load_timm_native_scaler()
    records = {}
    for name, cls in SCALER_CLASSES.items():

        def make(cls: Any = cls) -> Any:
            loss_scaler = native_scaler(device="cpu")  # timm's train.py: NativeScaler(device=device.type)
            loss_scaler._scaler = cls("cpu", **EARLY_OVERFLOW)  # the one-line swap (timm has no option)
            return loss_scaler

        records[name] = timm_run(make, fused=fused, clip_grad=clip_grad, clip_mode=clip_mode)
    assert records["torch"].scales[0] < EARLY_OVERFLOW["init_scale"]
    assert records["torch"].scales[7] == records["torch"].scales[6] / 2
    assert_bit_identical(records["torch"], records["ours"])


def test_timm_native_scaler_under_patch_torch_builds_ours_and_checkpoints_load_across() -> None:
    native_scaler, _ = load_timm_native_scaler()
    with gradscaler.patch_torch():
        ours = native_scaler(device="cpu")
    assert type(ours._scaler) is gradscaler.GradScaler
    theirs = native_scaler(device="cpu")
    assert type(theirs._scaler) is torch.amp.GradScaler
    # a checkpoint written with one loads into the other, through timm's state_dict_key
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.ones(2, requires_grad=True).sum()
    ours._scaler.scale(loss)
    ours._scaler.update(512.0)
    buffer = io.BytesIO()
    torch.save({ours.state_dict_key: ours.state_dict()}, buffer)
    buffer.seek(0)
    theirs.load_state_dict(torch.load(buffer, weights_only=True)[theirs.state_dict_key])
    assert theirs._scaler.get_scale() == 512.0
