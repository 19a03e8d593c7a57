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


class LoopedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class Looped(nn.Module):
    """A universal-transformer shape: one block registered once, run ``steps`` times."""

    def __init__(self, steps: int = 4) -> None:
        super().__init__()
        self.steps = steps
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.block = LoopedBlock()
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(self.steps):
            x = self.block(x)
        return self.out(x)


class SingleBlockList(nn.Module):
    """A ModuleList holding one block, indexed in a loop (ALBERT's layer-group shape)."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.steps = steps
        self.groups = nn.ModuleList([LoopedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in range(self.steps):
            x = self.groups[step % len(self.groups)](x)
        return x.sum(-1)


class Sine(nn.Module):
    """A block with no parameters or buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 0.5 + x


class ParameterlessBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.waves = nn.ModuleList([Sine(), Sine()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for wave in self.waves:
            x = wave(x)
        return x


class ScaledBlock(nn.Module):
    """The smallest block that makes dynamo restart from inside the backend call.

    Each block has its own float ``scale``. The second block fails the first one's
    guard on the float, dynamo recompiles with the float dynamic, and AOTAutograd's
    tensorify pass raises ``TensorifyScalarRestartAnalysis`` to restart with it
    specialised (Swin's per-block ``drop_path`` probabilities do the same).
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x) * torch.full((1,), 1.0 - self.scale)


class ScaledStack(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock(0.1 * i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


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
