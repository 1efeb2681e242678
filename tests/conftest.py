"""Test configuration: one torch thread, Triton's interpreter on machines without CUDA, the CUDA skip policy."""

from __future__ import annotations

import os

import pytest
import torch

# One torch thread (``GRADSCALER_TEST_THREADS=N`` another count, 0 torch's own), in this process and the ones it
# starts. On a loaded machine two OpenMP threads wait for each other at every operation: 9 transformer runs of
# tests/test_differential.py took 108 s with torch's two threads and 10 s with one, at a load of 5 on 2 cores
# (docs/development.md, "How long make test takes"). Below 32,768 elements torch's CPU kernels do not split work
# between threads, so nearly every test computes the same bits on one; the tests marked ``torch_threads`` (sums of
# larger tensors held to float64 within tolerances measured on torch's own count, which splits them) keep torch's.
TORCH_THREADS = torch.get_num_threads()
THREADS = int(os.environ.get("GRADSCALER_TEST_THREADS", "1")) or TORCH_THREADS
torch.set_num_threads(THREADS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)

if not torch.cuda.is_available():
    # Set before any Triton kernel is defined: the kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def torch_threads(request: pytest.FixtureRequest):
    """Torch's own thread count for a test marked ``torch_threads``, the tests' count again after it."""
    if request.node.get_closest_marker("torch_threads") is None:
        yield
        return
    torch.set_num_threads(TORCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def torch_left_unpatched():
    """Every test must leave torch's GradScaler spellings as it found them (gradscaler.patch_torch)."""
    import gradscaler

    yield
    patched = gradscaler.drop_in.is_torch_patched()
    gradscaler.unpatch_torch()
    assert not patched, "the test left torch patched: undo gradscaler.patch_torch() (or use it as a context manager)"


SLOW = os.environ.get("GRADSCALER_SLOW") == "1"
"""Whether the tests marked ``slow`` run: soak-sized repeats of what ``make test`` runs at a smaller size
(``make test-slow`` sets it; so does a ``-m`` expression that names ``slow``)."""


def pytest_report_header(config: pytest.Config) -> str:
    ran = SLOW or "slow" in (config.option.markexpr or "")
    slow = "run" if ran else "left out (make test-slow runs them)"
    return f"torch threads: {THREADS} (GRADSCALER_TEST_THREADS); tests marked slow: {slow}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SLOW and "slow" not in (config.option.markexpr or ""):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    if torch.cuda.is_available():
        return
    if os.environ.get("GRADSCALER_REQUIRE_CUDA") == "1":
        raise pytest.UsageError("GRADSCALER_REQUIRE_CUDA=1 but torch.cuda.is_available() is False.")
    skip = pytest.mark.skip(reason="needs a CUDA device (set GRADSCALER_REQUIRE_CUDA=1 to make this an error)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
