"""The small GPT-style language model that the demo trains and the benchmark times."""

from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        hidden = nn.functional.gelu(self.fc(self.ln2(x)))
        if keep is not None:
            keep += [q, k, v, hidden, x]
        return x + self.out(hidden)


class TinyGPT(nn.Module):
    """GPT-2-shaped: token + position embeddings, ``layers`` blocks, final norm, tied output head.

    Weights start as GPT-2's (normal, std 0.02; residual projections 0.02 / sqrt(2 * layers)).
    ``forward(tokens, keep=[])`` appends intermediate activations (with ``retain_grad``) to ``keep``.
    """

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        for name, param in self.named_parameters():
            if param.dim() == 2:
                residual = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, tokens: torch.Tensor, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, keep)
        logits = self.ln(x) @ self.tok.weight.t()
        if keep is not None:
            keep.append(logits)
            for activation in keep:
                activation.retain_grad()
        return logits
