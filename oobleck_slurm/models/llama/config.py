"""Llama-family shapes (Llama 2/3, Mistral, Qwen2): small presets for CPU tests and the public shapes
of Llama 3.2 1B/3B and Llama 3.1 8B/70B/405B for planning."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from oobleck_slurm.models.base import LayerEstimate, ModelDef, embedding_estimate, lm_head_estimate

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class LlamaConfig(ModelDef):
    """Decoder with RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP, untied head.
    Layers: embed (token embedding), block.00 .. block.NN, head (final RMSNorm + output projection)."""

    family: ClassVar[str] = "llama"
    supports_document_mask: ClassVar[bool] = True  # models.documents
    n_layer: int
    d_model: int
    n_head: int
    n_kv_heads: int
    ffn_dim: int  # the MLP's hidden width (Hugging Face: intermediate_size)
    seq_len: int
    vocab_size: int = 256
    max_positions: int | None = None  # the longest sequence it was made for (export); default seq_len
    head_dim: int | None = None  # default d_model // n_head
    rope_theta: float = 10000.0
    # Llama 3.1 frequency scaling (Hugging Face rope_type "llama3"); None: plain RoPE.
    rope_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    o_bias: bool = False  # Llama's attention_bias: on the output projection too
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.n_head % self.n_kv_heads:
            raise ValueError(f"llama: n_head={self.n_head} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"llama: d_model={self.d_model} is not a multiple of n_head={self.n_head}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    def layer_keys(self) -> list[str]:
        width = max(2, len(str(self.n_layer - 1)))
        return ["embed"] + [f"block.{i:0{width}d}" for i in range(self.n_layer)] + ["head"]

    def layer_shapes(self) -> list[list[tuple[int, ...]]]:
        """Parameter shapes of each layer (the order of `model.py`'s registration), without building it."""
        d, f, v = self.d_model, self.ffn_dim, self.vocab_size
        q, kv = self.n_head * self.dim_per_head, self.n_kv_heads * self.dim_per_head
        block: list[tuple[int, ...]] = [(d,), (q, d)] + ([(q,)] if self.qkv_bias else [])
        block += [(kv, d)] + ([(kv,)] if self.qkv_bias else []) + [(kv, d)] + ([(kv,)] if self.qkv_bias else [])
        block += [(d, q)] + ([(d,)] if self.o_bias else []) + [(d,)]
        for out, inp in ((f, d), (f, d), (d, f)):  # gate, up, down
            block += [(out, inp)] + ([(out,)] if self.mlp_bias else [])
        embed: list[tuple[int, ...]] = [(v, d)]
        head: list[tuple[int, ...]] = [(d,), (v, d)]
        return [embed] + [block] * self.n_layer + [head]

    @property
    def num_params(self) -> int:
        return sum(_numel(shape) for shapes in self.layer_shapes() for shape in shapes)

    def boundary_shape(self, index: int) -> tuple[int, ...]:
        return (self.seq_len, self.d_model)

    def layer_estimates(self, microbatch_size: int, act_bytes: int, param_bytes: int) -> list[LayerEstimate]:
        """Per microbatch of b sequences of s tokens (t = b * s), e = act_bytes, p = param_bytes,
        q = n_head * head_dim, k = n_kv_heads * head_dim, f = ffn_dim:

        block: forward FLOPs 2 t (matrix parameters) + 4 t s q (attention scores and mix), backward
               twice that; held t * e * (4d + 3q + 3k + 4f) (the norms' inputs and outputs, q/k/v before
               and after rotation, the attention output, SwiGLU's gate, up, activation and product; no
               recompute, fused attention); workspace 2 * t * f * p (gradients of the MLP's hidden)
        head and embed: as the GPT's (`models.gpt.config`).
        Under bf16 autocast the weight matrices' bf16 copies are held too (2 bytes per entry)."""
        b, s, d, v, f = microbatch_size, self.seq_len, self.d_model, self.vocab_size, self.ffn_dim
        q, k = self.n_head * self.dim_per_head, self.n_kv_heads * self.dim_per_head
        t, e, p = b * s, act_bytes, param_bytes
        cast = e < p
        out = []
        for index, (key, shapes) in enumerate(zip(self.layer_keys(), self.layer_shapes())):
            est = LayerEstimate(key, tuple(shapes), 0, 0, 0, 0, 0, 0, 0)
            matrices = sum(_numel(sh) for sh in shapes if len(sh) == 2)
            traffic = est.num_params * e
            casts = 2 * matrices if cast and index > 0 else 0
            if index == 0:
                out.append(embedding_estimate(est, t, d, v, e, p))
            elif index == self.num_layers - 1:
                out.append(lm_head_estimate(est, t, d, v, e, p, casts))
            else:
                flops = 2 * t * matrices + 4 * t * s * q
                out.append(replace(est, forward_flops=flops, forward_bytes=traffic, backward_flops=2 * flops,
                                   backward_bytes=2 * traffic, output_bytes=t * d * p,
                                   activation_bytes=t * e * (4 * d + 3 * q + 3 * k + 4 * f) + casts,
                                   workspace_bytes=2 * t * f * p))
        return out

    def build_layers(self, seed: int, start: int, stop: int, device: torch.device | str | None = None,
                     initialise: bool = True) -> list[nn.Module]:
        from oobleck_slurm.models.llama.model import build_layers

        return build_layers(self, seed, start, stop, device=device, initialise=initialise)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_len=8192, seq_len=8192)
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # CPU test sizes (byte vocabulary): milliseconds per microbatch on one core.
    "tiny": LlamaConfig(n_layer=4, d_model=64, n_head=4, n_kv_heads=2, ffn_dim=176, seq_len=64),
    "mini": LlamaConfig(n_layer=8, d_model=128, n_head=8, n_kv_heads=2, ffn_dim=352, seq_len=128),
    # Public shapes (the models' config.json on Hugging Face); 3.2 ties its embeddings, trained untied here.
    "3.2-1b": LlamaConfig(n_layer=16, d_model=2048, n_head=32, n_kv_heads=8, ffn_dim=8192, rope_factor=32.0,
                          **_LLAMA3),  # type: ignore[arg-type]
    "3.2-3b": LlamaConfig(n_layer=28, d_model=3072, n_head=24, n_kv_heads=8, ffn_dim=8192, rope_factor=32.0,
                          **_LLAMA3),  # type: ignore[arg-type]
    "3.1-8b": LlamaConfig(n_layer=32, d_model=4096, n_head=32, n_kv_heads=8, ffn_dim=14336, rope_factor=8.0,
                          **_LLAMA3),  # type: ignore[arg-type]
    "3.1-70b": LlamaConfig(n_layer=80, d_model=8192, n_head=64, n_kv_heads=8, ffn_dim=28672, rope_factor=8.0,
                           **_LLAMA3),  # type: ignore[arg-type]
    "3.1-405b": LlamaConfig(n_layer=126, d_model=16384, n_head=128, n_kv_heads=8, ffn_dim=53248, rope_factor=8.0,
                            **_LLAMA3),  # type: ignore[arg-type]
}


def llama_config(size: str, **overrides: Any) -> LlamaConfig:
    """The preset `size` with any of its fields overridden."""
    return replace(LLAMA_PRESETS[size], **overrides)
