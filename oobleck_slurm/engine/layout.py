"""What the engine executes: pipelines of stages over worker ranks, and each rank's role in it.

An `ExecPlan` is the engine's view of the planner's plan: for each pipeline, each stage's first
worker rank and width (stage s runs on ranks ranks[s] .. ranks[s] + widths[s] - 1, consecutive
workers of one node), the stage boundaries (stage i = layers [bounds[i], bounds[i+1])) and a
contiguous slice of the step's microbatches. Ranks are the worker ranks of one generation
(0..world_size-1); a rank in no pipeline is a spare. All of this is pure data, JSON round-trippable so
that a supervisor can publish it through the store.

A stage of width g > 1 is sharded ZeRO-3 style inside the stage (engine/shard.py): rank j of it holds
element range j of each of its layers' flat buffers and computes samples [j*b/g, (j+1)*b/g) of every
microbatch. Shard boundaries of the widths (powers of two up to SHARD_ALIGN) nest, so gradients are
all-reduced across replicas in pieces at the widest holder's boundaries (`reduce_pieces`), and
activations cross a stage boundary as the overlaps of the two stages' sample ranges (`edge_pieces`).
A pipeline's only stage may be wider than the microbatch splits evenly: it then computes k
microbatches per pass (`planning.cost.stage_fold`), each rank its share of their k*b samples
(`pass_slices`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oobleck_slurm.errors import InternalError
from oobleck_slurm.planning.cost import stage_fold


class PlanError(InternalError, ValueError):
    """An execution plan is inconsistent (overlapping ranks, gaps in layers or microbatches, ...)."""


# Widths are powers of two up to this; a sharded layer's flat buffer is padded to a multiple of it, so
# that the shards of every width nest (shard.py).
SHARD_ALIGN = 64


@dataclass(frozen=True)
class PipelineSpec:
    ranks: tuple[int, ...]  # first worker rank of stage 0, 1, ...
    bounds: tuple[int, ...]  # len(ranks) + 1 layer boundaries, 0 ... num_layers
    mb_start: int  # first microbatch of the step this pipeline trains on
    mb_count: int  # how many consecutive microbatches
    widths: tuple[int, ...] = ()  # workers of each stage (ranks[s] .. ranks[s] + widths[s] - 1); () = all 1
    # per stage, wider than one worker: parameters gathered once per step and kept (else gathered around
    # each use, gradients reduce-scattered each microbatch); () = none kept (shard.py)
    keep: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.widths:  # one canonical form: equal plans compare equal
            object.__setattr__(self, "widths", (1,) * len(self.ranks))
        if not self.keep:
            object.__setattr__(self, "keep", (False,) * len(self.ranks))

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    def stage_layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Every worker rank of `stage`, its first rank first."""
        return tuple(range(self.ranks[stage], self.ranks[stage] + self.widths[stage]))

    @property
    def all_ranks(self) -> tuple[int, ...]:
        """Every worker rank of the pipeline, stage by stage."""
        return tuple(r for s in range(self.num_stages) for r in self.stage_ranks(s))

    @property
    def sharded(self) -> bool:
        return any(w > 1 for w in self.widths)


