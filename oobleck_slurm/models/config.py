"""GPT model shapes: named presets from CPU-test size to GPT-3 175B (planning only at that size)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer: embedding, `n_layer` blocks, final norm, head."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int = 256  # byte-level tokenizer by default: nothing to download
    # Untied by default: the head and the embedding usually sit on different pipeline stages.
    tie_embeddings: bool = False

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
