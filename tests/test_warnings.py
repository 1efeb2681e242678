"""Every warning the package raises names the user's line (``gradscaler.errors.warn``), whatever lies
between: the ``torch.compiler.disable`` wrappers ``compiled.prepare`` puts around the scaler's methods
when the first scaler is made, torch's ``optimizer.load_state_dict`` running the masters' hooks, the
library's own calls, a step compiled by ``torch.compile``.

Each test triggers one warning through the public API and checks its file and line are this file's,
at the statement that triggered it. ``test_every_warning_the_package_raises_is_tested_here`` reads the
package's source and fails when a warning is added that no test here triggers.
"""

from __future__ import annotations

import ast
import inspect
import io
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import gradscaler
from gradscaler import GradScaler, ScaleCollapseWarning, kernels
from gradscaler.masters.checkpoint import ContinuedWarning
from helpers import TORCH_VERSION

SRC = Path(gradscaler.__file__).resolve().parent
HERE = str(Path(__file__).resolve())

# (module, category) of each warning the package issues, and the test below that triggers it
TESTED = {
    ("scaler", "UserWarning"): "test_cuda_scaler_without_cuda",
    ("drop_in", "FutureWarning"): "test_torchs_deviceless_spelling_under_patch_torch",
    ("drop_in", "RuntimeWarning"): "test_unpatch_finding_a_spelling_rebound",
    ("fused", "FutureWarning"): "test_a_legacy_grad_scaler_keyword",
    ("record.monitor", "ScaleCollapseWarning"): "test_collapse_with_on_collapse_warn",
    ("masters.checkpoint", "ContinuedWarning"): "test_a_float32_parameter_continued_from_a_saved_master",
    ("masters.accumulate", "UserWarning"): "test_a_model_new_to_an_accumulating_scaler_after_its_first_iteration",
    ("kernels", "KernelFallbackWarning"): "test_kernel_fallback",
    ("drop_in", "UserWarning"): "test_patch_torch_with_master_weights_unreached_by_a_loop_without_a_scaler",
    ("masters.standalone", "UserWarning"): "test_with_master_weights_over_float32_parameters",
}


def here() -> int:
    """The caller's current line: ``here() + 1`` is the line of the statement after it."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


@contextmanager
def caught() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield record


def assert_at(record: list[warnings.WarningMessage], category: type[Warning], match: str, line: int) -> None:
    """At least one ``category`` warning containing ``match`` was issued, and every one names ``line`` here."""
    ours = [w for w in record if issubclass(w.category, category) and match in str(w.message)]
    assert ours, [(w.category.__name__, str(w.message)[:80]) for w in record]
    assert [(w.filename, w.lineno) for w in ours] == [(HERE, line)] * len(ours)


def loss_of(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 4)).float().pow(2).mean()


# ---------------------------------------------------------------- the scaler and torch's spellings


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning of a machine without CUDA")
def test_cuda_scaler_without_cuda() -> None:
    with caught() as record:
        line = here() + 1
        GradScaler("cuda")
    assert_at(record, UserWarning, "CUDA is not available", line)


def test_torchs_deviceless_spelling_under_patch_torch() -> None:
    with gradscaler.patch_torch(), caught() as record:
        line = here() + 1
        torch.cpu.amp.GradScaler()  # type: ignore[attr-defined]
    assert_at(record, FutureWarning, "torch.cpu.amp.GradScaler", line)


def test_unpatch_finding_a_spelling_rebound() -> None:
    torchs = torch.amp.GradScaler

    class Other(torchs):  # type: ignore[misc, valid-type]
        pass

    try:
        gradscaler.patch_torch()
        torch.amp.GradScaler = Other  # type: ignore[misc]
        with caught() as record:
            line = here() + 1
            gradscaler.unpatch_torch()
        assert_at(record, RuntimeWarning, "torch.amp.GradScaler was rebound", line)
    finally:
        gradscaler.unpatch_torch()
        torch.amp.GradScaler = torchs  # type: ignore[misc]
    assert not gradscaler.is_torch_patched()


def test_patch_torch_with_master_weights_unreached_by_a_loop_without_a_scaler() -> None:
    model = nn.Linear(4, 1).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradscaler.patch_torch(master_weights=True), caught() as record:
        model(torch.ones(2, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        line = here() + 1
        optimizer.step()
    assert_at(record, UserWarning, "patch_torch(master_weights=True) did not reach SGD", line)


def test_with_master_weights_over_float32_parameters() -> None:
    model = nn.Linear(4, 1)
    with caught() as record:
        line = here() + 1
        gradscaler.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    assert_at(record, UserWarning, "after the model is cast to bfloat16/float16", line)


class LegacyProtocolSGD(torch.optim.SGD):
    """Unscales and skips inside its own step, and takes the scaler as ``grad_scaler`` (the old protocol)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # type: ignore[no-untyped-def, override]
        grad_scaler._check_inf_per_device(self)  # the protocol: the optimizer asks the scaler, then skips


def test_a_legacy_grad_scaler_keyword() -> None:
    model = nn.Linear(4, 2)
    optimizer = LegacyProtocolSGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(loss_of(model)).backward()
    with caught() as record:
        line = here() + 1
        scaler.step(optimizer)
    assert_at(record, FutureWarning, "stop passing itself as a keyword argument", line)


# ---------------------------------------------------------------- the run's record


def collapsing() -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    model = nn.Linear(4, 2)
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0, collapse_patience=1, on_collapse="warn")
    return model, torch.optim.SGD(model.parameters(), lr=0.1), scaler


