"""Optimizer state layouts: the names, shapes and dtypes of one parameter's state tensors.

A layout is computed from the parameter's shape and dtype alone, so a process that is about to
receive a layer's optimizer state can allocate the tensors before any step, and the planner can
size memory without building the model. `tests/optim` checks each layout against the state a real
optimizer step creates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorLayout:
    """One state tensor: its shape, dtype, and whether the optimizer keeps it on the CPU."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool = False  # step counters torch keeps on the CPU (CAME's; AdamW's unless fused)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


StateLayout = dict[str, TensorLayout]


def adamw_state_layout(
    shape: tuple[int, ...], param_dtype: torch.dtype, amsgrad: bool = False, fused: bool = True
) -> StateLayout:
    """torch.optim.AdamW, not capturable: step + two full moments. torch keeps a fused AdamW's step as
    a float32 scalar on the parameter's device, and any other's as a CPU scalar of its "scalar dtype"
    (float64 under a float64 default)."""
    if fused:
        step = TensorLayout((), torch.float32)
    else:
        step = TensorLayout((), torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32,
                            on_cpu=True)
    layout: StateLayout = {
        "step": step,
        "exp_avg": TensorLayout(tuple(shape), param_dtype),
        "exp_avg_sq": TensorLayout(tuple(shape), param_dtype),
    }
    if amsgrad:
        layout["max_exp_avg_sq"] = TensorLayout(tuple(shape), param_dtype)
    return layout
