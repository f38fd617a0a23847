"""Optimizer-state bytes, for the planner's memory model (computed from shapes, no model built)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from oobleck_slurm.optim.build import state_layout


def optimizer_state_bytes(
    name: str, shapes: Iterable[tuple[int, ...]], param_dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of optimizer state for parameters of these shapes, step counters included."""
    return sum(
        spec.nbytes for shape in shapes for spec in state_layout(name, tuple(shape), param_dtype).values()
    )


def state_bytes_per_param(
    name: str, shapes: Iterable[tuple[int, ...]], param_dtype: torch.dtype = torch.float32
) -> float:
    """Optimizer-state bytes per parameter element, over parameters of these shapes."""
    shape_list = [tuple(s) for s in shapes]
    numel = sum(math.prod(s) for s in shape_list)
    if numel == 0:
        raise ValueError("state_bytes_per_param: the shapes hold no parameter elements")
    return optimizer_state_bytes(name, shape_list, param_dtype) / numel
