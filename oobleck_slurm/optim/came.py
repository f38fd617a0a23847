"""CAME: Confidence-guided Adaptive Memory Efficient optimization (Luo et al., ACL 2023).

Adafactor's factored second moment plus a confidence term, also factored. For a (.., m, n) tensor
(factored over its last two dimensions) the state is the first moment (m*n) and four vectors of
m or n entries; Adam keeps 2*m*n. One step (Algorithm 1 of the paper, with means instead of sums,
which leaves every ratio unchanged):

    r = b2 r + (1-b2) mean_cols(g^2 + eps1)      c = b2 c + (1-b2) mean_rows(g^2 + eps1)
    u = g / sqrt(r c^T / mean(r))                 u = u / max(1, rms(u) / d)
    m = b1 m + (1-b1) u
    U = (u - m)^2 + eps2
    R = b3 R + (1-b3) mean_cols(U)                C = b3 C + (1-b3) mean_rows(U)
    p = p - lr*wd*p  (decoupled weight decay)     p = p - lr * m / sqrt(R C^T / mean(R))

A tensor with fewer than two dimensions (bias, LayerNorm) keeps an unfactored second moment and,
as in the authors' release, is updated with m directly: the paper defines the confidence term for
matrices only. No bias correction, as in the paper.

The step counter is a CPU int64 tensor so that the whole state is tensors (recovery sends it over
torch.distributed). State is float32 for 16-bit parameters, else the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from oobleck_slurm.optim.layout import StateLayout, TensorLayout


def came_state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Statistics of 16-bit parameters are kept in float32: eps1 = 1e-30 underflows in bf16."""
    return torch.float32 if param_dtype in (torch.float16, torch.bfloat16) else param_dtype


def came_state_layout(shape: tuple[int, ...], param_dtype: torch.dtype) -> StateLayout:
    """Names, shapes and dtypes of CAME's state for one parameter (the single source of truth)."""
    dt = came_state_dtype(param_dtype)
    layout: StateLayout = {
        "step": TensorLayout((), torch.int64, on_cpu=True),
        "exp_avg": TensorLayout(tuple(shape), dt),
    }
    if len(shape) >= 2:
        row = tuple(shape[:-1])
        col = tuple(shape[:-2]) + (shape[-1],)
        layout["exp_avg_sq_row"] = TensorLayout(row, dt)
        layout["exp_avg_sq_col"] = TensorLayout(col, dt)
        layout["exp_avg_res_row"] = TensorLayout(row, dt)
        layout["exp_avg_res_col"] = TensorLayout(col, dt)
    else:
        layout["exp_avg_sq"] = TensorLayout(tuple(shape), dt)
    return layout


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.norm(2) / (t.numel() ** 0.5)


def _inv_sqrt_factored(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(row col^T / mean(row)), broadcast to (.., m, n), without forming the product."""
    row_scale = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
    return row_scale * col.rsqrt().unsqueeze(-2)


def check_came_hyper(lr: float, betas: tuple[float, ...], eps: tuple[float, ...], clip_threshold: float,
                     weight_decay: float) -> None:
    """Raise ValueError for hyper-parameters CAME cannot run with (shared by the sharded CAME)."""
    if not lr > 0.0:
        raise ValueError(f"CAME: lr must be > 0, got {lr}")
    if len(betas) != 3 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"CAME: betas must be three values in [0, 1), got {betas}")
    if len(eps) != 2 or not all(e >= 0.0 for e in eps):
        raise ValueError(f"CAME: eps must be two values >= 0, got {eps}")
    if not clip_threshold > 0.0:
        raise ValueError(f"CAME: clip_threshold must be > 0, got {clip_threshold}")
    if weight_decay < 0.0:
        raise ValueError(f"CAME: weight_decay must be >= 0, got {weight_decay}")


class CAME(torch.optim.Optimizer):
    """CAME; `betas` = (b1, b2, b3), `eps` = (eps1, eps2), `clip_threshold` = d."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
    ) -> None:
        check_came_hyper(lr, betas, eps, clip_threshold, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=tuple(eps),
            clip_threshold=clip_threshold,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        for key, spec in came_state_layout(tuple(p.shape), p.dtype).items():
            device = torch.device("cpu") if spec.on_cpu else p.device
            state[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2, b3 = group["betas"]
            eps1, eps2 = group["eps"]
            lr, wd, d = group["lr"], group["weight_decay"], group["clip_threshold"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CAME does not support sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] += 1
                dt = state["exp_avg"].dtype
                g = p.grad.to(dt)
                factored = p.dim() >= 2

                sq = g * g + eps1
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(b2).add_(sq.mean(dim=-1), alpha=1.0 - b2)
                    col.mul_(b2).add_(sq.mean(dim=-2), alpha=1.0 - b2)
                    u = g * _inv_sqrt_factored(row, col)
                else:
                    v = state["exp_avg_sq"]
                    v.mul_(b2).add_(sq, alpha=1.0 - b2)
                    u = g * v.rsqrt()
                u.div_((_rms(u) / d).clamp_(min=1.0))

                m = state["exp_avg"]
                m.mul_(b1).add_(u, alpha=1.0 - b1)

                if factored:
                    res = (u - m).square_().add_(eps2)
                    rrow, rcol = state["exp_avg_res_row"], state["exp_avg_res_col"]
                    rrow.mul_(b3).add_(res.mean(dim=-1), alpha=1.0 - b3)
                    rcol.mul_(b3).add_(res.mean(dim=-2), alpha=1.0 - b3)
                    update = m * _inv_sqrt_factored(rrow, rcol)
                else:
                    update = m

                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
        return loss
