"""The language-modelling loss every built-in family trains with."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions of a microbatch (in at least float32)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # bf16/fp16 logits under autocast
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
