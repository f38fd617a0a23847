"""A model of what rebuilding a generation's NCCL communicators costs at scale (pure: no I/O).

`DEFAULT_CALIBRATION` comes from a tiny CPU job (4 gloo processes on one host, worker kills), so its
group rebuild (0.0134 s) and detection (0.041 s) say nothing about 2,048 GPU nodes. This module
replaces the rebuild with a model of what the engine does (engine/comm.py, `Generation`):

- every recovery and every join builds a new generation: EVERY communicator of the plan again (the
  world, each pipeline, each sharded stage, one per pipeline edge, one per set of pipelines that
  all-reduce a layer), each with `ncclCommInitRank` on its own unique id from the supervisor's store
  (no `ncclCommSplit`, which would reuse the parent's bootstrap and topology), connected eagerly and
  warmed up with one small and one 4 MiB all-reduce (so NCCL_RUNTIME_CONNECT's lazy connection does
  not help: the warm-up connects);
- the groups are built in one global order ("world" first, then by name), each member building one
  group at a time, and a group's construction waits for all its members.

One communicator of n ranks costs `fixed_s + per_rank_s * n`:
- `fixed_s`: what does not grow with n: topology detection and graph search, channel and proxy
  setup, the warm-up's connections to a bounded number of ring/tree peers;
- `per_rank_s * n`: what grows with n: the unique id fetched from one store by n ranks, NCCL's
  bootstrap (the root accepts every rank; an all-gather of every rank's peer and topology info over
  the bootstrap ring), the warm-up all-reduce's latency.

`build_seconds` runs the ordered build as a dependency schedule (a group starts when the last of its
members has finished its previous group) and returns its makespan. The values and their sources are in
`ASSUMPTIONS` and docs/simulator.md#at-scale; `benchmarks/bench_simulate.py --only scale` prints the
result beside its sensitivity to each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from oobleck_slurm.simulate.calibration import Calibration


@dataclass(frozen=True)
class CommCosts:
    """What one NCCL communicator of n ranks costs to create, connect and warm up: fixed_s + per_rank_s * n."""

    fixed_s: float = 0.14
    per_rank_s: float = 0.001

    def communicator_s(self, n: int) -> float:
        return self.fixed_s + self.per_rank_s * n


@dataclass(frozen=True)
class Assumption:
    name: str
    value: float
    unit: str
    source: str


# The central values of the scale calibration, each with where it comes from.
ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption("fixed_s", 0.14, "s per communicator",
               "our H200 measurement: make_group (ncclCommInitRank + eager connect) of 2 NCCL ranks, 0.10 / 0.14 s "
               "(docs/gpu-runs/h200-multi-rank-nccl-2.30.7.json, section e); one GPU, no NIC: a node of 8 GPUs "
               "and 8 NICs searches a larger topology, hence the sweep to 1 s"),
    Assumption("per_rank_s", 0.001, "s per rank of a communicator",
               "not measured here. Bracketed by published figures: stock NCCL init ~265 s at 96k GPUs "
               "(NCCLX, arXiv:2510.20171) = 2.8 ms/rank if linear; torchelastic rendezvous of 4,000 hosts "
               "in 10 s once linear (pytorch/pytorch#124982) = 2.5 ms/host; MegaScale (NSDI'24) brought a "
               "2,048-GPU job's whole init under 5 s; 1 ms is the middle, 0.1-3 ms the sweep"),
    Assumption("detection_s", 3.0, "s",
               "the heartbeat lease default (recipe fault_tolerance.heartbeat_lease): a machine that crashes "
               "sends nothing; 0.041 s (the tiny job's process kills) is the best case, where the kernel "
               "closes the dead processes' sockets"),
    Assumption("replan_s", 0.05, "s",
               "the real reconfigure at 1,024 nodes, ~0.02-0.05 s (bench_simulate.py --only speed)"),
    Assumption("relaunch_s", 60.0, "s",
               "checkpoint-restart's relaunch of every rank with its NCCL init: an assumed round minute, "
               "not measured (baselines.RELAUNCH_S); it builds the same communicators, so it is at least "
               "the modelled rebuild"),
)


def assumption(name: str) -> float:
    return next(a.value for a in ASSUMPTIONS if a.name == name)


DEFAULT_COMM_COSTS = CommCosts(assumption("fixed_s"), assumption("per_rank_s"))


def plan_group_map(plan: Any, devices_per_node: int) -> dict[str, tuple[int, ...]]:
    """Every NCCL group a generation of the planner's `plan` builds (engine/comm.py `plan_groups`), its
    nodes taken in plan order. Imports the engine (torch) when called, not when this module loads."""
    from oobleck_slurm.engine.comm import plan_groups
    from oobleck_slurm.engine.from_planner import exec_plan

    nodes = [n for p in plan.pipelines for n in p.nodes] + list(plan.spare_nodes)
    return plan_groups(exec_plan(plan, nodes, devices_per_node), len(nodes) * devices_per_node)


def build_order(groups: Mapping[str, Sequence[int]]) -> list[str]:
    """The order every rank builds its groups in (engine/comm.py `Generation`): the world, then by name."""
    return [n for n in ("world",) if n in groups] + sorted(n for n in groups if n != "world")


def build_seconds(groups: Mapping[str, Sequence[int]], costs: CommCosts = DEFAULT_COMM_COSTS) -> float:
    """Makespan of building `groups` (name -> member ranks) in `build_order`: each rank builds one group
    at a time, and a group starts once all its members are free."""
    free: dict[int, float] = {}
    end = 0.0
    for name in build_order(groups):
        members = groups[name]
        start = max((free.get(r, 0.0) for r in members), default=0.0)
        done = start + costs.communicator_s(len(members))
        for r in members:
            free[r] = done
        end = max(end, done)
    return end


@dataclass(frozen=True)
class GroupShape:
    """What the build depends on, for reporting: how many groups, per rank, and the largest."""

    groups: int
    per_rank_max: int
    per_rank_min: int
    largest: int
    sizes_of_busiest_rank: tuple[int, ...]


def group_shape(groups: Mapping[str, Sequence[int]]) -> GroupShape:
    per_rank: dict[int, list[int]] = {}
    for members in groups.values():
        for r in members:
            per_rank.setdefault(r, []).append(len(members))
    busiest = max(per_rank.values(), key=lambda v: (len(v), sum(v)), default=[])
    counts = [len(v) for v in per_rank.values()] or [0]
    return GroupShape(len(groups), max(counts), min(counts), max((len(m) for m in groups.values()), default=0),
                      tuple(sorted(busiest, reverse=True)))


def scale_calibration(base: Calibration, rebuild_s: float, *, detection_s: float | None = None,
                      replan_s: float | None = None, source: str = "") -> Calibration:
    """`base` with the modelled rebuild and the scale assumptions for detection and replanning."""
    return replace(base, rebuild_s=rebuild_s,
                   detection_s=assumption("detection_s") if detection_s is None else detection_s,
                   replan_s=assumption("replan_s") if replan_s is None else replan_s,
                   source=source or f"NCCL rebuild model ({rebuild_s:.2f} s), detection and replan at scale; "
                                    f"the rest from {base.source}")
