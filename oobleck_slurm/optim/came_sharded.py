"""CAME (came.py) on flat slices of parameters: the optimizer of one rank of a wide stage (engine/shard.py).

A rank of a wide stage holds elements [lo, hi) of each parameter (row-major flat order). CAME's
factored statistics are means over whole rows and columns, and its update clip is the RMS over the
whole tensor, so each is computed from per-slice partial sums reduced across the stage (`stage_sum`:
a SUM in place over the stage's ranks; the engine posts it on the stage group and waits on it
abortably). The row and column vectors (m + n entries per matrix) are kept whole on every rank of the
stage, where they are equal (every rank derives them from the same reduced sums); the first moment,
and the second moment of a parameter of fewer than two dimensions, are sliced like the parameter.
Reductions per step: three for a matrix (the squared gradient's row/column sums, the sum of u^2, the
residual's row/column sums), one for a vector (the sum of u^2). Only the order of the sums changes
against `CAME.step` on the whole tensor.

Partial row/column sums are sums over the dimensions of the slice laid out as the rows it touches
(zero-padded), not scatters: deterministic on a GPU too, so replicas of a layer at one width stay
bitwise equal.

A step comes in two halves (`came_piece_step` runs both): `came_piece_stats` does every reduction and
changes nothing; `came_piece_apply` needs no peer. `ShardedCAME`, the optimizer of a rank's slices of
one layer, runs the first in `prepare`, which the engine calls before its step's commit point, and the
second in `step`, which recovery may call after a peer's death (engine/recovery.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from oobleck_slurm.optim.came import came_state_dtype, check_came_hyper

StageSum = Callable[[torch.Tensor], None]  # sums a tensor in place over the stage's ranks
FACTORED_KEYS = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col")  # whole, replicated


@dataclass(frozen=True)
class CameHyper:
    lr: float
    betas: tuple[float, float, float] = (0.9, 0.999, 0.9999)
    eps: tuple[float, float] = (1e-30, 1e-16)
    clip_threshold: float = 1.0
    weight_decay: float = 0.0


def factored_sizes(shape: Sequence[int]) -> tuple[int, int]:
    """Entries of the row statistics (shape (.., m)) and of the column statistics (shape (.., n)) of a
    (.., m, n) tensor."""
    return math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]


class _Rows:
    """Elements [lo, hi) of a (.., m, n) tensor (row-major) as the rows [a, b) of its (rows, n) view that
    they touch, zero-padded to whole rows: a row of that view is row a + i of the row statistics, and its
    matrix (a + i) // m picks the column statistics' block of n."""

    def __init__(self, shape: Sequence[int], lo: int, hi: int) -> None:
        self.m, self.n = shape[-2], shape[-1]
        self.rows, self.cols = factored_sizes(shape)
        self.a = lo // self.n
        self.b = -(-hi // self.n) if hi > lo else self.a
        self.start, self.count = lo - self.a * self.n, hi - lo

    def block(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat.new_zeros((self.b - self.a) * self.n)
        out[self.start : self.start + self.count] = flat
        return out.view(-1, self.n)

    def cut(self, block: torch.Tensor) -> torch.Tensor:
        return block.reshape(-1)[self.start : self.start + self.count]

    def sums(self, block: torch.Tensor) -> torch.Tensor:
        """This slice's share of the whole tensor's row sums and column sums as one vector [rows | cols]
        (zeros where it holds nothing): what the stage all-reduces."""
        out = block.new_zeros(self.rows + self.cols)
        if self.a == self.b:
            return out
        out[self.a : self.b] = block.sum(dim=-1)
        cols = out[self.rows :].view(-1, self.n)  # one row of n per matrix
        m, first, last = self.m, self.a // self.m, (self.b - 1) // self.m
        if first == last:
            cols[first] = block.sum(dim=0)
            return out
        head, tail = (first + 1) * m - self.a, self.b - last * m  # rows in the first and last matrix
        cols[first] = block[:head].sum(dim=0)
        if last > first + 1:  # whole matrices in between
            cols[first + 1 : last] = block[head : len(block) - tail].view(-1, m, self.n).sum(dim=1)
        cols[last] = block[len(block) - tail :].sum(dim=0)
        return out

    def inv_sqrt(self, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """came._inv_sqrt_factored at the block: 1 / sqrt(row col^T / mean(row)), shape (b - a, n)."""
        matrix = torch.arange(self.a, self.b, device=row.device) // self.m
        mean = row.view(-1, self.m).mean(dim=-1)
        row_scale = (row[self.a : self.b] / mean[matrix]).rsqrt()
        return row_scale.unsqueeze(-1) * col.view(-1, self.n).rsqrt()[matrix]


def init_piece_state(shape: Sequence[int], lo: int, hi: int, param_dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """The state of a rank holding elements [lo, hi) of a parameter of `shape`: the step, the first
    moment of its elements, and the whole factored statistics (or, for < 2 dims, the second moment of
    its elements)."""
    dt = came_state_dtype(param_dtype)
    state = {"step": torch.zeros((), dtype=torch.int64), "exp_avg": torch.zeros(hi - lo, dtype=dt, device=device)}
    if len(shape) >= 2:
        rows, cols = factored_sizes(shape)
        for key, size in zip(FACTORED_KEYS, (rows, cols, rows, cols)):
            state[key] = torch.zeros(size, dtype=dt, device=device)
    else:
        state["exp_avg_sq"] = torch.zeros(hi - lo, dtype=dt, device=device)
    return state


@dataclass(frozen=True)
class PieceStats:
    """What one step of a slice needs from the rest of the stage: the RMS of the whole update before
    clipping, and for a matrix its new row/column statistics (whole)."""

    rms: torch.Tensor
    sq: tuple[torch.Tensor, torch.Tensor] | None = None  # new exp_avg_sq_row, exp_avg_sq_col
    res: tuple[torch.Tensor, torch.Tensor] | None = None  # new exp_avg_res_row, exp_avg_res_col


def _ema(avg: torch.Tensor, value: torch.Tensor, beta: float) -> torch.Tensor:
    """beta avg + (1 - beta) value, a new tensor, with the operations `CAME.step` runs in place."""
    return avg.clone().mul_(beta).add_(value, alpha=1.0 - beta)


def _clip(u: torch.Tensor, rms: torch.Tensor, h: CameHyper) -> torch.Tensor:
    return u.div_((rms / h.clip_threshold).clamp(min=1.0))


@torch.no_grad()
def came_piece_stats(grad: torch.Tensor, state: dict[str, torch.Tensor], shape: Sequence[int], lo: int,
                     hi: int, h: CameHyper, stage_sum: StageSum) -> PieceStats:
    """The reductions of one CAME step of elements [lo, hi) of a parameter of `shape` (`grad`: those
    elements' gradient, flat); `state` is left as it is. Every rank of the stage calls it for the same
    parameter at the same time (the reductions are collective); a rank holding none of it passes lo == hi."""
    _, b2, b3 = h.betas
    eps1, eps2 = h.eps
    g = grad.to(state["exp_avg"].dtype)
    rows = _Rows(shape, lo, hi) if len(shape) >= 2 else None
    if rows is not None:
        sq_sums = rows.sums(rows.block(g * g + eps1))
        stage_sum(sq_sums)
        sq = (_ema(state["exp_avg_sq_row"], sq_sums[: rows.rows] / rows.n, b2),
              _ema(state["exp_avg_sq_col"], sq_sums[rows.rows :] / rows.m, b2))
        u = g * rows.cut(rows.inv_sqrt(*sq))
    else:
        u = g * _ema(state["exp_avg_sq"], g * g + eps1, b2).rsqrt()
    sum_sq = (u * u).sum().reshape(1)
    stage_sum(sum_sq)
    rms = (sum_sq[0] / math.prod(shape)).sqrt()
    if rows is None:
        return PieceStats(rms)
    m = _ema(state["exp_avg"], _clip(u, rms, h), h.betas[0])
    res_sums = rows.sums(rows.block((u - m).square_().add_(eps2)))
    stage_sum(res_sums)
    res = (_ema(state["exp_avg_res_row"], res_sums[: rows.rows] / rows.n, b3),
           _ema(state["exp_avg_res_col"], res_sums[rows.rows :] / rows.m, b3))
    return PieceStats(rms, sq, res)


@torch.no_grad()
def came_piece_apply(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                     shape: Sequence[int], lo: int, hi: int, h: CameHyper, stats: PieceStats) -> None:
    """The rest of the step `stats` (came_piece_stats, on the same gradient and state) began: update
    `state` and `param` (elements [lo, hi), flat) in place. Local: needs no other rank."""
    b1, b2, _ = h.betas
    eps1, _ = h.eps
    state["step"] += 1
    g = grad.to(state["exp_avg"].dtype)
    rows = _Rows(shape, lo, hi) if len(shape) >= 2 else None
    if rows is not None:
        if stats.sq is None or stats.res is None:
            raise ValueError(f"CAME: the statistics of a {tuple(shape)} parameter lack its row/column sums")
        state["exp_avg_sq_row"].copy_(stats.sq[0])
        state["exp_avg_sq_col"].copy_(stats.sq[1])
        u = g * rows.cut(rows.inv_sqrt(state["exp_avg_sq_row"], state["exp_avg_sq_col"]))
    else:
        v = state["exp_avg_sq"]
        v.mul_(b2).add_(g * g + eps1, alpha=1.0 - b2)
        u = g * v.rsqrt()
    m = state["exp_avg"]
    m.mul_(b1).add_(_clip(u, stats.rms, h), alpha=1.0 - b1)
    update = m
    if rows is not None:
        state["exp_avg_res_row"].copy_(stats.res[0])  # type: ignore[index]  # checked above
        state["exp_avg_res_col"].copy_(stats.res[1])  # type: ignore[index]
        update = m * rows.cut(rows.inv_sqrt(state["exp_avg_res_row"], state["exp_avg_res_col"]))
    if h.weight_decay != 0.0:
        param.mul_(1.0 - h.lr * h.weight_decay)
    param.add_(update.to(param.dtype), alpha=-h.lr)


def came_piece_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                    shape: Sequence[int], lo: int, hi: int, h: CameHyper, stage_sum: StageSum) -> None:
    """One CAME step of elements [lo, hi) of a parameter of `shape` (`param`, `grad`: those elements,
    flat; `param` updated in place): both halves at once (collective: see `came_piece_stats`)."""
    stats = came_piece_stats(grad, state, shape, lo, hi, h, stage_sum)
    came_piece_apply(param, grad, state, shape, lo, hi, h, stats)


@dataclass(frozen=True, eq=False)
class CamePiece:
    """Elements [lo, hi) of a parameter of `shape` (lo == hi: none of it): `param` is a flat view of
    them, its `.grad` their gradient."""

    param: torch.Tensor
    shape: tuple[int, ...]
    lo: int
    hi: int


class ShardedCAME(torch.optim.Optimizer):
    """CAME over one rank's slices of a layer's parameters on a wide stage. `groups` are torch's param
    groups with `pieces` (CamePiece) for `params`; every rank of the stage passes the pieces of the same
    parameters in the same order, empty ones included, since the reductions follow that order.

    A step is `prepare(coef, stage_sum)` (the stage's reductions, before the engine's commit point;
    changes nothing), then `step()` (local). The state of a piece is `init_piece_state`'s, in
    `state[piece.param]`."""

    def __init__(self, groups: Sequence[dict[str, Any]], lr: float,
                 betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 eps: tuple[float, float] = (1e-30, 1e-16), clip_threshold: float = 1.0,
                 weight_decay: float = 0.0) -> None:
        check_came_hyper(lr, betas, eps, clip_threshold, weight_decay)
        self.pieces = [piece for group in groups for piece in group["pieces"]]
        torch_groups = [{**{k: v for k, v in group.items() if k != "pieces"},
                         "params": [piece.param for piece in group["pieces"]]} for group in groups]
        defaults = dict(lr=lr, betas=tuple(betas), eps=tuple(eps), clip_threshold=clip_threshold,
                        weight_decay=weight_decay)
        super().__init__(torch_groups, defaults)
        self._piece = {id(piece.param): piece for piece in self.pieces}
        for piece in self.pieces:
            self.state[piece.param] = init_piece_state(piece.shape, piece.lo, piece.hi, piece.param.dtype,
                                                       piece.param.device)
        self._prepared: dict[int, PieceStats] | None = None

    def _each(self) -> list[tuple[CamePiece, CameHyper]]:
        """Every piece with its group's hyper-parameters, in param group order."""
        return [(self._piece[id(p)], CameHyper(lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                               clip_threshold=g["clip_threshold"], weight_decay=g["weight_decay"]))
                for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def prepare(self, coef: float, stage_sum: StageSum) -> None:
        """The stage's reductions of the next `step`, for the gradients as they will be then: scaled by
        `coef` when it is below 1 (the caller clips them in place before `step`, the same product)."""
        prepared = {}
        for piece, h in self._each():
            grad = _grad(piece)
            prepared[id(piece.param)] = came_piece_stats(grad * coef if coef < 1.0 else grad,
                                                         self.state[piece.param], piece.shape, piece.lo,
                                                         piece.hi, h, stage_sum)
        self._prepared = prepared

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply the prepared step (each `prepare` is applied once); no closure."""
        if closure is not None:
            raise ValueError("ShardedCAME.step takes no closure: its reductions run in prepare()")
        if self._prepared is None:
            raise RuntimeError("ShardedCAME.step: no prepared step (prepare() runs the stage's reductions "
                               "of each step before it)")
        prepared, self._prepared = self._prepared, None
        for piece, h in self._each():
            came_piece_apply(piece.param, _grad(piece), self.state[piece.param], piece.shape, piece.lo, piece.hi,
                             h, prepared[id(piece.param)])
        return None


def _grad(piece: CamePiece) -> torch.Tensor:
    if piece.param.grad is None:
        raise RuntimeError(f"ShardedCAME: the piece [{piece.lo}, {piece.hi}) of a {piece.shape} parameter has no gradient")
    return piece.param.grad
