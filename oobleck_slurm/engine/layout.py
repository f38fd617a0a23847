"""What the engine executes: pipelines of stages over worker ranks, and each rank's role in it.

An `ExecPlan` is the engine's view of the planner's plan: for each pipeline, one worker rank per
stage, the stage boundaries (stage i = layers [bounds[i], bounds[i+1])) and a contiguous slice of the
step's microbatches. Ranks are the worker ranks of one generation (0..world_size-1); a rank in no
pipeline is a spare. All of this is pure data, JSON round-trippable so that a supervisor can publish
it through the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oobleck_slurm.errors import InternalError


class PlanError(InternalError, ValueError):
    """An execution plan is inconsistent (overlapping ranks, gaps in layers or microbatches, ...)."""


@dataclass(frozen=True)
class PipelineSpec:
    ranks: tuple[int, ...]  # worker rank of stage 0, 1, ...
    bounds: tuple[int, ...]  # len(ranks) + 1 layer boundaries, 0 ... num_layers
    mb_start: int  # first microbatch of the step this pipeline trains on
    mb_count: int  # how many consecutive microbatches

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    def stage_layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])


@dataclass(frozen=True)
class ExecPlan:
    num_layers: int
    num_microbatches: int  # of the whole step (global batch = num_microbatches * microbatch size)
    pipelines: tuple[PipelineSpec, ...]

    def __post_init__(self) -> None:
        validate(self)

    @property
    def ranks(self) -> list[int]:
        """Ranks that train (spares excluded), in pipeline then stage order."""
        return [r for p in self.pipelines for r in p.ranks]

    def holders(self, layer: int) -> tuple[int, ...]:
        """The ranks holding `layer`: one per pipeline, in pipeline order."""
        return tuple(p.ranks[_stage_of(p, layer)] for p in self.pipelines)

    def role(self, rank: int) -> Role | None:
        """What `rank` does in this plan; None for a spare."""
        for index, p in enumerate(self.pipelines):
            if rank in p.ranks:
                stage = p.ranks.index(rank)
                return Role(
                    pipeline=index,
                    stage=stage,
                    num_stages=p.num_stages,
                    layers=p.stage_layers(stage),
                    prev_rank=p.ranks[stage - 1] if stage > 0 else None,
                    next_rank=p.ranks[stage + 1] if stage + 1 < p.num_stages else None,
                    mb_start=p.mb_start,
                    mb_count=p.mb_count,
                    pipeline_ranks=p.ranks,
                )
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_microbatches": self.num_microbatches,
            "pipelines": [
                {"ranks": list(p.ranks), "bounds": list(p.bounds), "mb_start": p.mb_start,
                 "mb_count": p.mb_count}
                for p in self.pipelines
            ],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ExecPlan:
        return ExecPlan(
            num_layers=int(d["num_layers"]),
            num_microbatches=int(d["num_microbatches"]),
            pipelines=tuple(
                PipelineSpec(tuple(p["ranks"]), tuple(p["bounds"]), int(p["mb_start"]), int(p["mb_count"]))
                for p in d["pipelines"]
            ),
        )


@dataclass(frozen=True)
class Role:
    pipeline: int
    stage: int
    num_stages: int
    layers: range
    prev_rank: int | None
    next_rank: int | None
    mb_start: int
    mb_count: int
    pipeline_ranks: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def _stage_of(p: PipelineSpec, layer: int) -> int:
    for stage in range(p.num_stages):
        if p.bounds[stage] <= layer < p.bounds[stage + 1]:
            return stage
    raise PlanError(f"layer {layer} is outside the pipeline's layers [0, {p.bounds[-1]})")


def validate(plan: ExecPlan) -> None:
    """Raise PlanError naming the first inconsistency of `plan`."""
    if not plan.pipelines:
        raise PlanError("plan has no pipelines")
    seen: set[int] = set()
    next_mb = 0
    for i, p in enumerate(plan.pipelines):
        where = f"pipeline {i} (ranks {list(p.ranks)})"
        if not p.ranks:
            raise PlanError(f"{where}: has no stages")
        if len(p.bounds) != len(p.ranks) + 1:
            raise PlanError(f"{where}: needs {len(p.ranks) + 1} layer bounds, got {list(p.bounds)}")
        if p.bounds[0] != 0 or p.bounds[-1] != plan.num_layers:
            raise PlanError(f"{where}: bounds {list(p.bounds)} must run from 0 to {plan.num_layers}")
        if any(a >= b for a, b in zip(p.bounds, p.bounds[1:])):
            raise PlanError(f"{where}: bounds {list(p.bounds)} must be strictly increasing (no empty stage)")
        if any(r < 0 for r in p.ranks):
            raise PlanError(f"{where}: negative rank")
        dup = seen.intersection(p.ranks) | ({r for r in p.ranks if p.ranks.count(r) > 1})
        if dup:
            raise PlanError(f"{where}: rank(s) {sorted(dup)} already used by another stage")
        seen.update(p.ranks)
        if p.mb_start != next_mb or p.mb_count < 0:
            raise PlanError(
                f"{where}: microbatch slice starts at {p.mb_start} with {p.mb_count} microbatches; "
                f"expected a slice starting at {next_mb} (slices are contiguous, in pipeline order)"
            )
        next_mb += p.mb_count
    if next_mb != plan.num_microbatches:
        raise PlanError(f"pipelines cover {next_mb} microbatches, the step has {plan.num_microbatches}")


def layer_groups(plan: ExecPlan) -> dict[tuple[int, ...], list[int]]:
    """Layers by the set of ranks holding them (sorted tuple): one all-reduce group per set.

    Sets of one rank (a layer held by a single pipeline) need no group and are left out.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for layer in range(plan.num_layers):
        members = tuple(sorted(plan.holders(layer)))
        if len(members) > 1:
            groups.setdefault(members, []).append(layer)
    return groups
