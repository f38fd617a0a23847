"""Per-layer optimizers and the gradient arithmetic shared by the engine and the reference.

One optimizer per layer, keyed by the layer's stable key, so that recovery can copy one layer's
state without touching the others. Both optimizers are elementwise (AdamW) or per-parameter
(CAME), so per-layer instances step exactly like one instance over the whole model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from oobleck_slurm.engine.spec import OptimSpec
from oobleck_slurm.optim.build import build_optimizer


def make_layer_optimizer(layer: nn.Module, spec: OptimSpec) -> torch.optim.Optimizer:
    """The optimizer of one layer: weight decay on matrices (dim >= 2) only, as in GPT-2/nanoGPT."""
    params = list(layer.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return build_optimizer(spec.name, groups, lr=spec.lr, weight_decay=spec.weight_decay,
                           betas=spec.betas, eps=spec.eps)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def zero_grads(layers: list[nn.Module]) -> None:
    """Zero every gradient, allocating missing ones: every layer then takes part in every all-reduce
    and optimizer step, even on a pipeline with no microbatch this step."""
    for layer in layers:
        for p in layer.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of `p`: every parameter of a held layer has one from `zero_grads` on."""
    if p.grad is None:
        raise RuntimeError("a parameter has no gradient: zero_grads() must run before the step")
    return p.grad


def layer_sq_norm(layer: nn.Module) -> float:
    """Sum of squared gradient entries of one layer, in float64."""
    return sum(float(_grad(p).double().pow(2).sum()) for p in layer.parameters())


def clip_coefficient(total_sq_norm: float, max_norm: float) -> float:
    """The factor (<= 1) that scales gradients to global norm `max_norm`; 1 when off or below."""
    if max_norm <= 0:
        return 1.0
    norm = math.sqrt(total_sq_norm)
    return min(1.0, max_norm / (norm + 1e-6))


def scale_grads(layers: list[nn.Module], coef: float) -> None:
    if coef < 1.0:
        for layer in layers:
            for p in layer.parameters():
                _grad(p).mul_(coef)
