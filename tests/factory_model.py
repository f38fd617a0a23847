"""A user's model for the `model.factory` tests, written as a user would write one: not a GPT
(residual MLP blocks, no attention), with a persistent buffer (fixed random positions, saved in
checkpoints) and a non-persistent one (a scale that the seed build remakes).

    model: {factory: "factory_model:make_layers", kwargs: {depth: 3, width: 32, vocab: 256, seq: 32},
            vocab_size: 256, seq_len: 32}

It declares its layers by name (a dict): embed, block.0 .. block.<depth-1>, head.

Workers import it by name: tests put this folder on PYTHONPATH (`factory_pythonpath`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def factory_pythonpath() -> str:
    """PYTHONPATH with this folder first, for the job's processes (they inherit the environment)."""
    return os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.register_buffer("pos", torch.zeros(seq, width))  # persistent: saved with the layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def make_layers(seed: int, start: int, stop: int | None, *, depth: int, width: int, vocab: int, seq: int,
                hidden: int = 64, scale: float = 0.5, notes: dict | None = None,
                dropout: float = 0.0) -> dict[str, nn.Module]:
    """Layers [start, stop) of embedding + `depth` blocks + head (all of them for stop=None), by name;
    each initialised from (seed, index) alone, so that any range builds the same layers. `dropout`: each
    block's output dropped with that probability in training."""
    n = depth + 2
    layers: dict[str, nn.Module] = {}
    for index in range(start, n if stop is None else min(stop, n)):
        layer: nn.Module
        if index == 0:
            name, layer = "embed", Embed(vocab, width, seq)
        elif index == n - 1:
            name, layer = "head", Head(width, vocab)
        else:
            name, layer = f"block.{index - 1}", Block(width, hidden, scale, dropout)
        gen = torch.Generator().manual_seed(seed * 1000 + index)
        with torch.no_grad():
            for p in [*layer.parameters(), *([layer.pos] if isinstance(layer, Embed) else [])]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        layers[name] = layer
    return layers


def shaped_wrong(seed: int, start: int, stop: int | None, **kwargs: int) -> list[nn.Module]:
    """make_layers whose blocks' output is wider than their input: the next layer cannot take it."""
    layers = make_layers(seed, start, stop, **kwargs).values()
    return [nn.Sequential(layer, nn.Linear(kwargs["width"], kwargs["width"] + 1)) if isinstance(layer, Block)
            else layer for layer in layers]


def not_modules(seed: int, start: int, stop: int | None, **kwargs: int) -> dict[str, int]:
    return {"layers": 3}


def ignores_the_range(seed: int, start: int, stop: int | None, **kwargs: int) -> list[nn.Module]:
    """A factory that always returns its whole model, whatever range is asked for."""
    return list(make_layers(seed, 0, None, **kwargs).values())


class FunctionalDropoutBlock(Block):
    """Dropout called as a function, as attention code often does (no module to find by its type)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(self.norm(x))))
        return x + self.scale * nn.functional.dropout(h, 0.2, self.training)


def functional_dropout(seed: int, start: int, stop: int | None, **kwargs: int) -> list[nn.Module]:
    """make_layers whose blocks drop with `nn.functional.dropout`."""
    out: list[nn.Module] = []
    for layer in make_layers(seed, start, stop, **kwargs).values():
        if isinstance(layer, Block):
            block = FunctionalDropoutBlock(kwargs["width"], kwargs.get("hidden", 64), kwargs.get("scale", 0.5))
            block.load_state_dict(layer.state_dict())
            layer = block
        out.append(layer)
    return out


class NormedBlock(Block):
    """A block that normalises its input with BatchNorm over the channels (running statistics)."""

    def __init__(self, width: int, hidden: int, scale: float) -> None:
        super().__init__(width, hidden, scale)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.bn(x.transpose(1, 2)).transpose(1, 2))


class CountingBlock(Block):
    """A block that counts the samples it has seen in a buffer of its own (updated in place)."""

    def __init__(self, width: int, hidden: int, scale: float) -> None:
        super().__init__(width, hidden, scale)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        return super().forward(x)


def with_block(kind: type[Block]) -> object:
    def factory(seed: int, start: int, stop: int | None, **kwargs: int) -> list[nn.Module]:
        out: list[nn.Module] = []
        for layer in make_layers(seed, start, stop, **kwargs).values():
            out.append(kind(kwargs["width"], kwargs.get("hidden", 64), kwargs.get("scale", 0.5))
                       if isinstance(layer, Block) else layer)
        return out
    return factory


batch_norm = with_block(NormedBlock)
counting = with_block(CountingBlock)
