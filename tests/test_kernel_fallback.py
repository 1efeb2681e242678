"""Never stranded: when a Triton kernel cannot compile or launch, or the device is too old for it, the
device takes the torch path for the rest of the process with one ``KernelFallbackWarning``.

On the CPU: ``TRITON_DEVICE_TYPES`` is widened to the CPU so that ``GRADSCALER_KERNEL=auto`` takes the
Triton route there (the interpreter), then each failure is injected where Triton raises it: at the
compile of the first launch (``PTXASError``, what a missing or broken ptxas gives), at the launch of
the second kernel of a pass (a driver error, after the first kernel has run), and a compute capability
below ``MIN_CAPABILITY``. Results are compared bit for bit with the torch path's. On a CUDA machine
the same tests run on the GPU, with the real kernels around the injected one.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradscaler import kernels

triton_stats = pytest.importorskip("gradscaler.kernels.triton_stats")
if not triton_stats.AVAILABLE:  # pragma: no cover - Triton is part of the test set-up
    pytest.skip("triton is not installed", allow_module_level=True)
from triton.runtime.errors import PTXASError  # noqa: E402

from gradscaler.kernels import triton_move  # noqa: E402

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
PTXAS = PTXASError("`ptxas` failed with error code 255\n`ptxas` stderr:\nptxas fatal : Value 'sm_70' is not defined")
DRIVER = RuntimeError("Triton Error [CUDA]: device kernel image is invalid")


class Failing:
    """A kernel named ``name`` whose launches raise ``error``; counts them."""

    def __init__(self, error: Exception, name: str = "_chunk_kernel") -> None:
        self.error, self.launches, self.__name__ = error, 0, name

    def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
        def launch(*args: object, **kwargs: object) -> None:
            self.launches += 1
            raise self.error

        return launch


@pytest.fixture(autouse=True)
def triton_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADSCALER_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels, "_FALLBACK", {})
    monkeypatch.setattr(kernels, "_SUPPORTED", set())


def grads(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    tensors = [(torch.randn(s, generator=gen) * 300).to(DEVICE, dtype) for s in [(70_001,), (3, 5), (0,), (4_096,)]]
    tensors[1][2, 2] = math.inf
    return tensors


def torch_path(fn, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``fn()`` under ``GRADSCALER_KERNEL=torch``."""
    with monkeypatch.context() as m:
        m.setenv("GRADSCALER_KERNEL", "torch")
        return fn()


def same(a: kernels.GradStats, b: kernels.GradStats) -> None:
    assert torch.equal(a.nonfinite, b.nonfinite)
    assert (a.norms is None) == (b.norms is None)
    if a.norms is not None and b.norms is not None:
        assert torch.equal(a.norms, b.norms)


def one_warning(record: list[warnings.WarningMessage], *words: str) -> None:
    ours = [w for w in record if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    for word in (str(DEVICE), "GRADSCALER_KERNEL=torch", "GRADSCALER_KERNEL=triton", *words):
        assert word in message, message


FAILURES = {
    # name: (kernel module, kernel attribute, the error, words the warning must hold)
    "compile": (triton_stats, "_chunk_kernel", PTXAS, ("_chunk_kernel", "PTXASError", "ptxas")),
    "launch": (triton_stats, "_tensor_kernel", DRIVER, ("_tensor_kernel", "device kernel image is invalid")),
}


@pytest.mark.parametrize(
    ("failure", "norm_type"),
    [("compile", None), ("compile", 2.0), ("compile", math.inf), ("launch", 2.0), ("launch", math.inf)],
    ids=lambda v: str(v),
)  # a flag-only pass makes no second launch
def test_read_pass_falls_back_once(failure: str, norm_type: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    module, name, error, words = FAILURES[failure]
    failing = Failing(error, name)
    monkeypatch.setattr(module, name, failing)
    tensors = grads(torch.float32)
    inv = torch.tensor(2.0**-8, device=DEVICE)
    expected = torch_path(lambda: kernels.grad_stats(tensors, norm_type, inv), monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = kernels.grad_stats(tensors, norm_type, inv)
        second = kernels.grad_stats(tensors, norm_type, inv)
        moved = [torch.empty(t.shape, device=DEVICE) for t in tensors]  # the move falls back on the same device too
        kernels.move_grads_([t.half() for t in tensors], moved, inv)
    same(first, expected)
    same(second, expected)
    assert float(first.nonfinite) == 1.0
    assert failing.launches == 1  # never tried again on this device
    one_warning(record, *words)
    assert DEVICE in kernels._FALLBACK


@pytest.mark.parametrize("failure", ["compile", "launch"])
@pytest.mark.parametrize("norm_type", [None, 2.0], ids=str)
def test_move_falls_back_once_and_writes_every_value(
    failure: str, norm_type: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed move leaves nothing half-done: the torch path writes every value (bit for bit torch's
    copy and unscale), the flag and norms are the torch path's."""
    error = PTXAS if failure == "compile" else DRIVER
    failing = Failing(error, "_move_kernel")
    monkeypatch.setattr(triton_move, "_move_kernel", failing)
    src = grads(torch.float16)
    factor, norm_inv = torch.tensor(2.0**-8, device=DEVICE), torch.tensor(2.0**-8, device=DEVICE)
    reference = [torch.full(s.shape, 7.0, device=DEVICE) for s in src]
    expected = torch_path(lambda: kernels.move_grads_(src, reference, factor, norm_type, norm_inv), monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            dst = [torch.full(s.shape, 7.0, device=DEVICE) for s in src]
            same(kernels.move_grads_(src, dst, factor, norm_type, norm_inv), expected)
            for out, ref in zip(dst, reference, strict=True):
                assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert failing.launches == 1
    one_warning(record, "_move_kernel", type(error).__name__)


def test_unsupported_architecture_never_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_capability", lambda device: (6, 1))
    failing = Failing(AssertionError("the kernel must not be launched"))
    monkeypatch.setattr(triton_stats, "_chunk_kernel", failing)
    monkeypatch.setattr(triton_move, "_move_kernel", failing)
    tensors = grads(torch.float32)
    expected = torch_path(lambda: kernels.grad_stats(tensors, 2.0), monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            same(kernels.grad_stats(tensors, 2.0), expected)
        kernels.move_grads_([t.half() for t in tensors], [torch.empty(t.shape, device=DEVICE) for t in tensors], None)
    assert failing.launches == 0
    one_warning(record, "compute capability 6.1", "7.0")


def test_forced_triton_raises_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSCALER_KERNEL", "triton")
    monkeypatch.setattr(triton_stats, "_chunk_kernel", Failing(PTXAS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning
        with pytest.raises(kernels.KernelUnavailableError, match=r"_chunk_kernel.*PTXASError") as caught:
            kernels.grad_stats(grads(torch.float32), 2.0)
    assert caught.value.__cause__ is PTXAS
    assert not kernels._FALLBACK


def test_torch_choice_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSCALER_KERNEL", "torch")
    failing = Failing(PTXAS)
    monkeypatch.setattr(triton_stats, "_chunk_kernel", failing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.grad_stats(grads(torch.float32), 2.0)
    assert failing.launches == 0 and not kernels._FALLBACK


def test_other_errors_are_not_taken_for_a_broken_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a failing compile or launch sends a device to the torch path: a bad argument raises as it
    would without the fallback, and the device keeps its kernels."""
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        kernels.move_grads_([torch.ones(3, device=DEVICE)], [torch.empty(3, device=DEVICE)], None)
    assert not kernels._FALLBACK
