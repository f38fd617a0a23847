"""GPT shapes: named presets from CPU-test size to GPT-3 175B (planning only at that size)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from oobleck_slurm.models.base import LayerEstimate, ModelDef, embedding_estimate, lm_head_estimate

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class GPTConfig(ModelDef):
    """GPT-2-style decoder: token + learned position embedding, `n_layer` pre-LN blocks (attention,
    4x GELU MLP, biases), final LayerNorm + head. Layers: embed, block.00 .. block.NN, head."""

    family: ClassVar[str] = "gpt"
    supports_document_mask: ClassVar[bool] = True  # models.documents
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int = 256  # byte-level tokenizer by default: nothing to download
    # Untied by default: the head and the embedding usually sit on different pipeline stages.
    tie_embeddings: bool = False

    def layer_keys(self) -> list[str]:
        width = max(2, len(str(self.n_layer - 1)))
        return ["embed"] + [f"block.{i:0{width}d}" for i in range(self.n_layer)] + ["head"]

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block (attention + 4x MLP + two LayerNorms, with biases)."""
        d = self.d_model
        return 12 * d * d + 13 * d

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        final_norm = 2 * self.d_model
        return self.embedding_params + self.n_layer * self.block_params + final_norm + head

    def boundary_shape(self, index: int) -> tuple[int, ...]:
        return (self.seq_len, self.d_model)

    def layer_shapes(self) -> list[list[tuple[int, ...]]]:
        """Parameter shapes of each layer, in registration order, without building it."""
        d, v = self.d_model, self.vocab_size
        embed: list[tuple[int, ...]] = [(v, d), (self.seq_len, d)]
        block: list[tuple[int, ...]] = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d),
                                        (4 * d,), (d, 4 * d), (d,)]
        head: list[tuple[int, ...]] = [(d,), (d,), (v, d)]
        return [embed] + [block] * self.n_layer + [head]

    def layer_estimates(self, microbatch_size: int, act_bytes: int, param_bytes: int) -> list[LayerEstimate]:
        """Per microbatch of b sequences of s tokens (t = b * s), e = act_bytes, p = param_bytes:

        block: forward FLOPs t * (24 d^2 + 4 s d), backward twice that; held activations
               t * d * 34 * e / 2 + t * h * 4 (Korthikanti et al. 2022, no recompute, without their
               5 h s / d term: the fused attention of scaled_dot_product_attention keeps no s x s scores,
               only each row's fp32 log-sum-exp; measured on an H200 the term made the estimate 2.1x
               the activations a 1.3B slice holds); workspace 2 * t * 4d * p (the gradients of the
               MLP's hidden activations)
        head:  forward FLOPs 2 t d V; held: its input and the loss's fp32 log-probabilities (t * V * 4);
               workspace 2 * t * V * 4 + 2 * t * d * p
        embed: memory bound: t * d * e bytes written forward, twice that backward; held: the token ids;
               workspace V * d * p + t * d * p (the dense gradient of its table, of its output)

        Under bf16 autocast (e = 2 with p = 4) every weight matrix of a block and the head is also cast
        to bf16 once per forward and kept for the backward: 2 bytes per matrix entry held."""
        b, s, d, h, v = microbatch_size, self.seq_len, self.d_model, self.n_head, self.vocab_size
        t, e, p = b * s, act_bytes, param_bytes
        cast = e < p
        out = []
        for index, (key, shapes) in enumerate(zip(self.layer_keys(), self.layer_shapes())):
            est = LayerEstimate(key, tuple(shapes), 0, 0, 0, 0, 0, 0, 0)
            traffic = est.num_params * e  # weights read by the compute, in its dtype
            casts = 2 * sum(x * y for x, y in (sh for sh in shapes if len(sh) == 2)) if cast and index > 0 else 0
            if index == 0:
                out.append(embedding_estimate(est, t, d, v, e, p))
            elif index == self.num_layers - 1:
                out.append(lm_head_estimate(est, t, d, v, e, p, casts))
            else:
                flops = t * (24 * d * d + 4 * s * d)
                out.append(replace(est, forward_flops=flops, forward_bytes=traffic, backward_flops=2 * flops,
                                   backward_bytes=2 * traffic, output_bytes=t * d * p,
                                   activation_bytes=int(t * d * 34 * e / 2) + t * h * 4 + casts,
                                   workspace_bytes=2 * t * 4 * d * p))
        return out

    def build_layers(self, seed: int, start: int, stop: int, device: torch.device | str | None = None,
                     initialise: bool = True) -> list[nn.Module]:
        from oobleck_slurm.models.gpt.model import build_layers

        return build_layers(self, seed, start, stop, device=device, initialise=initialise)


GPT_PRESETS: dict[str, GPTConfig] = {
    # CPU test sizes: a forward+backward of one microbatch takes milliseconds on one core.
    "tiny": GPTConfig(n_layer=4, d_model=64, n_head=4, seq_len=64),
    "mini": GPTConfig(n_layer=8, d_model=128, n_head=4, seq_len=128),
    # About 100M parameters with the byte-level vocabulary: the recovery benchmark's large model.
    "100m": GPTConfig(n_layer=12, d_model=832, n_head=13, seq_len=256),
    # GPT-3 paper shapes (Brown et al. 2020, table 2.1), GPT-2 BPE vocabulary padded to 50304.
    "125m": GPTConfig(n_layer=12, d_model=768, n_head=12, seq_len=2048, vocab_size=50304),
    "350m": GPTConfig(n_layer=24, d_model=1024, n_head=16, seq_len=2048, vocab_size=50304),
    "1.3b": GPTConfig(n_layer=24, d_model=2048, n_head=16, seq_len=2048, vocab_size=50304),
    "2.7b": GPTConfig(n_layer=32, d_model=2560, n_head=32, seq_len=2048, vocab_size=50304),
    "6.7b": GPTConfig(n_layer=32, d_model=4096, n_head=32, seq_len=2048, vocab_size=50304),
    "13b": GPTConfig(n_layer=40, d_model=5120, n_head=40, seq_len=2048, vocab_size=50304),
    "175b": GPTConfig(n_layer=96, d_model=12288, n_head=96, seq_len=2048, vocab_size=50304),
}


def gpt_config(size: str, **overrides: Any) -> GPTConfig:
    """The preset `size` with any of its fields overridden (e.g. `n_layer=32` for the planner bench)."""
    return replace(GPT_PRESETS[size], **overrides)
