"""The cost model: stage time, pipeline iteration time (1F1B), stage memory, gradient all-reduce, and
the pure data-parallel bound the plans are compared with.

Scalar reference functions. `templates` evaluates the same formulas on whole arrays for speed, and
the tests check that both agree on every plan they produce.

A pipeline on n nodes has D = n * devices_per_node devices, numbered node by node. Stage i holds
layers [start, stop) on `g` consecutive devices of one node starting at device u (g divides
devices_per_node; `max_stage_devices` bounds it). Every device of the pipeline holds exactly one stage.

Sharded stages (g > 1), the contract for the engine (engine/shard.py): ZeRO inside the stage. Each
device holds 1/g of the stage's layers' parameters (the master copy) and optimizer state, and each
microbatch's m samples are split across the devices (data parallel inside the stage): each device
runs c = 1/g of the microbatch (the planner offers a stage in a pipeline of several only widths that
divide m, `templates.allowed_stage_devices`).

A pipeline's only stage may be wider than that (a whole node, `templates.folded_width`): it then
computes k = g / gcd(g, m) microbatches in one pass (`stage_fold`), each device m / gcd(g, m) of their
k m samples, so c = 1 / gcd(g, m) of a microbatch per pass and w_i below is charged per pass / k. Such
a stage is always kept (below), so a pass has no collective and a device with no sample in the step's
last, partial pass (the pipeline's microbatches need not be a multiple of k) skips it. The model
charges each microbatch 1/k of a pass, so it counts a partial pass as less than the whole pass it
takes. Collectives run on the intra-node collective link
(`allreduce_intra`), ring algorithm, in the parameters' dtype (what the engine gathers):

    allgather(bytes, g) = reduce_scatter(bytes, g) = (g - 1) alpha + (g - 1) / g * bytes / bw

A stage runs in one of two modes, chosen per stage by the planner (`choose_keep`): kept whenever it
fits in memory (it gathers once per step where resharded gathers twice per microbatch), else resharded.

- Resharded (ZeRO-3, `keep` False): per microbatch, every layer's parameters are all-gathered before its
  forward and again before its backward (freed after each use), and its gradient is reduce-scattered
  after its backward into the device's gradient shard; the scatter is waited for behind the next
  layer's backward, so the whole gradient lives until then (two layers' at a time):

      comm_l    = 2 allgather(param bytes of l, g) + reduce_scatter(grad bytes of l, g)
      exposed_i = sum_{l in stage} max(0, comm_l - c (fwd_l + bwd_l))
                  + allgather(first layer) + allgather(last layer) + reduce_scatter(first layer's grads)

  The engine prefetches the next layer's gather while the current layer computes, so a layer's
  collectives hide behind one layer's compute: we charge what they exceed its own compute by, and never
  hide the ends of a pass (the first forward gather, the first backward gather, the last scatter).

- Kept (ZeRO-2 over the step, `keep` True): the parameters are gathered once per step, at their first
  forward, and kept until the step ends; gradients accumulate at full size over the step's microbatches
  and are reduce-scattered once (charged in the gradient synchronisation below). The step's gathers are
  charged once per step, in the fill (the first microbatch's forward), not per microbatch:

      once_i = sum_{l in stage} max(0, allgather(l) - c fwd_l) + allgather(first layer)

With N_b microbatches:

    compute_i  = c * sum_{l in stage} (fwd_l + bwd_l)
    p2p(x)     = 2 * (alpha + c * bytes(x) / bw)      activation forward + its gradient backward,
                                                       over the link between devices u-1 and u:
                                                       inter-node if u % devices_per_node == 0
    w_i        = compute_i + p2p(start boundary, if i > 0) + p2p(end boundary, if i < S-1)
                 + exposed_i (g > 1, resharded only)
    T          = sum_i (w_i + once_i) + (N_b - 1) * max_i w_i         (1F1B iteration time)

T is the fill-and-drain of one microbatch through every stage (with each kept stage's gathers, once_i,
0 for other stages) plus N_b - 1 more microbatches at the pace of the slowest stage. Transfers are
blocking (gloo send/recv), so a stage is busy for both of its boundaries. Each device of a stage sends
and receives its own share c of the microbatch's samples (to and from the ranks of the neighbour stage
whose samples overlap them), every device on its own link, so a boundary costs a device its share's
bytes, whatever the neighbour's width (one latency is charged where a share may be split in two).

Memory of each device of stage i: every term the engine's worker holds at its step's peak (checked
against the bytes a worker really holds, measured with oobleck_slurm/peak_memory.py, by
tests/planning/test_memory_model.py, for one-device stages). Under 1F1B stage i holds at most
S - i microbatches in flight; the planner counts k = min(N_b, r - g + 1), r = D - u the devices from the
stage's first to the pipeline's end: every later stage has at least one device, so r - g + 1 >= S - i,
with equality when every stage has one device:

    mem_i = sum (param + grad + optimizer bytes) / g         the stage's state, sharded
          + k * c * (sum activation_bytes + out_i)           per microbatch in flight
          + c * (out_i + in_i)                               the boundary buffers of one backward
          + c * max workspace_bytes                          one layer's forward or backward at work
          + 2 * max param bytes + 2 * max grad_bytes         (g > 1, resharded) a layer's gathered
                                                             parameters and the next one's prefetch; a
                                                             layer's whole gradient, and the previous
                                                             layer's while its scatter runs behind it
          + sum param bytes + sum grad bytes                 (g > 1, kept) the stage's gathered
                                                             parameters and whole gradients
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

Data-parallel gradient synchronisation across pipelines, layer by layer, overlapped with the last
microbatch's backward as the engine does it (engine/worker.py, stage.py): the last microbatch's
backward runs one layer at a time, and as soon as layer l's gradient is complete the stage issues its
all-reduce, asynchronously, on the group of the devices holding l (one group per set of holders, so
a device's all-reduces run one after another, in the order issued: its stage's last layer first).
Each device all-reduces its shard of the layer's gradient (grad bytes / g, after the layer's
reduce-scatter when g > 1) with the P - 1 devices holding the same shard in the other pipelines, ring
all-reduce over the inter-node links (each device's own share of the node's network):

    allreduce(bytes, k) = 2 (k - 1) alpha + 2 (k - 1) / k * bytes / bw
    latency_p(nb)       = sum_i w_i + (nb - 1) * max_i w_i

Layer l's gradient is complete, in pipeline p, no later than latency_p minus the work that must still
follow it on the pipeline's critical path: the last microbatch's backward of the layers before l
(c_i * backward_s each) and the gradient transfers of the stage boundaries before l (one direction,
p2p), the backward chain down to the first layer. Only compute and transfers are counted there (not a
sharded stage's exposed gathers), so the hidden window is never overestimated. Then, with layers taken
from the last to the first:

    ready_l  = max_p (latency_p - tail_{p,l}) + reduce_scatter(grad bytes of l, g)    (g > 1 only)
    end_l    = max(ready_l, end_{l+1} if some pipeline holds l and l+1 in one stage) + a_l
    a_l      = max_p allreduce(grad bytes of l / g_{p,l}, P)
    step_time(plan) = max(max_p latency_p(nb_p), max_l end_l)

and the plan's `sync_time_s` is what the all-reduces add beyond the slowest pipeline (`exposed_sync`).
A device's compute is not slowed by its all-reduces in flight (NCCL runs them on their own stream).

The data-parallel bound, `data_parallel_step`: N devices, no pipeline and so no bubble, each running
1/N of the global batch, the better of two layouts, both optimistic (every collective but the ends
hidden, no memory check); it is what a plan is measured against:
- flat FSDP (ZeRO-3 over all N devices on the inter-node collective link): per layer one gather for the
  forward, one for the backward and one reduce-scatter per step, with a sharded stage's overlap rule;
- hybrid (HSDP: ZeRO inside each node, gradients all-reduced across nodes, N a multiple of the devices
  per node d): the kept mode's one gather per step inside the node, then the ends that nothing can hide:
  the first layer's gather, and after the last backward its reduce-scatter inside the node and the
  all-reduce of its 1/d shard across the N/d nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from oobleck_slurm.planning.profile import LayerProfile, Link, Profile

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


def allgather_time(link: Link, nbytes: float, participants: int) -> float:
    """Ring all-gather of `nbytes` in all (each rank holds nbytes / participants); a reduce-scatter
    of `nbytes` takes the same."""
    if participants <= 1:
        return 0.0
    k = participants
    return (k - 1) * link.latency_s + (k - 1) / k * nbytes / link.bandwidth_Bps


def stage_fold(microbatch_size: int, devices: int) -> int:
    """k: how many microbatches a stage of `devices` computes in one pass (module doc): 1 where the
    devices divide the microbatch's samples, else the fewest whole microbatches whose samples they do."""
    return devices // math.gcd(microbatch_size, devices)