@dataclass(frozen=True)
class ExecPlan:
    num_layers: int
    num_microbatches: int  # of the whole step (global batch = num_microbatches * microbatch size)
    pipelines: tuple[PipelineSpec, ...]

    def __post_init__(self) -> None:
        validate(self)

    @property
    def ranks(self) -> list[int]:
        """Ranks that train (spares excluded), in pipeline then stage order (every rank of a wide stage)."""
        return [r for p in self.pipelines for r in p.all_ranks]

    @property
    def sharded(self) -> bool:
        """True if some stage spans more than one worker."""
        return any(p.sharded for p in self.pipelines)

    @property
    def max_width(self) -> int:
        return max(w for p in self.pipelines for w in p.widths)

    def holders(self, layer: int) -> tuple[int, ...]:
        """The first rank of the stage holding `layer`: one per pipeline, in pipeline order."""
        return tuple(p.ranks[_stage_of(p, layer)] for p in self.pipelines)

    def holder_stages(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """Every rank of the stage holding `layer` (its shards in order), one stage per pipeline."""
        return tuple(p.stage_ranks(_stage_of(p, layer)) for p in self.pipelines)

    def role(self, rank: int) -> Role | None:
        """What `rank` does in this plan; None for a spare."""
        for index, p in enumerate(self.pipelines):
            for stage in range(p.num_stages):
                members = p.stage_ranks(stage)
                if rank not in members:
                    continue
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
                    stage_ranks=members,
                    prev_ranks=p.stage_ranks(stage - 1) if stage > 0 else (),
                    next_ranks=p.stage_ranks(stage + 1) if stage + 1 < p.num_stages else (),
                    pipeline_all_ranks=p.all_ranks,
                    index=members.index(rank),
                    keep=p.keep[stage],
                )
        return None

    def to_json(self) -> dict[str, Any]:
        pipelines = []
        for p in self.pipelines:
            d: dict[str, Any] = {"ranks": list(p.ranks), "bounds": list(p.bounds), "mb_start": p.mb_start,
                                 "mb_count": p.mb_count}
            if p.sharded:  # width-1 plans keep their JSON
                d["widths"] = list(p.widths)
            if any(p.keep):
                d["keep"] = list(p.keep)
            pipelines.append(d)
        return {"num_layers": self.num_layers, "num_microbatches": self.num_microbatches, "pipelines": pipelines}

    @staticmethod
    def from_json(d: dict[str, Any]) -> ExecPlan:
        return ExecPlan(
            num_layers=int(d["num_layers"]),
            num_microbatches=int(d["num_microbatches"]),
            pipelines=tuple(
                PipelineSpec(tuple(p["ranks"]), tuple(p["bounds"]), int(p["mb_start"]), int(p["mb_count"]),
                             tuple(int(w) for w in p.get("widths", ())), tuple(bool(k) for k in p.get("keep", ())))
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
    pipeline_ranks: tuple[int, ...]  # first rank of each stage
    stage_ranks: tuple[int, ...] = ()  # every rank of this stage (its group when wider than 1)
    prev_ranks: tuple[int, ...] = ()  # every rank of the previous stage, () on the first
    next_ranks: tuple[int, ...] = ()
    pipeline_all_ranks: tuple[int, ...] = ()  # every rank of the pipeline (the gradient-norm sum)
    index: int = 0  # this rank's position in its stage: its shard, and its slice of each microbatch
    keep: bool = False  # a wide stage's parameters gathered once per step and kept (PipelineSpec.keep)

    @property
    def width(self) -> int:
        return max(1, len(self.stage_ranks))

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
        if len(p.widths) != len(p.ranks):
            raise PlanError(f"{where}: needs {len(p.ranks)} stage widths, got {list(p.widths)}")
        if any(w < 1 or w > SHARD_ALIGN or w & (w - 1) for w in p.widths):
            raise PlanError(f"{where}: stage widths {list(p.widths)} must be powers of two up to {SHARD_ALIGN}")
        if len(p.keep) != len(p.ranks) or any(k and w == 1 for k, w in zip(p.keep, p.widths)):
            raise PlanError(f"{where}: stage modes {list(p.keep)} need one per stage, kept only where wider than 1")
        everyone = p.all_ranks
        dup = seen.intersection(everyone) | ({r for r in everyone if everyone.count(r) > 1})
        if dup:
            raise PlanError(f"{where}: rank(s) {sorted(dup)} already used by another stage")
        seen.update(everyone)
        if p.mb_start != next_mb or p.mb_count < 0:
            raise PlanError(
                f"{where}: microbatch slice starts at {p.mb_start} with {p.mb_count} microbatches; "
                f"expected a slice starting at {next_mb} (slices are contiguous, in pipeline order)"
            )
        next_mb += p.mb_count
    if next_mb != plan.num_microbatches:
        raise PlanError(f"pipelines cover {next_mb} microbatches, the step has {plan.num_microbatches}")


def reduce_pieces(plan: ExecPlan, layer: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """How `layer`'s gradient is all-reduced across the pipelines: [(piece, pieces, members)].

    The layer's flat buffer is cut at the widest holding stage's shard boundaries (`pieces` of them;
    narrower stages' boundaries are a subset: shard.py); piece i is held, in each pipeline, by the
    stage rank whose shard contains it, and all-reduced among those ranks (sorted). Width 1
    everywhere: one piece, the holders."""
    stages = plan.holder_stages(layer)
    pieces = max(len(s) for s in stages)
    return [(i, pieces, tuple(sorted(s[i * len(s) // pieces] for s in stages))) for i in range(pieces)]


def reduce_groups(plan: ExecPlan) -> dict[tuple[int, ...], list[tuple[int, int, int]]]:
    """(layer, piece, pieces) by the set of ranks all-reducing them: one group per set. Sets of one
    rank (a layer held by a single pipeline) need no group and are left out."""
    groups: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
    for layer in range(plan.num_layers):
        for piece, pieces, members in reduce_pieces(plan, layer):
            if len(members) > 1:
                groups.setdefault(members, []).append((layer, piece, pieces))
    return groups


def layer_groups(plan: ExecPlan) -> dict[tuple[int, ...], list[int]]:
    """Layers by a set of ranks all-reducing (a piece of) them: `reduce_groups` by layer."""
    return {members: sorted({layer for layer, _, _ in entries}) for members, entries in reduce_groups(plan).items()}


def sample_range(b: int, width: int, index: int) -> tuple[int, int]:
    """The samples of a microbatch of `b` that rank `index` of a stage of `width` computes."""
    return index * b // width, (index + 1) * b // width


Slice = tuple[int, int, int]  # (microbatch of the pipeline's slice, first sample, end)


def pass_slices(b: int, width: int, index: int, mb_count: int) -> list[list[Slice]]:
    """For each pass of a stage over its pipeline's `mb_count` microbatches of `b` samples, what rank
    `index` of the stage's `width` computes. A pass is one microbatch where the width divides b (the
    rank's `sample_range` of it), else k = `stage_fold(b, width)` consecutive microbatches whose samples
    split evenly; the last pass may hold fewer, and then some ranks nothing (an empty list)."""
    k = stage_fold(b, width)
    out = []
    for first in range(0, mb_count, k):
        lo, hi = sample_range(min(k, mb_count - first) * b, width, index)
        out.append([(m, max(lo - (m - first) * b, 0), min(hi - (m - first) * b, b))
                    for m in range(first + lo // b, first + (hi + b - 1) // b) if lo < hi])
    return out


def edge_pieces(b: int, sender: tuple[int, ...], receiver: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """What crosses a pipeline edge for a microbatch of `b` samples from a stage on ranks `sender` to
    one on `receiver`: [(sender rank, receiver rank, first sample, end)] for every overlap of their
    sample ranges, in (sender, receiver) order. Equal widths: rank j to rank j, the whole slice."""
    out = []
    for j, a in enumerate(sender):
        lo_a, hi_a = sample_range(b, len(sender), j)
        for k, c in enumerate(receiver):
            lo_c, hi_c = sample_range(b, len(receiver), k)
            lo, hi = max(lo_a, lo_c), min(hi_a, hi_c)
            if lo < hi:
                out.append((a, c, lo, hi))
    return out
