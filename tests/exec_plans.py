"""ExecPlans for tests, from per-pipeline stage bounds and microbatch counts (the engine takes its plans
from the planner: engine/from_planner.py)."""

from __future__ import annotations

from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec


def make_plan(num_layers: int, stage_bounds: list[list[int]], mb_counts: list[int],
              first_rank: int = 0) -> ExecPlan:
    """A plan from per-pipeline bounds and microbatch counts, ranks numbered consecutively.

    E.g. make_plan(6, [[0, 6], [0, 3, 6]], [2, 4]): a 1-stage pipeline on rank 0 with microbatches
    0-1 and a 2-stage pipeline on ranks 1, 2 with microbatches 2-5.
    """
    pipelines = []
    rank, mb = first_rank, 0
    for bounds, count in zip(stage_bounds, mb_counts, strict=True):
        n = len(bounds) - 1
        pipelines.append(PipelineSpec(tuple(range(rank, rank + n)), tuple(bounds), mb, count))
        rank += n
        mb += count
    return ExecPlan(num_layers, mb, tuple(pipelines))
