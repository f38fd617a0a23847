"""The optimizers by name: construction, and the state layout of each for one parameter."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from oobleck_slurm.optim.came import CAME, came_state_layout
from oobleck_slurm.optim.layout import StateLayout, adamw_state_layout

OPTIMIZER_NAMES = ("adamw", "came")


def _check_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}: expected one of {', '.join(OPTIMIZER_NAMES)}")


def build_optimizer(
    name: str,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, ...] | None = None,
    eps: float | tuple[float, ...] | None = None,
) -> torch.optim.Optimizer:
    """'adamw' (betas (0.9, 0.999), eps 1e-8) or 'came' (betas (0.9, 0.999, 0.9999), eps
    (1e-30, 1e-16), clip threshold 1), both with decoupled weight decay.

    AdamW runs torch's fused kernel on a GPU and on the CPU: on a GPU one kernel updates all of a
    layer's tensors (the foreach path launches one per operation), on the CPU one vectorised pass per
    tensor is 2-3x faster than one operation at a time over the tiny and mini GPTs' layers in fp32, 2x
    in fp64. Replicas of a layer run the same kind on the same tensors (the engine makes one optimizer
    per layer), so they stay bitwise equal, which recovery relies on when it copies state.
    """
    _check_name(name)
    if name == "adamw":
        betas = (0.9, 0.999) if betas is None else tuple(betas)
        eps = 1e-8 if eps is None else eps
        if len(betas) != 2 or not isinstance(eps, (int, float)):
            raise ValueError(f"adamw: betas must be 2 values and eps one number, got {betas}, {eps}")
        groups: list[Any] = list(params)
        tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
        fusable = bool(tensors) and all(t.device.type in ("cuda", "cpu") for t in tensors)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=float(eps), weight_decay=weight_decay,
                                 fused=fusable or None)
    came_betas, came_eps = came_betas_eps(betas, eps)
    return CAME(params, lr=lr, betas=came_betas, eps=came_eps, weight_decay=weight_decay)


def came_betas_eps(betas: tuple[float, ...] | None,
                   eps: float | tuple[float, ...] | None) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """CAME's betas and eps with the defaults filled in (betas (0.9, 0.999, 0.9999), eps (1e-30, 1e-16)):
    the whole-layer CAME and the sharded one of a wide stage (came_sharded.py) take the same."""
    betas = (0.9, 0.999, 0.9999) if betas is None else tuple(betas)
    eps = (1e-30, 1e-16) if eps is None else eps
    if len(betas) != 3 or isinstance(eps, (int, float)) or len(eps) != 2:
        raise ValueError(f"came: betas must be 3 values and eps 2 values, got {betas}, {eps}")
    return (betas[0], betas[1], betas[2]), (eps[0], eps[1])


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    """'adamw' or 'came' for an optimizer `build_optimizer` made."""
    if isinstance(opt, CAME):
        return "came"
    if isinstance(opt, torch.optim.AdamW):
        return "adamw"
    raise TypeError(f"unsupported optimizer {type(opt).__name__}: expected AdamW or CAME")


def state_layout(
    name: str, shape: tuple[int, ...], param_dtype: torch.dtype, amsgrad: bool = False, fused: bool = True
) -> StateLayout:
    """The state tensors optimizer `name` keeps for one parameter of this shape and dtype (`fused`:
    AdamW's kernel, as `build_optimizer` picks it on CPUs and GPUs)."""
    _check_name(name)
    if name == "adamw":
        return adamw_state_layout(tuple(shape), param_dtype, amsgrad, fused)
    return came_state_layout(tuple(shape), param_dtype)
