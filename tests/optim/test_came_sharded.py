"""CAME on flat slices (optim/came_sharded.py) equals CAME on the whole tensor: 4 real processes on a gloo
group each step their slice of matrices, a 3-D tensor and a vector (uneven slices, one empty), their
row/column statistics and the update clip's RMS reduced across the group; after 3 steps every element
and the statistics equal `CAME.step` on the whole tensors (fp64, 1e-12 relative). The same processes run
`ShardedCAME` (prepare, then step) on slices of a layer's parameters with AdamW's weight-decay groups and
a clipped gradient, against `CAME` over the whole layer."""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oobleck_slurm.optim.came import CAME
from oobleck_slurm.optim.came_sharded import (
    FACTORED_KEYS,
    CameHyper,
    CamePiece,
    ShardedCAME,
    _Rows,
    came_piece_stats,
    came_piece_step,
    init_piece_state,
)

WORLD = 4
SHAPES = [(6, 5), (2, 3, 4), (7,), (3, 4, 5)]
STEPS = 3
HYPER = CameHyper(lr=1e-2, weight_decay=0.1, clip_threshold=1.0)
COEF = [1.0, 0.3, 1.0]  # the clip coefficient of each step (ShardedCAME): one step clipped
GROUP_TIMEOUT = dt.timedelta(seconds=120)  # 4 processes on a shared machine


def bounds(numel: int, rank: int) -> tuple[int, int]:
    """Uneven slices: rank 3 holds nothing of a tensor of fewer than 8 elements."""
    cuts = [0, numel // 5, numel // 2, max(numel // 2, numel - 3) if numel >= 8 else numel, numel]
    return cuts[rank], cuts[rank + 1]


def tensors() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def rank_main(rank: int, store_path: str, out: str) -> None:
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=GROUP_TIMEOUT)

    def stage_sum(t: torch.Tensor) -> None:
        dist.all_reduce(t)

    params, grads = tensors()
    # came_piece_step on each parameter's slice
    mine = []
    for p in params:
        lo, hi = bounds(p.numel(), rank)
        mine.append((p.reshape(-1)[lo:hi].clone(), init_piece_state(tuple(p.shape), lo, hi, p.dtype, p.device), lo, hi))
    for step in range(STEPS):
        for (piece, state, lo, hi), p, g in zip(mine, params, grads[step]):
            came_piece_step(piece, g.reshape(-1)[lo:hi], state, tuple(p.shape), lo, hi, HYPER, stage_sum)
    # ShardedCAME over the same slices, as one layer's optimizer
    pieces = []
    for p in params:
        lo, hi = bounds(p.numel(), rank)
        view = torch.nn.Parameter(p.reshape(-1)[lo:hi].clone())
        pieces.append(CamePiece(view, tuple(p.shape), lo, hi))
    groups = [{"pieces": [pc for pc in pieces if len(pc.shape) >= 2], "weight_decay": HYPER.weight_decay},
              {"pieces": [pc for pc in pieces if len(pc.shape) < 2], "weight_decay": 0.0}]
    opt = ShardedCAME(groups, lr=HYPER.lr, weight_decay=HYPER.weight_decay)
    for step in range(STEPS):
        for pc, g in zip(pieces, grads[step]):
            pc.param.grad = g.reshape(-1)[pc.lo : pc.hi].clone()
        opt.prepare(COEF[step], stage_sum)
        if COEF[step] < 1.0:
            for pc in pieces:
                pc.param.grad.mul_(COEF[step])  # type: ignore[union-attr]  # as Worker.complete_step clips
        opt.step()
    layer = [(pc.param.detach(), opt.state[pc.param], pc.lo, pc.hi) for pc in pieces]
    torch.save({"pieces": mine, "layer": layer}, f"{out}.{rank}")
    dist.destroy_process_group()


