"""Test configuration: Triton's interpreter on machines without CUDA, and the CUDA skip policy."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Set before any Triton kernel is defined: the kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def torch_left_unpatched():
    """Every test must leave torch's GradScaler spellings as it found them (gradscaler.patch_torch)."""
    import gradscaler

    yield
    patched = gradscaler.drop_in.is_torch_patched()
    gradscaler.unpatch_torch()
    assert not patched, "the test left torch patched: undo gradscaler.patch_torch() (or use it as a context manager)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    if os.environ.get("GRADSCALER_REQUIRE_CUDA") == "1":
        raise pytest.UsageError("GRADSCALER_REQUIRE_CUDA=1 but torch.cuda.is_available() is False.")
    skip = pytest.mark.skip(reason="needs a CUDA device (set GRADSCALER_REQUIRE_CUDA=1 to make this an error)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
