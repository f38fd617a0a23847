"""CAME (came.py) on a flat shard of a parameter: groundwork for CAME on wide stages (issue 23; not yet
used by the engine, which still refuses CAME on a stage wider than one worker).

A rank of a wide stage holds elements [lo, hi) of each parameter (row-major flat order). CAME's
factored statistics are means over whole rows and columns, and its update clip is the RMS over the
whole tensor, so each is computed from per-shard partial sums reduced across the stage
(`stage_sum`, a sum in place over the stage's ranks: the engine posts it on the stage group and waits
on it abortably). The row and column vectors (m + n entries) are kept whole on every rank of the
stage; the first moment is sharded like the parameter. Three reductions per step and parameter: the
squared gradient's row/column sums, the sum of u^2, the residual's row/column sums. Only the order of
the sums changes against `CAME.step` on the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oobleck_slurm.optim.came import came_state_dtype

StageSum = Callable[[list[torch.Tensor]], None]  # sums each tensor in place over the stage's ranks


@dataclass(frozen=True)
class CameHyper:
    lr: float
    betas: tuple[float, float, float] = (0.9, 0.999, 0.9999)
    eps: tuple[float, float] = (1e-30, 1e-16)
    clip_threshold: float = 1.0
    weight_decay: float = 0.0


def piece_indices(shape: tuple[int, ...], lo: int, hi: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For elements [lo, hi) of a (.., m, n) tensor in row-major order: each one's index into the row
    statistics (shape (.., m), flattened) and into the column statistics (shape (.., n), flattened)."""
    m, n = shape[-2], shape[-1]
    k = torch.arange(lo, hi, device=device)
    return k // n, (k // (m * n)) * n + k % n


def init_piece_state(shape: tuple[int, ...], lo: int, hi: int, param_dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """The state of a rank holding elements [lo, hi) of a parameter of `shape`: the first moment of
    its elements, the whole factored statistics (or the second moment of its elements, for < 2 dims)."""
    dt = came_state_dtype(param_dtype)
    state = {"step": torch.zeros((), dtype=torch.int64), "exp_avg": torch.zeros(hi - lo, dtype=dt, device=device)}
    if len(shape) >= 2:
        rows, cols = int(torch.Size(shape[:-1]).numel()), int(torch.Size(shape[:-2] + shape[-1:]).numel())
        for key, size in (("exp_avg_sq_row", rows), ("exp_avg_sq_col", cols),
                          ("exp_avg_res_row", rows), ("exp_avg_res_col", cols)):
            state[key] = torch.zeros(size, dtype=dt, device=device)
    else:
        state["exp_avg_sq"] = torch.zeros(hi - lo, dtype=dt, device=device)
    return state


def _means(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, n_rows: int, n_cols: int,
           m: int, n: int, stage_sum: StageSum) -> tuple[torch.Tensor, torch.Tensor]:
    """Row means (over n) and column means (over m) of a whole tensor from this rank's elements."""
    row_sum = torch.zeros(n_rows, dtype=values.dtype, device=values.device).index_add_(0, rows, values)
    col_sum = torch.zeros(n_cols, dtype=values.dtype, device=values.device).index_add_(0, cols, values)
    stage_sum([row_sum, col_sum])
    return row_sum / n, col_sum / m


def _inv_sqrt_at(row: torch.Tensor, col: torch.Tensor, shape: tuple[int, ...], rows: torch.Tensor,
                 cols: torch.Tensor) -> torch.Tensor:
    """came._inv_sqrt_factored at this rank's elements: 1 / sqrt(row col^T / mean(row))."""
    m = shape[-2]
    row_scale = (row.view(-1, m) / row.view(-1, m).mean(dim=-1, keepdim=True)).rsqrt().reshape(-1)
    return row_scale[rows] * col.rsqrt()[cols]


@torch.no_grad()
def came_piece_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                    shape: tuple[int, ...], lo: int, hi: int, h: CameHyper, stage_sum: StageSum) -> None:
    """One CAME step of elements [lo, hi) of a parameter of `shape` (`param`, `grad`: those elements,
    flat; `param` updated in place). Every rank of the stage calls it for the same parameter at the
    same time (the reductions are collective); a rank holding none of it passes lo == hi."""
    b1, b2, b3 = h.betas
    eps1, eps2 = h.eps
    state["step"] += 1
    dt = state["exp_avg"].dtype
    g = grad.to(dt)
    numel = int(torch.Size(shape).numel())
    factored = len(shape) >= 2
    sq = g * g + eps1
    if factored:
        m, n = shape[-2], shape[-1]
        rows, cols = piece_indices(shape, lo, hi, g.device)
        r, c = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        row_mean, col_mean = _means(sq, rows, cols, r.numel(), c.numel(), m, n, stage_sum)
        r.mul_(b2).add_(row_mean, alpha=1.0 - b2)
        c.mul_(b2).add_(col_mean, alpha=1.0 - b2)
        u = g * _inv_sqrt_at(r, c, shape, rows, cols)
    else:
        v = state["exp_avg_sq"]
        v.mul_(b2).add_(sq, alpha=1.0 - b2)
        u = g * v.rsqrt()
    sum_sq = (u * u).sum().reshape(1)
    stage_sum([sum_sq])
    rms = (sum_sq[0] / numel).sqrt()
    u.div_((rms / h.clip_threshold).clamp_(min=1.0))
    mom = state["exp_avg"]
    mom.mul_(b1).add_(u, alpha=1.0 - b1)
    if factored:
        res = (u - mom).square_().add_(eps2)
        rr, rc = state["exp_avg_res_row"], state["exp_avg_res_col"]
        res_row, res_col = _means(res, rows, cols, rr.numel(), rc.numel(), m, n, stage_sum)
        rr.mul_(b3).add_(res_row, alpha=1.0 - b3)
        rc.mul_(b3).add_(res_col, alpha=1.0 - b3)
        update = mom * _inv_sqrt_at(rr, rc, shape, rows, cols)
    else:
        update = mom
    if h.weight_decay != 0.0:
        param.mul_(1.0 - h.lr * h.weight_decay)
    param.add_(update.to(param.dtype), alpha=-h.lr)