def test_collapse_with_on_collapse_warn() -> None:
    model, optimizer, scaler = collapsing()
    scaler.scale(loss_of(model) * math.inf).backward()
    scaler.step(optimizer)
    with caught() as record:
        line = here() + 1
        scaler.update()
    assert_at(record, ScaleCollapseWarning, "overflow", line)


@pytest.mark.skipif(
    TORCH_VERSION < (2, 11),
    reason="torch 2.4's Dynamo resumes the step's frame at the line before (scaler.step): the warning names it",
)
def test_collapse_warned_from_a_compiled_step_names_the_steps_line() -> None:
    """Compiled, ``update`` is called from Dynamo's resumption of the step's frame: still this file."""
    model, optimizer, scaler = collapsing()

    def step(bad: torch.Tensor) -> None:
        scaler.scale(loss_of(model) * bad).backward()
        scaler.step(optimizer)
        scaler.update()

    compiled = torch.compile(step, backend="eager")
    with caught() as record:
        compiled(torch.tensor(math.inf))
    line = inspect.getsourcelines(step)[1] + 3  # scaler.update()
    assert_at(record, ScaleCollapseWarning, "overflow", line)


# ---------------------------------------------------------------- master weights


def half_model_run(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer, GradScaler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), GradScaler("cpu", master_weights=True)


def test_a_float32_parameter_continued_from_a_saved_master() -> None:
    """A checkpoint of a float16 run loaded where a block is float32 now (peft's adapters): the
    warning comes from the binding at the first step after the loads."""
    model, optimizer, scaler = half_model_run()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            scaler.scale(loss_of(model)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, blob)
    model, optimizer, scaler = half_model_run(seed=1)
    model[1].float()
    saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    with torch.autocast("cpu", dtype=torch.float16):
        scaler.scale(loss_of(model)).backward()
    with caught() as record:
        line = here() + 1
        scaler.step(optimizer)
    assert_at(record, ContinuedWarning, "continues from its saved float32 master", line)


def half_loss(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 4, dtype=torch.float16)).float().pow(2).mean()


def test_a_model_new_to_an_accumulating_scaler_after_its_first_iteration() -> None:
    """Its first micro-batches ran before the scaler met its parameters (at the step): summed by autograd."""
    model, optimizer, _ = half_model_run()
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True)
    for _ in range(2):
        scaler.scale(half_loss(model)).backward()
        scaler.step(optimizer)
        scaler.update()
    second, second_optimizer, _ = half_model_run(seed=1)
    for _ in range(2):
        scaler.scale(half_loss(second)).backward()
    with caught() as record:
        line = here() + 1
        scaler.step(second_optimizer)
    assert_at(record, UserWarning, "4 low-precision parameter(s) of optimizer AdamW met the scaler only", line)
    scaler.update()
    scaler.scale(half_loss(second)).backward()
    with caught() as record:
        scaler.step(second_optimizer)  # hooked now: its next iteration sums in float32, no warning
    assert not record and all(p.grad is None for p in second.parameters())


# ---------------------------------------------------------------- the kernels


def test_a_parameter_hidden_from_the_scaled_graphs_in_the_first_iteration() -> None:
    """A reentrant checkpoint of a callable object the scaler does not look into: the first step warns."""

    class Runner:
        def __init__(self, block: nn.Module) -> None:
            self.block = block

        def __call__(self, h: torch.Tensor) -> torch.Tensor:
            return self.block(h)

    model, optimizer, _ = half_model_run()
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True)
    for _ in range(2):
        h = model[0](torch.ones(2, 4).half())
        hidden = torch.utils.checkpoint.checkpoint(Runner(model[1]), h, use_reentrant=True)
        scaler.scale(hidden.float().pow(2).mean()).backward()
    with caught() as record:
        line = here() + 1
        scaler.step(optimizer)
    assert_at(record, UserWarning, "2 low-precision parameter(s) of optimizer AdamW got gradients in the first", line)


def test_kernel_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose compute capability the Triton kernels do not support (the CPU standing in for it,
    as in tests/test_kernel_fallback.py): the first pass over its gradients that would take the kernels
    (the clipping norm's) warns."""
    triton_stats = pytest.importorskip("gradscaler.kernels.triton_stats")
    if not triton_stats.AVAILABLE:  # pragma: no cover - Triton is part of the test set-up
        pytest.skip("triton is not installed")
    monkeypatch.delenv("GRADSCALER_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels, "_FALLBACK", {})
    monkeypatch.setattr(kernels, "_SUPPORTED", set())
    monkeypatch.setattr(kernels, "_capability", lambda device: (6, 1))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(loss_of(model)).backward()
    with caught() as record:
        line = here() + 1
        scaler.clip_grad_norm_(optimizer, 1.0)
    assert_at(record, kernels.KernelFallbackWarning, "compute capability 6.1", line)


# ---------------------------------------------------------------- all of them


def warnings_in_source() -> set[tuple[str, str]]:
    """(module, category) of every ``warn(message, Category)`` call in the package; fails on a
    ``warnings.warn`` anywhere but in ``errors.warn`` itself."""
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr == "warn":
                assert module == "errors", f"{path}:{node.lineno} calls warnings.warn: use gradscaler.errors.warn"
            elif isinstance(node.func, ast.Name) and node.func.id == "warn":
                category = node.args[1]
                assert isinstance(category, ast.Name), f"{path}:{node.lineno}"
                found.add((module, category.id))
    return found


def test_every_warning_the_package_raises_is_tested_here() -> None:
    assert warnings_in_source() == set(TESTED)
    assert all(name in globals() for name in TESTED.values())
