"""Tiny models with every kind of shared structure the library must keep."""

from __future__ import annotations

import torch
from torch import nn

from lightning_regions import snapshot

WIDTH = 8


class PositionalBias(nn.Module):
    """Held by every block and by the root: a descendant shared across a region edge."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Block(nn.Module):
    def __init__(self, positional: PositionalBias) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.positional = positional
        self.register_module("unused", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(self.positional(x))))


class SharedModel(nn.Module):
    """Aliases, a block at two positions, a shared descendant, ``None`` and a tie.

    - ``blocks_alias`` is ``blocks`` (the accelerate alias repro: forward uses it);
    - ``blocks[-1]`` is ``blocks[0]`` (one block at two positions);
    - ``positional`` is held by the root and by every block;
    - ``dropped`` is registered as ``None``;
    - ``head.weight`` is ``embed.weight``;
    - ``classifier`` is a mixed-class ``ModuleList`` that forward iterates.
    """

    def __init__(self, depth: int = 4, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.positional = PositionalBias()
        self.blocks = nn.ModuleList(Block(self.positional) for _ in range(depth))
        self.blocks.append(self.blocks[0])
        self.blocks_alias = self.blocks
        self.register_module("dropped", None)
        self.classifier = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.GELU()])
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.positional(self.embed(tokens))
        x = self.blocks_alias[0](x)
        for block in self.blocks[1:]:
            x = block(x)
        for layer in self.classifier:
            x = layer(x)
        return self.head(x)


class Stack(nn.Module):
    """``depth`` identical blocks and nothing shared: for graph counting."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(depth)
        )
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


class Flat(nn.Module):
    """No repeated blocks at all."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def tokens(batch: int = 2, length: int = 5, vocab: int = 11, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def registrations(module: nn.Module) -> dict[int, tuple]:
    """Every module's registration dicts, as (name, object id) items: to prove no change."""
    return {
        id(m): tuple(
            tuple((name, id(v)) for name, v in getattr(m, attr).items())
            for attr in ("_modules", "_parameters", "_buffers")
        )
        for m in snapshot(module).distinct_modules()
    }
