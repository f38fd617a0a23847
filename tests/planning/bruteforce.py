"""Brute-force references for small cases: every partition, every combination. Exponential; for
tests and the benchmark's plan-quality check only."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from oobleck_slurm.planning import cost
from oobleck_slurm.planning.profile import Profile
from oobleck_slurm.planning.templates import PipelineTemplate, allowed_stage_devices, folded_width, template_from_stages


def _partitions(L: int, D: int, d: int, gs: list[int], a: int = 0,
                u: int = 0) -> Iterator[list[tuple[int, int, int, int]]]:
    """Every (start, stop, first device, devices) sequence: contiguous layers, each stage on g
    consecutive devices of one node (d devices per node), every device used."""
    if a == L or u == D:
        if a == L and u == D:
            yield []
        return
    for b in range(a + 1, L + 1):
        for g in gs:
            if u % d + g <= d and u + g <= D:
                for rest in _partitions(L, D, d, gs, b, u + g):
                    yield [(a, b, u, g), *rest]


def best_template_brute(
    profile: Profile, num_nodes: int, num_microbatches: int, max_stage_devices: int = 1,
    memory_microbatches: int | None = None,
) -> PipelineTemplate | None:
    """The template with the least iteration time at `num_microbatches` among all that fit in memory
    with `memory_microbatches` (default: the same) in flight, or None."""
    gs = allowed_stage_devices(profile.devices_per_node, max_stage_devices, profile.microbatch_size)
    budget = cost.usable_memory(profile)
    best = None
    partitions = list(_partitions(profile.num_layers, num_nodes * profile.devices_per_node, profile.devices_per_node, gs))
    folded = folded_width(profile.devices_per_node, max_stage_devices, profile.microbatch_size)
    if folded is not None and num_nodes == 1:  # the whole node as the only stage, several microbatches a pass
        partitions.append([(0, profile.num_layers, 0, folded)])
    for stages in partitions:
        t = template_from_stages(profile, num_nodes, stages, num_microbatches, memory_microbatches)
        if t.max_memory_bytes > budget or (cost.stage_fold(profile.microbatch_size, stages[0][3]) > 1
                                           and not t.stages[0].keep):
            continue
        if best is None or t.iteration_time_s < best.iteration_time_s:
            best = t
    return best


def best_counts_brute(
    templates: Sequence[PipelineTemplate], nodes: int, min_pipelines: int, global_microbatches: int,
    use_all_nodes: bool = False,
) -> tuple[float, tuple[int, ...]] | None:
    """(fluid step time, counts per template) minimising the instantiation objective, by enumeration."""
    from oobleck_slurm.planning.instantiate import fluid_time

    best = None
    ranges = [range(nodes // t.num_nodes + 1) for t in templates]
    for counts in itertools.product(*ranges):
        used = sum(c * t.num_nodes for c, t in zip(counts, templates))
        if used > nodes or (use_all_nodes and used != nodes) or sum(counts) < min_pipelines:
            continue
        chosen = [t for c, t in zip(counts, templates) for _ in range(c)]
        if sum(counts) > global_microbatches:
            continue
        value = fluid_time(chosen, global_microbatches)
        if best is None or value < best[0] - 1e-12 * value:
            best = (value, counts)
    return best
