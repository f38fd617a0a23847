"""Copying layers (parameters and optimizer state) between ranks when the plan changes.

Tensors only, no pickles: both sides derive every tensor's name, shape and dtype from the layer's
parameters and the optimizer's state spec, so the receiver allocates its buffers and posts its
receives without a header. All sends and receives of one call are posted at once (each with its
own tag) as one batch (`Generation.exchange`) and then waited for, so copies from several holders
proceed in parallel, and on NCCL no order between a rank's sends and receives can deadlock them.

Every copy is verified: the sender sends its holding's checksum (engine/integrity.py) after the
layer's tensors, and the receiver compares it with the checksum of what arrived; the copies that
disagree are returned, and the worker fetches them again from another holder (Worker._adopt_whole).
"""

from __future__ import annotations

import torch
from torch import nn

from oobleck_slurm.engine.comm import Generation
from oobleck_slurm.engine.integrity import CORRUPT_BIT, checksum, flip_bit
from oobleck_slurm.engine.nccl_order import P2POp
from oobleck_slurm.optim import empty_state_tensors, load_optimizer_state_tensors, optimizer_state_tensors

TAG_STRIDE = 10_000  # tensors per transfer, at most


def layer_tensors(layer: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything that defines a trained layer, in a fixed order: parameters, buffers (a receiver builds
    its copy uninitialised), then optimizer state."""
    return ([p.data for p in layer.parameters()] + list(layer.buffers())
            + list(optimizer_state_tensors(opt).values()))


def run_transfers(gen: Generation, transfers: list[tuple[int, int, int]],
                  layers: dict[int, nn.Module], optimizers: dict[int, torch.optim.Optimizer],
                  corrupt_sends: bool = False) -> tuple[int, list[int]]:
    """Do this rank's part of `transfers` [(layer, src, dst)] on generation `gen`'s world group.

    A sender needs `layers[l]`/`optimizers[l]`; a receiver must have built a fresh layer and its
    optimizer under the same index beforehand: they are overwritten. Returns the bytes received and
    the positions in `transfers` of the copies this rank received that disagree with their sender's
    checksum. `corrupt_sends` (a drill, faults.py "corrupt" at "adopt"): what this rank sends carries
    one flipped bit, its own state and its checksum unchanged.
    """
    device_for_p2p = None if gen.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    sum_device = device_for_p2p or torch.device("cpu")
    sums: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []  # (position, what arrived, sender's checksum)
    ops: list[P2POp] = []  # posted as one batch; they keep their buffers alive
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, GPU receive buffer)
    state_loads: list[tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]] = []  # after the copies
    received = 0
    for index, (layer, src, dst) in enumerate(transfers):
        if gen.rank not in (src, dst):
            continue
        base = index * TAG_STRIDE
        if gen.rank == src:
            tensors = layer_tensors(layers[layer], optimizers[layer])
            own_sum = checksum(tensors, sum_device).reshape(1)  # of its state, whatever a drill sends
            for k, t in enumerate(tensors):
                t = t.contiguous()
                if corrupt_sends and k == 0:
                    t = t.clone()
                    flip_bit(t, 0, CORRUPT_BIT)
                if device_for_p2p is not None and t.device.type == "cpu":  # nccl: step counters
                    t = t.to(device_for_p2p)
                ops.append(P2POp("send", t, dst, base + k))
            ops.append(P2POp("send", own_sum, dst, base + len(tensors)))  # last on both ends: NCCL pairs in order
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
            sent_sum = torch.zeros(1, dtype=torch.int64, device=sum_device)
            ops.append(P2POp("recv", sent_sum, src, base + len(targets)))
            sums.append((index, targets, sent_sum))
            state_loads.append((opt, state))
    for work in gen.exchange(ops) if ops else []:
        gen.wait(work)
    for dst_t, buf in copies:
        dst_t.copy_(buf)
    corrupted = [index for index, targets, sent_sum in sums if int(checksum(targets, sum_device)) != int(sent_sum)]
    for opt, state in state_loads:
        load_optimizer_state_tensors(opt, state)
    return received, corrupted
