"""The cost model: stage time, pipeline iteration time (1F1B), stage memory, gradient all-reduce.

Scalar reference functions. `templates` evaluates the same formulas on whole arrays for speed, and
the tests check that both agree on every plan they produce.

A pipeline on n nodes has D = n * devices_per_node devices, numbered node by node. Stage i holds
layers [start, stop) on `g` consecutive devices starting at device u (g = 1 by default; g > 1 is a
data split of each microbatch inside one node, g a power of two dividing devices_per_node, u a
multiple of g). Every device of the pipeline holds exactly one stage. With N_b microbatches:

    compute_i  = sum_{l in stage} (fwd_l + bwd_l) / g
    p2p(x)     = 2 * (alpha + bytes(x) / bw)          activation forward + its gradient backward,
                                                       over the link between devices u-1 and u:
                                                       inter-node if u % devices_per_node == 0
    w_i        = compute_i + p2p(start boundary, if i > 0) + p2p(end boundary, if i < S-1)
                 + allreduce_intra(grad bytes of the stage, g) / N_b
    T          = sum_i w_i + (N_b - 1) * max_i w_i                     (1F1B iteration time)

T is the fill-and-drain of one microbatch through every stage plus N_b - 1 more microbatches at
the pace of the slowest stage. Transfers are blocking (gloo send/recv), so a stage is busy for both
of its boundaries. The in-stage all-reduce (g > 1 only) happens once per iteration; it is charged
per microbatch as 1/N_b of it, as if spread over the step (gradient buckets overlap backward).

Memory of each device of stage i: every term the engine's worker holds at its step's peak (checked
against the bytes a worker really holds, measured with oobleck_slurm/peak_memory.py, by
tests/planning/test_memory_model.py). Under 1F1B stage i holds at most k = min(N_b, S - i) microbatches
in flight; with one device per stage S - i = D - u, and with g > 1 we use D - u, an upper bound:

    mem_i = sum (param + grad + optimizer bytes)             once per stage
          + k * (sum activation_bytes + out_i) / g           per microbatch in flight
          + (out_i + in_i) / g                               the boundary buffers of one backward
          + max workspace_bytes / g                          one layer's forward or backward at work
            <= USABLE_MEMORY_FRACTION * device_memory_bytes

param and grad bytes are in the parameters' dtype (bf16 precision trains fp32 master weights under
autocast: 4 + 4 bytes); the optimizer's bytes come from its state layout (optim/memory.py). A layer's
activation_bytes is what autograd keeps for its backward (under bf16 autocast that includes the bf16
copy of each weight matrix, cast once per forward and kept for the backward). out_i = output bytes of
the stage's last layer, 0 on the last stage: each in-flight microbatch's output is kept until its
backward (it is also what is sent to stage i+1); in_i = output bytes of the layer before the stage, 0
on the first stage. Per backward the stage also holds the gradient received from stage i+1 (out_i) and
the input gradient it sends to stage i-1 (in_i). The received input of an in-flight microbatch is
the first layer's saved input: inside activation_bytes already. While one layer runs its forward or
backward it allocates, for a moment, more than it keeps (gradients of its intermediate tensors,
attention scores): its workspace_bytes, at most one layer's at a time. What the worker holds besides
(the framework's own buffers, the allocator's slack) is what USABLE_MEMORY_FRACTION leaves room for.

Data-parallel gradient synchronisation across pipelines (after the last backward, not overlapped):
each device all-reduces its stage's gradients with the P - 1 other holders of the same layers,
ring all-reduce over the inter-node links:

    allreduce(bytes, k) = 2 (k - 1) alpha + 2 (k - 1) / k * bytes / bw
    step_time(plan)     = max_p latency_p(nb_p) + max_{p, i} allreduce(grad bytes of p's stage i, P)
    latency_p(nb)       = sum_i w_i + (nb - 1) * max_i w_i
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_slurm.planning.profile import Link, Profile

# Leave room for the allocator's fragmentation, the framework's workspaces and communication buffers.
USABLE_MEMORY_FRACTION = 0.9


def p2p_time(link: Link, nbytes: float) -> float:
    return link.latency_s + nbytes / link.bandwidth_Bps


def allreduce_time(link: Link, nbytes: float, participants: int) -> float:
    """Ring all-reduce of `nbytes` among `participants` ranks (0 for one rank)."""
    if participants <= 1:
        return 0.0
    k = participants
    return 2 * (k - 1) * link.latency_s + 2 * (k - 1) / k * nbytes / link.bandwidth_Bps


def boundary_link(profile: Profile, device: int) -> Link:
    """The link between devices `device - 1` and `device` of a pipeline."""
    inter = device % profile.devices_per_node == 0
    return profile.link("inter_node" if inter else "intra_node")


def stage_time(
    profile: Profile, start: int, stop: int, devices: int, first_device: int, num_microbatches: int
) -> float:
    """w_i: seconds a stage is busy per microbatch, communication included."""
    layers = profile.layers[start:stop]
    compute = sum(layer.forward_s + layer.backward_s for layer in layers) / devices
    comm = 0.0
    if start > 0:
        comm += 2 * p2p_time(boundary_link(profile, first_device), profile.layers[start - 1].output_bytes)
    if stop < profile.num_layers:
        comm += 2 * p2p_time(boundary_link(profile, first_device + devices), profile.layers[stop - 1].output_bytes)
    grads = sum(layer.grad_bytes for layer in layers)
    sync = allreduce_time(profile.link("allreduce_intra"), grads, devices) / num_microbatches
    return compute + comm + sync


def in_flight(num_microbatches: int, devices_from_here: int) -> int:
    """Microbatches whose activations a 1F1B stage holds at most."""
    return min(num_microbatches, devices_from_here)


def stage_memory_terms(profile: Profile, start: int, stop: int, devices: int,
                       microbatches_in_flight: int) -> dict[str, float]:
    """The terms of `stage_memory` by name (bytes on each device of the stage; see the module doc)."""
    layers = profile.layers[start:stop]
    out = profile.layers[stop - 1].output_bytes if stop < profile.num_layers else 0
    inp = profile.layers[start - 1].output_bytes if start > 0 else 0
    return {
        "parameters": float(sum(layer.param_bytes for layer in layers)),
        "gradients": float(sum(layer.grad_bytes for layer in layers)),
        "optimizer": float(sum(layer.optimizer_bytes for layer in layers)),
        "activations": microbatches_in_flight * sum(layer.activation_bytes for layer in layers) / devices,
        "stage_outputs": microbatches_in_flight * out / devices,
        "boundary_gradients": (out + inp) / devices,
        "workspace": max(layer.workspace_bytes for layer in layers) / devices,
    }


def stage_memory(profile: Profile, start: int, stop: int, devices: int, microbatches_in_flight: int) -> float:
    """Peak bytes on each device of a stage."""
    return sum(stage_memory_terms(profile, start, stop, devices, microbatches_in_flight).values())


def usable_memory(profile: Profile) -> float:
    return USABLE_MEMORY_FRACTION * profile.device_memory_bytes


def pipeline_time(stage_times: Sequence[float], num_microbatches: int) -> float:
    """T: 1F1B iteration time of one pipeline for `num_microbatches` microbatches."""
    return sum(stage_times) + (num_microbatches - 1) * max(stage_times)


def sync_time(profile: Profile, stage_grad_bytes: Sequence[float], num_pipelines: int) -> float:
    """Cross-pipeline gradient all-reduce: the slowest device's share."""
    link = profile.link("allreduce_inter")
    return max((allreduce_time(link, b, num_pipelines) for b in stage_grad_bytes), default=0.0)
