"""Optimizer state as named tensors: spec from parameters alone, bitwise round trip, errors."""

from __future__ import annotations

import pytest
import torch

from oobleck_slurm.optim import (
    OPTIMIZER_NAMES,
    build_optimizer,
    empty_state_tensors,
    load_optimizer_state_tensors,
    optimizer_state_bytes,
    optimizer_state_spec,
    optimizer_state_tensors,
    state_bytes_per_param,
)

SHAPES = [(12, 8), (8,), (3, 5, 4)]
# Where the step counters live differs by device and optimizer kind (torch keeps a fused AdamW's on the
# parameter's device): on a GPU machine the same tests check the CUDA placement recovery relies on.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_params(seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]


def make_opt(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # Two groups, as the engine would use (no weight decay on biases).
    groups = [{"params": [params[0], params[2]]}, {"params": [params[1]], "weight_decay": 0.0}]
    return build_optimizer(name, groups, lr=1e-2, weight_decay=0.1)


def feed(params, opt, gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_spec_matches_the_state_a_real_step_creates(name: str, device: str, default_dtype: torch.dtype) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)  # torch picks an unfused AdamW's step dtype from it
    try:
        check_spec_matches_a_real_step(name, device)
    finally:
        torch.set_default_dtype(previous)


def check_spec_matches_a_real_step(name: str, device: str) -> None:
    params = make_params(0, device)
    opt = make_opt(name, params)
    spec_before = optimizer_state_spec(opt)  # from the parameters alone
    feed(params, opt, torch.Generator().manual_seed(1))
    real = {}
    for i, p in enumerate(params[k] for k in (0, 2, 1)):  # param-group order
        for key, t in opt.state[p].items():
            real[f"{i}.{key}"] = (tuple(t.shape), t.dtype, t.device)
    assert spec_before == real
    assert list(optimizer_state_tensors(opt)) == list(spec_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_state_copied_midway_continues_bitwise_equal(name: str, device: str) -> None:
    params_a = make_params(0, device)
    opt_a = make_opt(name, params_a)
    gen_a = torch.Generator().manual_seed(7)
    for _ in range(3):
        feed(params_a, opt_a, gen_a)

    # A fresh receiver: allocate from its own parameters, "receive" tensor by tensor, load.
    params_b = make_params(99, device)
    opt_b = make_opt(name, params_b)
    buffers = empty_state_tensors(opt_b)
    for key, t in optimizer_state_tensors(opt_a).items():
        buffers[key].copy_(t)
    load_optimizer_state_tensors(opt_b, buffers)
    with torch.no_grad():
        for pa, pb in zip(params_a, params_b):
            pb.copy_(pa)

    # A receiver that already has (different) state is overwritten in place.
    params_c = make_params(5, device)
    opt_c = make_opt(name, params_c)
    feed(params_c, opt_c, torch.Generator().manual_seed(3))
    before = {k: t.data_ptr() for k, t in optimizer_state_tensors(opt_c).items()}
    load_optimizer_state_tensors(opt_c, optimizer_state_tensors(opt_a))
    assert {k: t.data_ptr() for k, t in optimizer_state_tensors(opt_c).items()} == before
    with torch.no_grad():
        for pa, pc in zip(params_a, params_c):
            pc.copy_(pa)

    gen_b, gen_c = (torch.Generator().manual_seed(11) for _ in range(2))
    gen_a = torch.Generator().manual_seed(11)
    for _ in range(3):
        feed(params_a, opt_a, gen_a)
        feed(params_b, opt_b, gen_b)
        feed(params_c, opt_c, gen_c)
    for other_params, other_opt in ((params_b, opt_b), (params_c, opt_c)):
        for pa, po in zip(params_a, other_params):
            assert torch.equal(pa, po)
        sa, so = optimizer_state_tensors(opt_a), optimizer_state_tensors(other_opt)
        assert all(torch.equal(sa[k], so[k]) for k in sa)
    assert float(optimizer_state_tensors(opt_b)["0.step"]) == 6


def test_fresh_optimizer_reads_as_zero_state() -> None:
    params = make_params(0)
    opt = make_opt("came", params)
    st = optimizer_state_tensors(opt)
    assert list(st) == list(optimizer_state_spec(opt))
    assert all(not t.any() for t in st.values())


def test_load_rejects_mismatched_state() -> None:
    opt = make_opt("adamw", make_params(0))
    good = empty_state_tensors(opt)
    missing = dict(good)
    del missing["1.exp_avg"]
    with pytest.raises(ValueError, match=r"missing \['1.exp_avg'\]"):
        load_optimizer_state_tensors(opt, missing)
    wrong = dict(good)
    wrong["0.exp_avg"] = torch.zeros(8, 12)
    with pytest.raises(ValueError, match=r"0.exp_avg: got torch.float32\(8, 12\), expected"):
        load_optimizer_state_tensors(opt, wrong)
    came_state = empty_state_tensors(make_opt("came", make_params(0)))
    with pytest.raises(ValueError, match="unexpected"):
        load_optimizer_state_tensors(opt, came_state)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_state_bytes_equal_the_real_state(name: str) -> None:
    params = make_params(0)
    opt = make_opt(name, params)
    feed(params, opt, torch.Generator().manual_seed(1))
    real = sum(t.numel() * t.element_size() for t in optimizer_state_tensors(opt).values())
    assert optimizer_state_bytes(name, SHAPES) == real


def test_came_halves_adamw_state_on_a_large_matrix() -> None:
    shapes = [(1024, 4096)]
    assert state_bytes_per_param("adamw", shapes) == pytest.approx(8.0, abs=1e-5)
    assert state_bytes_per_param("came", shapes) == pytest.approx(4.0, abs=0.01)
    assert state_bytes_per_param("came", shapes, torch.bfloat16) == pytest.approx(4.0, abs=0.01)
    assert state_bytes_per_param("adamw", shapes, torch.bfloat16) == pytest.approx(4.0, abs=1e-5)


def test_build_optimizer_options_and_errors() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    adamw = build_optimizer("adamw", p, lr=1e-3, weight_decay=0.0)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True  # on the CPU
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer("sgd", p, lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="came: betas must be 3 values"):
        build_optimizer("came", p, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
