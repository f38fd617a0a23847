"""CAME on flat shards (optim/came_sharded.py) equals CAME on the whole tensor: 4 real processes on a
gloo group each step their slice of matrices, a 3-D tensor and a vector (uneven slices, one empty),
their row/column statistics and the update clip's RMS reduced across the group; after 3 steps every
element and the statistics equal `CAME.step` on the whole tensors (fp64, 1e-12 relative)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oobleck_slurm.optim.came import CAME
from oobleck_slurm.optim.came_sharded import CameHyper, came_piece_step, init_piece_state

WORLD = 4
SHAPES = [(6, 5), (2, 3, 4), (7,)]
STEPS = 3
HYPER = CameHyper(lr=1e-2, weight_decay=0.1, clip_threshold=1.0)
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

    def stage_sum(ts: list[torch.Tensor]) -> None:
        for t in ts:
            dist.all_reduce(t)

    params, grads = tensors()
    mine = []
    for p in params:
        lo, hi = bounds(p.numel(), rank)
        mine.append((p.reshape(-1)[lo:hi].clone(), init_piece_state(tuple(p.shape), lo, hi, p.dtype, p.device), lo, hi))
    for step in range(STEPS):
        for (piece, state, lo, hi), p, g in zip(mine, params, grads[step]):
            came_piece_step(piece, g.reshape(-1)[lo:hi], state, tuple(p.shape), lo, hi, HYPER, stage_sum)
    torch.save([(piece, state, lo, hi) for piece, state, lo, hi in mine], f"{out}.{rank}")
    dist.destroy_process_group()


def test_came_on_shards_equals_came_on_the_whole_tensor(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    mp.start_processes(rank_main, args=(str(tmp_path / "store"), out), nprocs=WORLD, start_method="spawn")
    params, grads = tensors()
    whole = [p.clone() for p in params]
    opt = CAME(whole, lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps, clip_threshold=HYPER.clip_threshold,
               weight_decay=HYPER.weight_decay)
    for step in range(STEPS):
        for p, g in zip(whole, grads[step]):
            p.grad = g.clone()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(whole, params))  # the steps moved every tensor
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert any(hi == lo for res in results for _, _, lo, hi in res)  # a rank held nothing of some tensor
    for i, p in enumerate(whole):
        ref_state = opt.state[p]
        flat = torch.cat([results[r][i][0] for r in range(WORLD)])
        assert torch.allclose(flat, p.reshape(-1), rtol=1e-12, atol=0)
        moment = torch.cat([results[r][i][1]["exp_avg"] for r in range(WORLD)])
        assert torch.allclose(moment, ref_state["exp_avg"].reshape(-1), rtol=1e-12, atol=1e-300)
        for r in range(WORLD):
            state = results[r][i][1]
            assert int(state["step"]) == STEPS
            for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"):
                if key in ref_state:  # factored statistics: whole on every rank
                    assert torch.allclose(state[key], ref_state[key].reshape(-1), rtol=1e-12, atol=0), (i, r, key)
