"""Copying layers (parameters and optimizer state) between ranks when the plan changes.

Tensors only, no pickles: both sides derive every tensor's name, shape and dtype from the layer's
parameters and the optimizer's state spec, so the receiver allocates its buffers and posts its
receives without a header. All sends and receives of one call are posted at once (each with its
own tag) as one batch (`Generation.exchange`) and then waited for, so copies from several holders
proceed in parallel, and on NCCL no order between a rank's sends and receives can deadlock them.
"""

from __future__ import annotations

import torch
from torch import nn

from oobleck_slurm.engine.comm import Generation
from oobleck_slurm.engine.nccl_order import P2POp
from oobleck_slurm.optim import empty_state_tensors, load_optimizer_state_tensors, optimizer_state_tensors

TAG_STRIDE = 10_000  # tensors per transfer, at most


def layer_tensors(layer: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything that defines a trained layer, in a fixed order: parameters, buffers (a receiver builds
    its copy uninitialised), then optimizer state."""
    return ([p.data for p in layer.parameters()] + list(layer.buffers())
            + list(optimizer_state_tensors(opt).values()))


def run_transfers(gen: Generation, transfers: list[tuple[int, int, int]],
                  layers: dict[int, nn.Module], optimizers: dict[int, torch.optim.Optimizer]) -> int:
    """Do this rank's part of `transfers` [(layer, src, dst)] on generation `gen`'s world group.

    A sender needs `layers[l]`/`optimizers[l]`; a receiver must have built a fresh layer and its
    optimizer under the same index beforehand: they are overwritten. Returns bytes received.
    """
    device_for_p2p = None if gen.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    ops: list[P2POp] = []  # posted as one batch; they keep their buffers alive
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, GPU receive buffer)
    state_loads: list[tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]] = []  # after the copies
    received = 0
    for index, (layer, src, dst) in enumerate(transfers):
        if gen.rank not in (src, dst):
            continue
        base = index * TAG_STRIDE
        if gen.rank == src:
            for k, t in enumerate(layer_tensors(layers[layer], optimizers[layer])):
                t = t.contiguous()
                if device_for_p2p is not None and t.device.type == "cpu":  # nccl: step counters
                    t = t.to(device_for_p2p)
                ops.append(P2POp("send", t, dst, base + k))
        else:
            layer_mod, opt = layers[layer], optimizers[layer]
            params = list(layer_mod.parameters())
            state = empty_state_tensors(opt)
            targets = [p.data for p in params] + list(layer_mod.buffers()) + list(state.values())
            for k, t in enumerate(targets):
                buf = t if device_for_p2p is None or t.device.type != "cpu" else t.to(device_for_p2p)
                ops.append(P2POp("recv", buf, src, base + k))
                if buf is not t:
                    copies.append((t, buf))
                received += t.numel() * t.element_size()
            state_loads.append((opt, state))
    for work in gen.exchange(ops) if ops else []:
        gen.wait(work)
    for dst_t, buf in copies:
        dst_t.copy_(buf)
    for opt, state in state_loads:
        load_optimizer_state_tensors(opt, state)
    return received
