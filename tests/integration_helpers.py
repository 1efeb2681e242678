"""Shared pieces of the framework integration tests: tiny models, a per-step record, exact comparison.

Every integration test trains the same seeded run twice, once with ``torch.amp.GradScaler("cpu", ...)``
and once with ``gradscaler.GradScaler("cpu", ...)``, and compares the records bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import gradscaler

# Large enough that the first steps overflow in float16 (the scale backs off a few times), small
# growth interval so that the scale also grows within a short run.
EARLY_OVERFLOW = {"init_scale": 2.0**24, "growth_interval": 4}
SCALER_CLASSES: dict[str, Callable[..., Any]] = {"torch": torch.amp.GradScaler, "ours": gradscaler.GradScaler}


@dataclass
class Record:
    """What a run leaves behind, step by step and at the end."""

    losses: list[torch.Tensor] = field(default_factory=list)
    norms: list[Any] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    extra: dict[str, list[Any]] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    opt_state: dict[str, Any] = field(default_factory=dict)

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Record:
        self.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if optimizer is not None:
            self.opt_state = _clone(optimizer.state_dict())
        return self


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def assert_bit_identical(a: Any, b: Any, where: str = "") -> None:
    """Exact equality through nested dicts/lists; tensors by value, dtype and shape (NaN == NaN)."""
    if isinstance(a, Record):
        assert isinstance(b, Record)
        for name in ("losses", "norms", "scales", "extra", "params", "opt_state"):
            assert_bit_identical(getattr(a, name), getattr(b, name), name)
        return
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_bit_identical(a[key], b[key], f"{where}[{key!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{where}[{i}]")
        return
    if isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
        return
    assert a == b, f"{where}: {a!r} != {b!r}"


class TinyGPT(nn.Module):
    """A nanoGPT-shaped language model, small enough for a CPU test: one pre-LN block, tied head."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, block: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc_out(nn.functional.gelu(self.fc(self.ln2(x))))
        logits = self.head(self.ln_f(x))
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss


def token_batches(steps: int, batch: int = 4, block: int = 8, vocab: int = 32, seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, block), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def regression_batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def adamw(params: Any, fused: bool, lr: float = 1e-2) -> torch.optim.Optimizer:
    flags = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **flags)


def poison_(model: nn.Module) -> None:
    """A late overflow: an inf in the first parameter's gradient (after backward, before the step)."""
    grad = next(p for p in model.parameters() if p.grad is not None).grad
    assert grad is not None
    grad.view(-1)[0] = float("inf")


def grad_norm(model: nn.Module) -> torch.Tensor:
    """The 2-norm of the gradients as they are now (a read only: instrumentation, not training)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons: each test starts and ends with them reset."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_gpt2() -> nn.Module:
    """A 2-layer, 32-wide GPT-2 without dropout, seeded: the model the Trainer tests train."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)
