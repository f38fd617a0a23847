"""CAME against an independent re-statement of Algorithm 1 (Luo et al., ACL 2023)."""

from __future__ import annotations

import pytest
import torch

from oobleck_slurm.optim import CAME, optimizer_state_tensors

B1, B2, B3 = 0.9, 0.999, 0.9999
EPS1, EPS2 = 1e-30, 1e-16


def reference_step(theta, g, st, lr, wd, d):
    """One step of Algorithm 1, written with the paper's sums and outer products (float64).

    Matrices use the factored second moment and the factored confidence term; vectors keep a full
    second moment and step by m (the paper defines the confidence term for matrices only; the
    authors' release does the same).
    """
    if theta.dim() == 2:
        G2 = g * g + EPS1
        st["r"] = B2 * st["r"] + (1 - B2) * G2.sum(dim=1)  # (G^2 + eps1) 1_m
        st["c"] = B2 * st["c"] + (1 - B2) * G2.sum(dim=0)  # 1_n^T (G^2 + eps1)
        v = torch.outer(st["r"], st["c"]) / st["r"].sum()  # r c / (1_n^T r)
    else:
        st["v"] = B2 * st["v"] + (1 - B2) * (g * g + EPS1)
        v = st["v"]
    u = g / torch.sqrt(v)
    rms = torch.sqrt((u * u).sum() / u.numel())
    u = u / max(1.0, float(rms) / d)
    st["m"] = B1 * st["m"] + (1 - B1) * u
    if theta.dim() == 2:
        U = (u - st["m"]) ** 2 + EPS2
        st["R"] = B3 * st["R"] + (1 - B3) * U.sum(dim=1)
        st["C"] = B3 * st["C"] + (1 - B3) * U.sum(dim=0)
        S = torch.outer(st["R"], st["C"]) / st["R"].sum()
        step = st["m"] / torch.sqrt(S)
    else:
        step = st["m"]
    return theta - lr * wd * theta - lr * step


def fresh_reference_state(shape):
    z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    if len(shape) == 2:
        m, n = shape
        return {"r": z(m), "c": z(n), "m": z(m, n), "R": z(m), "C": z(n)}
    return {"v": z(*shape), "m": z(*shape)}


@pytest.mark.parametrize("clip", [1.0, 1e4])  # 1.0 clips every early step; 1e4 never clips
def test_came_matches_algorithm_1(clip: float) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 4), (3, 7), (5,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    ref_state = [fresh_reference_state(s) for s in shapes]
    lr, wd = 1e-2, 0.1
    opt = CAME(params, lr=lr, weight_decay=wd, clip_threshold=clip)
    for _ in range(6):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for k, g in enumerate(grads):
            ref[k] = reference_step(ref[k], g, ref_state[k], lr, wd, clip)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=0, atol=1e-6)
    # The stored statistics are the paper's sums divided by the summed-over length.
    st = optimizer_state_tensors(opt)
    m, n = shapes[0]
    torch.testing.assert_close(st["0.exp_avg_sq_row"] * n, ref_state[0]["r"], rtol=1e-9, atol=0)
    torch.testing.assert_close(st["0.exp_avg_sq_col"] * m, ref_state[0]["c"], rtol=1e-9, atol=0)
    torch.testing.assert_close(st["0.exp_avg_res_row"] * n, ref_state[0]["R"], rtol=1e-9, atol=0)
    torch.testing.assert_close(st["0.exp_avg_res_col"] * m, ref_state[0]["C"], rtol=1e-9, atol=0)
    torch.testing.assert_close(st["0.exp_avg"], ref_state[0]["m"], rtol=0, atol=1e-12)
    assert int(st["0.step"]) == 6


def test_came_state_is_factored() -> None:
    m, n = 96, 40
    p = torch.nn.Parameter(torch.randn(m, n))
    opt = CAME([p], lr=1e-3)
    p.grad = torch.randn(m, n)
    opt.step()
    st = optimizer_state_tensors(opt)
    full = [k for k, t in st.items() if t.numel() == m * n]
    assert full == ["0.exp_avg"], "only the first moment may be O(m*n)"
    others = sum(t.numel() for k, t in st.items() if k not in ("0.exp_avg", "0.step"))
    assert others == 2 * (m + n)  # second moment row/col + instability row/col


def test_came_bf16_params_keep_fp32_state_and_learn() -> None:
    torch.manual_seed(0)
    target = torch.randn(16, 8)
    w = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16))
    opt = CAME([w], lr=0.05)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = ((w.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert optimizer_state_tensors(opt)["0.exp_avg"].dtype == torch.float32
    assert losses[-1] < 0.1 * losses[0]


def test_came_rejects_bad_hyperparameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        CAME(p, lr=1e-3, betas=(0.9, 0.999))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr"):
        CAME(p, lr=0.0)