def work_fraction(profile: Profile, devices: int) -> float:
    """c: the share of a microbatch's samples (its compute, its activations) a stage's busiest device
    computes in one pass (module doc: 1/g, or 1/gcd(g, m) for a folded stage)."""
    m = profile.microbatch_size
    return (m // math.gcd(m, devices)) / m


def gathered_bytes(profile: Profile, layer: LayerProfile) -> float:
    """Bytes of a layer's parameters as they are all-gathered: the parameters' own dtype (under bf16 the
    engine gathers the fp32 master weights; autocast casts them at use)."""
    return float(layer.param_bytes)


def shard_comm_time(profile: Profile, layer: LayerProfile, devices: int, link: Link) -> float:
    """comm_l: a layer's collectives per microbatch in a resharded stage (two gathers, one scatter)."""
    return (2 * allgather_time(link, gathered_bytes(profile, layer), devices)
            + allgather_time(link, layer.grad_bytes, devices))


def exposed_shard_time(profile: Profile, layers: Sequence[LayerProfile], devices: int, share: float,
                       link: Link) -> float:
    """What a resharded pass of `share` microbatches through `layers` waits for its gathers and
    scatters (module doc)."""
    if devices <= 1 or not layers:
        return 0.0
    hidden_behind = sum(max(0.0, shard_comm_time(profile, layer, devices, link)
                            - share * (layer.forward_s + layer.backward_s)) for layer in layers)
    first, last = layers[0], layers[-1]
    ends = (allgather_time(link, gathered_bytes(profile, first), devices)
            + allgather_time(link, gathered_bytes(profile, last), devices)
            + allgather_time(link, first.grad_bytes, devices))
    return hidden_behind + ends


def exposed_kept_time(profile: Profile, layers: Sequence[LayerProfile], devices: int, share: float,
                      link: Link) -> float:
    """What a kept stage waits, once per step, for gathering its parameters (module doc, before / N_b)."""
    if devices <= 1 or not layers:
        return 0.0
    hidden_behind = sum(max(0.0, allgather_time(link, gathered_bytes(profile, layer), devices)
                            - share * layer.forward_s) for layer in layers)
    return hidden_behind + allgather_time(link, gathered_bytes(profile, layers[0]), devices)


def boundary_link(profile: Profile, device: int) -> Link:
    """The link between devices `device - 1` and `device` of a pipeline."""
    inter = device % profile.devices_per_node == 0
    return profile.link("inter_node" if inter else "intra_node")


def stage_time(profile: Profile, start: int, stop: int, devices: int, first_device: int,
               keep: bool = False) -> float:
    """w_i: seconds a stage is busy per microbatch, communication included (`keep`: the kept mode)."""
    layers = profile.layers[start:stop]
    c = work_fraction(profile, devices)
    compute = c * sum(layer.forward_s + layer.backward_s for layer in layers)
    comm = 0.0
    if start > 0:
        comm += 2 * p2p_time(boundary_link(profile, first_device), c * profile.layers[start - 1].output_bytes)
    if stop < profile.num_layers:
        comm += 2 * p2p_time(boundary_link(profile, first_device + devices), c * profile.layers[stop - 1].output_bytes)
    k = stage_fold(profile.microbatch_size, devices)  # a pass of k microbatches, charged per microbatch
    if keep:
        return (compute + comm) / k
    return (compute + comm + exposed_shard_time(profile, layers, devices, c, profile.link("allreduce_intra"))) / k


def stage_once_time(profile: Profile, start: int, stop: int, devices: int, keep: bool) -> float:
    """once_i: what a stage adds once per step (a kept stage's gathers; 0 otherwise)."""
    if not keep:
        return 0.0
    return exposed_kept_time(profile, profile.layers[start:stop], devices, work_fraction(profile, devices),
                             profile.link("allreduce_intra"))


def in_flight(num_microbatches: int, devices_from_here: int) -> int:
    """Microbatches whose activations a 1F1B stage holds at most (`devices_from_here`: S - i, or the
    bound r - g + 1 of the module doc)."""
    return min(num_microbatches, devices_from_here)


def stage_memory_terms(profile: Profile, start: int, stop: int, devices: int,
                       microbatches_in_flight: int, keep: bool = False) -> dict[str, float]:
    """The terms of `stage_memory` by name (bytes on each device of the stage; see the module doc)."""
    layers = profile.layers[start:stop]
    out = profile.layers[stop - 1].output_bytes if stop < profile.num_layers else 0
    inp = profile.layers[start - 1].output_bytes if start > 0 else 0
    c = work_fraction(profile, devices)
    gather = 0.0
    if devices > 1 and keep:
        gather = sum(gathered_bytes(profile, layer) + layer.grad_bytes for layer in layers)
    elif devices > 1:
        gather = 2 * (max(gathered_bytes(profile, layer) for layer in layers)
                      + max(layer.grad_bytes for layer in layers))
    return {
        "parameters": sum(layer.param_bytes for layer in layers) / devices,
        "gradients": sum(layer.grad_bytes for layer in layers) / devices,
        "optimizer": sum(layer.optimizer_bytes for layer in layers) / devices,
        "activations": microbatches_in_flight * c * sum(layer.activation_bytes for layer in layers),
        "stage_outputs": microbatches_in_flight * c * out,
        "boundary_gradients": c * (out + inp),
        "workspace": c * max(layer.workspace_bytes for layer in layers),
        "gather_buffers": gather,
    }


def stage_memory(profile: Profile, start: int, stop: int, devices: int, microbatches_in_flight: int,
                 keep: bool = False) -> float:
    """Peak bytes on each device of a stage."""
    return sum(stage_memory_terms(profile, start, stop, devices, microbatches_in_flight, keep).values())


def choose_keep(profile: Profile, start: int, stop: int, devices: int, microbatches_in_flight: int) -> bool:
    """The stage's mode (module doc): kept if it fits in memory with that many microbatches in flight.
    Always False for one device."""
    return devices > 1 and stage_memory(profile, start, stop, devices, microbatches_in_flight, True) <= usable_memory(profile)


def usable_memory(profile: Profile) -> float:
    return USABLE_MEMORY_FRACTION * profile.device_memory_bytes


def pipeline_time(stage_times: Sequence[float], num_microbatches: int, once: Sequence[float] = ()) -> float:
    """T: 1F1B iteration time of one pipeline for `num_microbatches` microbatches (`once`: each stage's
    once_i, none by default)."""
    return sum(stage_times) + sum(once) + (num_microbatches - 1) * max(stage_times)


def sync_bytes(profile: Profile, start: int, stop: int, devices: int) -> float:
    """Gradient bytes each device of a stage all-reduces across pipelines: its shard."""
    return sum(layer.grad_bytes for layer in profile.layers[start:stop]) / devices


def sync_time(profile: Profile, stage_grad_bytes: Sequence[float], num_pipelines: int) -> float:
    """Cross-pipeline gradient all-reduce: the slowest device's share (`sync_bytes` of each stage)."""
    link = profile.link("allreduce_inter")
    return max((allreduce_time(link, b, num_pipelines) for b in stage_grad_bytes), default=0.0)


def sync_end(profile: Profile, pipelines: Sequence[tuple[Sequence[tuple[int, int, int, int]], float]],
             num_pipelines: int) -> float:
    """When the last cross-pipeline all-reduce ends, from the step's start (module doc: max_l end_l).

    `pipelines`: the distinct (stages as (start, stop, first device, devices), latency_p) of the plan;
    `num_pipelines`: P, all pipelines counted (each takes part in every layer's all-reduce)."""
    L = profile.num_layers
    inter, intra = profile.link("allreduce_inter"), profile.link("allreduce_intra")
    ready = [-math.inf] * L
    cost_of = [0.0] * L
    queued_after_next = [False] * L  # some device all-reduces l right after l + 1 (same stage)
    for stages, latency in pipelines:
        tail = 0.0  # work on the critical path after the point reached, walking from layer 0 upwards
        for start, stop, first, g in stages:
            c = work_fraction(profile, g)
            if start > 0:  # the gradient sent back over this stage's first boundary
                tail += p2p_time(boundary_link(profile, first), c * profile.layers[start - 1].output_bytes)
            for index in range(start, stop):
                layer = profile.layers[index]
                scatter = allgather_time(intra, layer.grad_bytes, g)
                ready[index] = max(ready[index], latency - tail + scatter)
                cost_of[index] = max(cost_of[index], allreduce_time(inter, layer.grad_bytes / g, num_pipelines))
                queued_after_next[index] = queued_after_next[index] or index + 1 < stop
                tail += c * layer.backward_s
    end, last = -math.inf, -math.inf
    for index in reversed(range(L)):
        begin = max(ready[index], last) if queued_after_next[index] else ready[index]
        last = begin + cost_of[index]
        end = max(end, last)
    return end


def exposed_sync(profile: Profile, pipelines: Sequence[tuple[Sequence[tuple[int, int, int, int]], float]],
                 num_pipelines: int) -> float:
    """The all-reduce time not hidden behind the slowest pipeline (module doc; 0 for one pipeline)."""
    if num_pipelines <= 1 or not pipelines:
        return 0.0
    return max(0.0, sync_end(profile, pipelines, num_pipelines) - max(lat for _, lat in pipelines))


def data_parallel_step(profile: Profile, num_devices: int, global_microbatches: int) -> float:
    """Step time of the pure data-parallel bound on `num_devices` devices (module doc): the better of
    flat FSDP and hybrid sharding inside nodes."""
    if num_devices < 1 or global_microbatches < 1:
        raise ValueError(f"need >= 1 device and microbatch, got {num_devices} and {global_microbatches}")
    share = global_microbatches / num_devices  # microbatches' worth of samples per device
    compute = share * sum(layer.forward_s + layer.backward_s for layer in profile.layers)
    flat = compute + exposed_shard_time(profile, profile.layers, num_devices, share, profile.link("allreduce_inter"))
    d = profile.devices_per_node
    if d <= 1 or num_devices % d:
        return flat
    intra, first = profile.link("allreduce_intra"), profile.layers[0]
    hybrid = (compute + exposed_kept_time(profile, profile.layers, d, share, intra)
              + allgather_time(intra, first.grad_bytes, d)
              + allreduce_time(profile.link("allreduce_inter"), first.grad_bytes / d, num_devices // d))
    return min(flat, hybrid)
