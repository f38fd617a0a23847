"""GPT as an ordered list of layers that a pipeline planner can cut anywhere.

Layer 0 is the token + position embedding, layers 1..n_layer are pre-LN transformer blocks, the last
layer is the final LayerNorm + LM head. Every layer takes one tensor and returns one tensor, so any
contiguous range of layers is a pipeline stage: token ids (B, T) -> hidden (B, T, d) -> ... -> logits
(B, T, vocab).

Each layer is initialised from its own generator seeded by (seed, layer index): a worker that builds
only layers [start, stop) gets bit-identical weights to a full build, without building the rest.

Embeddings are untied by default: with tied weights the embedding and the head (first and last stage)
would share one parameter across two workers, and its gradient would need an extra all-reduce between
the two stages. A single-stage build (all layers on one worker) ties them normally; a partial build
with `tie_embeddings=True` raises NotImplementedError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_slurm.models.base import build_range
from oobleck_slurm.models.documents import Documents, causal_attention

if TYPE_CHECKING:
    # For the annotations only: config.py builds layers by calling this module (lazily, as it must stay
    # importable without torch), so this module names its config's type without importing it.
    from oobleck_slurm.models.gpt.config import GPTConfig

INIT_STD = 0.02  # GPT-2 / nanoGPT initialisation


class Embedding(nn.Module):
    """Token + learned position embedding: ids (B, T) -> hidden (B, T, d)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        if documents is not None:  # positions restart at each document's first token
            return self.tok(idx) + self.pos(documents.positions)
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.tok(idx) + self.pos(pos)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    The key bias is masked out (it stays a parameter, so shapes and counts are GPT-2's): adding the
    same vector to every key shifts all of a query's scores by one constant, which softmax removes,
    so its true gradient is zero and the computed one is pure rounding noise. Adam-type optimizers
    normalise that noise into full-size updates, which would make the key bias differ between two
    runs that sum the same gradients in a different order (e.g. different pipeline plans).
    """

    qkv_bias_mask: torch.Tensor  # a buffer: declared for the type checker (nn.Module.__getattr__ is untyped)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"GPTConfig: d_model={cfg.d_model} is not a multiple of n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.ones(3 * cfg.d_model)
        mask[cfg.d_model : 2 * cfg.d_model] = 0.0
        self.register_buffer("qkv_bias_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        b, t, d = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias * self.qkv_bias_mask)
        q, k, v = qkv.split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = causal_attention(q, k, v, documents)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), documents)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm + LM head: hidden (B, T, d) -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        return self.lm_head(self.ln(x))  # per token: the documents change nothing here


@torch.no_grad()
def _init_layer(layer: nn.Module, gen: torch.Generator, n_layer: int) -> None:
    # Parameters are visited in registration order, so the draw sequence is fixed per layer type.
    for name, p in layer.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in f".{name}" and p.dim() == 1:  # LayerNorm weight
            p.fill_(1.0)
        else:
            std = INIT_STD
            if name.endswith("proj.weight"):  # residual projections, GPT-2 scaling
                std = INIT_STD / math.sqrt(2 * n_layer)
            # Drawn on the CPU whatever the device: the same values on every device.
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _new_layer(cfg: GPTConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.num_layers - 1:
        return Head(cfg)
    return Block(cfg)


def build_layers(cfg: GPTConfig, seed: int, start: int = 0, stop: int | None = None,
                 device: torch.device | str | None = None, initialise: bool = True) -> list[nn.Module]:
    """Layers [start, stop) of the GPT, initialised exactly as in a full build with the same seed
    (`ModelDef.build_layers`)."""
    n, end = cfg.num_layers, cfg.num_layers if stop is None else stop
    if cfg.tie_embeddings and 0 <= start < end <= n and (start, end) != (0, n):  # a bad range: build_range says
        raise NotImplementedError(
            f"build_layers: tie_embeddings=True needs the embedding and the head on one stage, "
            f"but layers [{start}, {stop}) of [0, {n}) were asked for; use tie_embeddings=False "
            f"for multi-stage plans"
        )
    layers = build_range(n, seed, start, stop, device, initialise, lambda index: _new_layer(cfg, index),
                         lambda layer: _init_buffers(layer, cfg),
                         lambda layer, gen: _init_layer(layer, gen, cfg.n_layer))
    if cfg.tie_embeddings:  # full build only (checked above)
        embedding, head = layers[0], layers[-1]
        assert isinstance(embedding, Embedding) and isinstance(head, Head)
        head.lm_head.weight = embedding.tok.weight
    return layers


@torch.no_grad()
def _init_buffers(layer: nn.Module, cfg: GPTConfig) -> None:
    for module in layer.modules():
        if isinstance(module, CausalSelfAttention):
            module.qkv_bias_mask.fill_(1.0)
            module.qkv_bias_mask[cfg.d_model : 2 * cfg.d_model] = 0.0
