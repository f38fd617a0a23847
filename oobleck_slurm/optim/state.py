"""An optimizer's state as flat, named tensors: what recovery sends between processes.

The engine keeps one optimizer per layer, so a layer's state is addressed by the layer key plus the
names here: "<i>.<key>", i the parameter's position in the optimizer (over its param groups, in
order), key the state entry ("0.exp_avg", "0.step", ...). The sender sends
`optimizer_state_tensors(opt)` tensor by tensor in `optimizer_state_spec` order; the receiver
allocates `empty_state_tensors(opt)` from its own parameters, receives into them, and calls
`load_optimizer_state_tensors`. Nothing is pickled.

A parameter that has not stepped yet has no state in torch; here it reads as zeros with step 0,
which both optimizers treat exactly like a fresh state, so the name set never depends on history.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from oobleck_slurm.optim.build import optimizer_name, state_layout
from oobleck_slurm.optim.layout import TensorLayout


def _params(opt: torch.optim.Optimizer) -> Iterator[tuple[int, torch.Tensor, dict]]:
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            yield i, p, group
            i += 1


def _param_layout(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> dict[str, TensorLayout]:
    return state_layout(optimizer_name(opt), tuple(p.shape), p.dtype, bool(group.get("amsgrad")),
                        bool(group.get("fused")))


def _device(spec: TensorLayout, p: torch.Tensor) -> torch.device:
    return torch.device("cpu") if spec.on_cpu else p.device


StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]]


def optimizer_state_spec(opt: torch.optim.Optimizer) -> StateSpec:
    """name -> (shape, dtype, device) of every state tensor, from the parameters alone, in order."""
    return {
        f"{i}.{key}": (spec.shape, spec.dtype, _device(spec, p))
        for i, p, group in _params(opt)
        for key, spec in _param_layout(opt, p, group).items()
    }


def empty_state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Uninitialised tensors matching `optimizer_state_spec`: buffers to receive state into."""
    return {
        name: torch.empty(shape, dtype=dtype, device=device)
        for name, (shape, dtype, device) in optimizer_state_spec(opt).items()
    }


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """name -> state tensor, in spec order. Live tensors (no copy) where state exists: send or
    clone them before the next step, do not modify them."""
    out: dict[str, torch.Tensor] = {}
    for i, p, group in _params(opt):
        state = opt.state.get(p, {})
        for key, spec in _param_layout(opt, p, group).items():
            t = state.get(key) if state else None
            if t is None:
                t = torch.zeros(spec.shape, dtype=spec.dtype, device=_device(spec, p))
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise RuntimeError(
                    f"optimizer state {i}.{key} is {type(t).__name__} "
                    f"{getattr(t, 'dtype', '')}{tuple(getattr(t, 'shape', ()))}, expected "
                    f"{spec.dtype}{spec.shape}: was the optimizer built by build_optimizer?"
                )
            out[f"{i}.{key}"] = t
    return out


def load_optimizer_state_tensors(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Restore state from `tensors` (names as in `optimizer_state_spec`), in place.

    Existing state tensors are overwritten with copy_ (their storage is kept); missing ones are
    created where the optimizer keeps them (the parameter's device, or the CPU for unfused step counters). Every name must be present,
    with the right shape and dtype, and no other: a partial load would silently mix two states.
    """
    spec = optimizer_state_spec(opt)
    missing = [n for n in spec if n not in tensors]
    extra = [n for n in tensors if n not in spec]
    if missing or extra:
        raise ValueError(
            f"optimizer state does not match this optimizer: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    for name, (shape, dtype, _) in spec.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"optimizer state {name}: got {t.dtype}{tuple(t.shape)}, expected {dtype}{shape}"
            )
    for i, p, group in _params(opt):
        state = opt.state[p]
        for key, lay in _param_layout(opt, p, group).items():
            src = tensors[f"{i}.{key}"]
            dst = state.get(key)
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
            else:
                state[key] = src.detach().to(device=_device(lay, p), copy=True)
