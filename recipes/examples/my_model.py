"""Your own model in oobleck-slurm: a small causal transformer built from torch's own layers.

The recipe names this function (`model.factory: my_model:build`); every worker imports it, so its
folder must be on PYTHONPATH (`PYTHONPATH=recipes/examples python -m oobleck_slurm submit ...`).

The rules (the job checks them before any node is allocated):
- `build(seed, start, stop, **kwargs)` returns layers [start, stop) of the model, by name; with
  stop=None, all of them: that is how the job learns the layers' names and count;
- each layer is initialised from (seed, its index) alone, so that a worker building only some layers
  gets the same weights as a full build;
- the first layer takes token ids (batch, seq_len); the last returns logits (batch, seq_len, vocab).
  Between layers, one floating-point tensor.
"""

from __future__ import annotations

import torch
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(seq_len, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """torch's pre-norm encoder layer, made causal."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0,
                                                batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build(seed: int, start: int, stop: int | None, *, depth: int = 7, width: int = 64, heads: int = 4,
          vocab: int = 256, seq_len: int = 64) -> dict[str, nn.Module]:
    """Layers [start, stop) of: embed, block1 .. block<depth>, head."""
    names = ["embed", *(f"block{i}" for i in range(1, depth + 1)), "head"]
    stop = len(names) if stop is None else stop
    layers = {}
    for index in range(start, stop):
        torch.manual_seed(seed * 1000 + index)  # this layer's initialisation depends on nothing else
        if index == 0:
            layer: nn.Module = Embed(vocab, width, seq_len)
            nn.init.normal_(layer.positions, std=0.02)
        elif index == len(names) - 1:
            layer = Head(width, vocab)
        else:
            layer = Block(width, heads)
        layers[names[index]] = layer
    return layers