def reference(coefs: list[float] | None) -> tuple[list[torch.Tensor], CAME]:
    """CAME on the whole tensors; with `coefs`, as one layer (decay on matrices) with clipped gradients."""
    params, grads = tensors()
    whole = [p.clone() for p in params]
    if coefs is None:
        opt = CAME(whole, lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps, clip_threshold=HYPER.clip_threshold,
                   weight_decay=HYPER.weight_decay)
    else:
        opt = CAME([{"params": [p for p in whole if p.dim() >= 2], "weight_decay": HYPER.weight_decay},
                    {"params": [p for p in whole if p.dim() < 2], "weight_decay": 0.0}],
                   lr=HYPER.lr, weight_decay=HYPER.weight_decay)
    for step in range(STEPS):
        for p, g in zip(whole, grads[step]):
            p.grad = g.clone() * (coefs[step] if coefs is not None else 1.0)
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(whole, params))  # the steps moved every tensor
    return whole, opt


def assert_slices_match(whole: list[torch.Tensor], opt: CAME, results: list[list]) -> None:
    for i, p in enumerate(whole):
        ref_state = opt.state[p]
        flat = torch.cat([results[r][i][0] for r in range(WORLD)])
        assert torch.allclose(flat, p.reshape(-1), rtol=1e-12, atol=0), i
        moment = torch.cat([results[r][i][1]["exp_avg"] for r in range(WORLD)])
        assert torch.allclose(moment, ref_state["exp_avg"].reshape(-1), rtol=1e-12, atol=1e-300), i
        if "exp_avg_sq" in ref_state:
            v = torch.cat([results[r][i][1]["exp_avg_sq"] for r in range(WORLD)])
            assert torch.allclose(v, ref_state["exp_avg_sq"].reshape(-1), rtol=1e-12, atol=0), i
        for r in range(WORLD):
            state = results[r][i][1]
            assert int(state["step"]) == STEPS
            for key in FACTORED_KEYS:
                if key in ref_state:  # factored statistics: whole on every rank
                    assert torch.allclose(state[key], ref_state[key].reshape(-1), rtol=1e-12, atol=0), (i, r, key)


def test_came_on_shards_equals_came_on_the_whole_tensor(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    mp.start_processes(rank_main, args=(str(tmp_path / "store"), out), nprocs=WORLD, start_method="fork")  # forked: no import per rank
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert any(hi == lo for res in results for _, _, lo, hi in res["pieces"])  # a rank held nothing of some tensor
    whole, opt = reference(None)
    assert_slices_match(whole, opt, [res["pieces"] for res in results])
    whole, opt = reference(COEF)  # ShardedCAME: groups, weight decay on matrices only, a clipped step
    assert_slices_match(whole, opt, [res["layer"] for res in results])


def test_partial_row_and_column_sums_of_any_slice() -> None:
    # every slice [lo, hi) of a (3, 4, 5) tensor (partial first and last rows and matrices, whole ones
    # between, empty slices): the sums over the slice's padded rows equal sums by index
    shape = (3, 4, 5)
    values = torch.arange(1, 61, dtype=torch.float64)
    rows_of = torch.arange(60) // 5
    cols_of = (torch.arange(60) // 20) * 5 + torch.arange(60) % 5
    for lo, hi in itertools.combinations_with_replacement(range(61), 2):
        rows = _Rows(shape, lo, hi)
        got = rows.sums(rows.block(values[lo:hi]))
        want = torch.zeros(12 + 15, dtype=torch.float64)
        want[:12].index_add_(0, rows_of[lo:hi], values[lo:hi])
        want[12:].index_add_(0, cols_of[lo:hi], values[lo:hi])
        assert torch.equal(got, want), (lo, hi)
        assert torch.equal(rows.cut(rows.block(values[lo:hi])), values[lo:hi])


def test_stats_half_changes_no_state() -> None:
    # the reductions run before the engine's commit point: the state must be untouched until apply
    gen = torch.Generator().manual_seed(1)
    for shape in ((6, 5), (7,)):
        state = init_piece_state(shape, 3, 17 if len(shape) > 1 else 5, torch.float64, torch.device("cpu"))
        for t in state.values():
            if t.is_floating_point():
                t.uniform_(0.5, 1.0, generator=gen)
        before = {k: t.clone() for k, t in state.items()}
        grad = torch.randn(state["exp_avg"].numel(), generator=gen, dtype=torch.float64)
        stats = came_piece_stats(grad, state, shape, 3, 3 + grad.numel(), HYPER, lambda t: None)
        assert (stats.sq is not None) == (len(shape) > 1) and float(stats.rms) > 0
        assert all(torch.equal(state[k], before[k]) for k in state)
