"""Document masking (`data.document_mask`): a training window packs several documents, each ended by the
end-of-document token (eos), and with masking on each document is trained as if it were alone.

`Documents.of(tokens, eos_id)` reads the structure from a microbatch's input token ids (b, t): a
token belongs to the document that the last eos before it ended (an eos belongs to the document it
ends), and its position is its offset from that document's first token in the window (a document that
began in an earlier window starts at 0 here: it is trained as the part this window holds). Every
stage computes it from the token ids of its own rows, read by the same reader as the first and last
stages' samples (engine/worker.py): nothing extra crosses a stage boundary.

The built-in families take it as their layers' optional second argument (`run_layer`): the GPT's
position embedding and the Llama's rotary angles use `positions`, and every attention layer calls
`causal_attention`, which with documents lets a query see only the keys of its own document at or
before it (block-diagonal and causal). Without documents every call is the one it always was.

The kernel is `scaled_dot_product_attention` with a boolean mask (b, 1, t, t), built once per
microbatch and stage and shared by its layers. torch's `flex_attention` has no backward on the CPU
(torch 2.13: "FlexAttention does not support backward on CPU", eager or compiled), so it cannot train
here; on a GPU an explicit mask also means SDPA's flash kernel is not used (the memory-efficient or
math kernel runs instead): docs/data.md, "Document masking".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Documents:
    """The documents of a microbatch's rows: `positions` (b, t) int64, each token's offset in its
    document; `mask` (b, 1, t, t) bool, True where query i may attend key j (same document, j <= i)."""

    positions: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def of(tokens: torch.Tensor, eos_id: int) -> Documents:
        """The structure of the input token ids `tokens` (b, t), on their device (no host sync)."""
        ends = tokens == eos_id
        document = torch.cumsum(ends, dim=1) - ends.long()  # the eos tokens before each token
        t = tokens.shape[1]
        index = torch.arange(t, device=tokens.device).expand(tokens.shape)
        starts = torch.ones_like(ends)
        starts[:, 1:] = ends[:, :-1]
        first = torch.where(starts, index, 0).cummax(dim=1).values  # where each token's document starts
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        mask = (document[:, :, None] == document[:, None, :]) & causal
        return Documents(index - first, mask[:, None])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    """Causal self-attention of (b, heads, t, head_dim) tensors; with `documents`, within each document."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask)


def run_layer(layer: nn.Module, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
    """`layer(x)`, and `layer(x, documents)` with document masking (the built-in families' layers take
    it as an optional second argument; a factory's layers are never given one: recipe validation)."""
    return layer(x) if documents is None else layer(x, documents)
