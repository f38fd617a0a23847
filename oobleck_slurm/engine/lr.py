"""Learning rate per step: linear warmup, then cosine (or linear, or constant) decay to `min_lr`."""

from __future__ import annotations

import math

DECAYS = ("cosine", "linear", "constant")


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
          decay: str = "cosine") -> float:
    """The learning rate of step `step` (0-based) of a run of `total_steps` steps."""
    if decay not in DECAYS:
        raise ValueError(f"lr schedule: decay must be one of {DECAYS}, got {decay!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
