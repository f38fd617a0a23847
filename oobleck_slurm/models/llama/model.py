"""The Llama family (Llama 2/3, Mistral, Qwen2) as an ordered list of layers a pipeline planner can cut
anywhere: layer 0 is the token embedding, layers 1..n_layer are pre-norm decoder blocks, the last layer
is the final RMSNorm + output projection. Token ids (B, T) -> hidden (B, T, d) -> ... -> logits (B, T, V).

The numerics follow Hugging Face's `LlamaForCausalLM` (RMSNorm in float32, RoPE in its rotate-half
layout with float32 frequencies, grouped-query attention, SwiGLU), so that a Hugging Face checkpoint
loaded into these layers gives its logits. Module names are Hugging Face's within a layer, which keeps
the adapter (`llama.hf`) a renaming.

As in the GPT family (`models.gpt.model`), every layer is drawn from its own generator seeded by
(seed, layer index) on the CPU: a worker that builds layers [start, stop) on any device gets the same
weights as a full build. The head is never tied to the embedding: they sit on different stages.
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
    from oobleck_slurm.models.llama.config import LlamaConfig

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the input's dtype (as Hugging Face's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim / 2, float32, CPU), with Llama 3.1's frequency scaling
    when `cfg.rope_factor` is set: wavelengths above original_max_len / low_freq_factor are stretched by
    the factor, those below original_max_len / high_freq_factor are kept, and the band between moves
    smoothly from one to the other."""
    dim = cfg.dim_per_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_factor is None:
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Embedding(nn.Module):
    """Token embedding: ids (B, T) -> hidden (B, T, d). Positions enter through RoPE in every block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, idx: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        return self.embed_tokens(idx)  # positions enter in the blocks


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings: each of the n_kv_heads
    key/value heads serves n_head / n_kv_heads consecutive query heads."""

    inv_freq: torch.Tensor  # a non-persistent buffer, remade by every build (`_init_buffers`)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = cfg.n_head, cfg.n_kv_heads, cfg.dim_per_head
        q, kv = cfg.n_head * cfg.dim_per_head, cfg.n_kv_heads * cfg.dim_per_head
        self.q_proj = nn.Linear(cfg.d_model, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.d_model, bias=cfg.o_bias)
        self.register_buffer("inv_freq", torch.empty(cfg.dim_per_head // 2), persistent=False)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # float32 angles whatever the compute dtype: position * frequency loses digits in bf16
        if documents is None:
            positions = torch.arange(t, device=x.device, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq.float()[None, :]
        else:  # each row's own positions, restarting at each document: angles (b, 1, t, .) for every head
            freqs = documents.positions.float()[:, None, :, None] * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv_heads != self.n_head:
            # Every fused SDPA kernel takes equal head counts; enable_gqa falls back to the math kernel
            # on some backends and dtypes.
            rep = self.n_head // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = causal_attention(q, k, v, documents)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class Head(nn.Module):
    """Final RMSNorm + output projection (no bias, untied): hidden (B, T, d) -> logits (B, T, V)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # per token: the documents change nothing here


@torch.no_grad()
def _init_layer(layer: nn.Module, gen: torch.Generator) -> None:
    # Modules are visited in registration order, so the draw sequence is fixed per layer type.
    for module in layer.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            # Drawn on the CPU whatever the device: the same values on every device.
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()


@torch.no_grad()
def _init_buffers(layer: nn.Module, cfg: LlamaConfig) -> None:
    inv_freq = rope_inv_freq(cfg)
    for module in layer.modules():
        if isinstance(module, Attention):
            module.inv_freq.copy_(inv_freq)


def _new_layer(cfg: LlamaConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.num_layers - 1:
        return Head(cfg)
    return Block(cfg)


def build_layers(cfg: LlamaConfig, seed: int, start: int = 0, stop: int | None = None,
                 device: torch.device | str | None = None, initialise: bool = True) -> list[nn.Module]:
    """Layers [start, stop), initialised exactly as in a full build with the same seed
    (`ModelDef.build_layers`)."""
    return build_range(cfg.num_layers, seed, start, stop, device, initialise, lambda index: _new_layer(cfg, index),
                       lambda layer: _init_buffers(layer, cfg), _init_layer)
