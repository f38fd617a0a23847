"""Instantiation: how many pipelines of each template for N nodes, and who gets which microbatches.

Objective. A pipeline of template t with nb microbatches takes latency_t(nb) = fill_t + nb * m_t
(m_t its bottleneck stage time, fill_t = sum of its stage times - m_t). If every pipeline could
take a fractional share, all would finish together at

    tau(x) = (B + sum_t x_t fill_t / m_t) / (sum_t x_t / m_t)          (x_t pipelines of template t)

We choose x minimising tau subject to sum_t x_t n_t <= N (spares allowed; == N with
use_all_nodes), sum_t x_t >= f + 1 and sum_t x_t <= B (every pipeline gets a microbatch). tau is a
ratio of two linear functions of x, so Dinkelbach's method solves it exactly: for a guess lambda,
minimise B + sum_t x_t (fill_t / m_t - lambda / m_t), a knapsack over node counts (a DP over
u = nodes used and the pipeline count, polynomial: O(N * |templates| * C)); repeat with lambda =
tau(new x) until no x beats lambda. The gradient all-reduce across pipelines is not part of the
choice (it hardly varies between plans: ring all-reduce moves ~2x the stage's gradients whatever the
number of pipelines); what of it the last microbatch's backward does not hide (`cost.exposed_sync`)
is added to the plan's predicted step time.

Batch distribution is then exact over the integers: nb_p >= 1, sum nb_p = B, minimising
max_p latency_p(nb_p) (water-filling from a lower bound, see `distribute_batch`).

Coverage guarantee: if templates exist for every size n0 .. 2 n0 - 1, every N' >= (f+1) n0 has a plan
with at least f+1 pipelines that uses all N' nodes: take q = floor(N'/n0) >= f+1 pipelines of n0
nodes and add the remainder N' - q n0 < n0 nodes to one of them (size <= 2 n0 - 1). With spares
allowed, (f+1) n0 nodes suffice whatever sizes exist.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from oobleck_slurm.planning import cost
from oobleck_slurm.planning.profile import Profile
from oobleck_slurm.planning.templates import PipelineTemplate, PlanningError

NodeId = int | str


@dataclass(frozen=True)
class PipelinePlan:
    template: PipelineTemplate
    nodes: tuple[NodeId, ...]  # stage i runs on nodes[template.stages[i].first_device // devices_per_node]
    microbatches: int
    first_microbatch: int  # this pipeline reads global microbatches [first, first + microbatches)

    @property
    def latency_s(self) -> float:
        return self.template.latency(self.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "template": self.template.to_dict(), "nodes": list(self.nodes),
            "microbatches": self.microbatches, "first_microbatch": self.first_microbatch,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelinePlan:
        return cls(
            PipelineTemplate.from_dict(data["template"]), tuple(data["nodes"]),
            int(data["microbatches"]), int(data["first_microbatch"]),
        )


@dataclass(frozen=True)
class Plan:
    pipelines: tuple[PipelinePlan, ...]
    spare_nodes: tuple[NodeId, ...]
    global_microbatches: int
    microbatch_size: int
    sync_time_s: float  # cross-pipeline gradient all-reduce beyond the slowest pipeline (0 without a profile)

    @property
    def num_pipelines(self) -> int:
        return len(self.pipelines)

    @property
    def pipeline_time_s(self) -> float:
        return max(p.latency_s for p in self.pipelines)

    @property
    def step_time_s(self) -> float:
        return self.pipeline_time_s + self.sync_time_s

    @property
    def samples_per_s(self) -> float:
        return self.global_microbatches * self.microbatch_size / self.step_time_s

    @property
    def nodes_used(self) -> int:
        return sum(len(p.nodes) for p in self.pipelines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipelines": [p.to_dict() for p in self.pipelines], "spare_nodes": list(self.spare_nodes),
            "global_microbatches": self.global_microbatches, "microbatch_size": self.microbatch_size,
            "sync_time_s": self.sync_time_s, "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            tuple(PipelinePlan.from_dict(p) for p in data["pipelines"]), tuple(data["spare_nodes"]),
            int(data["global_microbatches"]), int(data["microbatch_size"]), float(data["sync_time_s"]),
        )


def fluid_time(pipelines: Sequence[PipelineTemplate], global_microbatches: int) -> float:
    """tau: when all pipelines would finish if microbatches were divisible."""
    m = np.array([t.bottleneck_s for t in pipelines])
    fill = np.array([t.sum_s for t in pipelines]) - m
    return float((global_microbatches + (fill / m).sum()) / (1 / m).sum())


def distribute_batch(pipelines: Sequence[PipelineTemplate], global_microbatches: int,
                     slowdown: Sequence[float] | None = None) -> list[int]:
    """Integer microbatches per pipeline (each >= 1, sum = B) minimising the slowest latency.

    `slowdown[p]` (default 1) scales pipeline p's stage times: a pipeline on a slow node (a
    straggler, see `reconfigure.rebalance`) takes slowdown x its template's latency.

    Start every pipeline at the most microbatches it can take while finishing by a lower bound of
    the optimum (a fluid level whose shares sum to <= B), then hand out the rest one at a time to
    whichever pipeline would finish earliest with one more. Any pipeline the greedy step raises
    beyond the optimum would mean all pipelines were already at their optimum counts, which sum
    to >= B: so the result is optimal.
    """
    p, b = len(pipelines), global_microbatches
    if p == 0:
        raise PlanningError("distribute_batch: no pipelines")
    if b < p:
        raise PlanningError(f"{b} microbatches cannot give each of {p} pipelines at least one")
    m = np.array([t.bottleneck_s for t in pipelines])
    fill = np.array([t.sum_s for t in pipelines]) - m
    if slowdown is not None:
        m, fill = m * np.asarray(slowdown, dtype=float), fill * np.asarray(slowdown, dtype=float)

    def shares(level: float) -> np.ndarray:
        return np.maximum(1, np.floor((level - fill) / m))

    lo, hi = 0.0, float((fill + b * m).max())  # shares(hi) >= b
    for _ in range(100):  # bisection: the largest level whose shares still sum to <= b
        mid = (lo + hi) / 2
        if shares(mid).sum() <= b:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    counts = shares(lo).astype(np.int64)
    if counts.sum() > b:  # only when lo stayed 0 (all at the floor of 1, and p <= b)
        counts = np.ones(p, dtype=np.int64)
    heap = [(fill[i] + (counts[i] + 1) * m[i], i) for i in range(p)]
    heapq.heapify(heap)
    for _ in range(b - int(counts.sum())):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (fill[i] + (counts[i] + 1) * m[i], i))
    return [int(c) for c in counts]


def choose_counts(
    templates: Sequence[PipelineTemplate], nodes: int, min_pipelines: int, global_microbatches: int,
    use_all_nodes: bool = False,
) -> list[int]:
    """x_t per template minimising tau (see module docstring); PlanningError if none is feasible."""
    sizes = np.array([t.num_nodes for t in templates], dtype=np.int64)
    m = np.array([t.bottleneck_s for t in templates])
    rate = 1.0 / m
    fill_rate = (np.array([t.sum_s for t in templates]) - m) * rate
    b = global_microbatches
    n_min = int(sizes.min())
    if min_pipelines > b:
        raise PlanningError(
            f"{min_pipelines} pipelines need at least {min_pipelines} microbatches per step, the batch has {b}"
        )
    # Count dimension: saturate at min_pipelines when the batch cannot limit the count, else exact up to B.
    exact = b < nodes // n_min
    top = b if exact else min_pipelines

    def solve(lam: float) -> tuple[float, list[int]] | None:
        item = fill_rate - lam * rate
        dp = np.full((nodes + 1, top + 1), math.inf)
        dp[0, 0] = 0.0
        pick = np.full((nodes + 1, top + 1), -1, dtype=np.int64)  # template of the last pipeline added
        stay = np.zeros((nodes + 1, top + 1), dtype=bool)  # saturated: predecessor count was top too
        cols = np.arange(top)
        for u in range(n_min, nodes + 1):
            idx = np.nonzero(sizes <= u)[0]
            prev = dp[u - sizes[idx]] + item[idx, None]  # (T, top+1): one more pipeline of template t
            t_best = prev[:, :top].argmin(axis=0)
            dp[u, 1:] = prev[t_best, cols]
            pick[u, 1:] = idx[t_best]
            if not exact:  # counts beyond top are recorded as top
                t_sat = int(prev[:, top].argmin())
                if prev[t_sat, top] < dp[u, top]:
                    dp[u, top], pick[u, top], stay[u, top] = prev[t_sat, top], idx[t_sat], True
        ends = dp[:, min_pipelines:]  # counts >= min_pipelines
        if use_all_nodes:
            u_best, c_best = nodes, int(ends[nodes].argmin())
        else:
            u_best, c_best = divmod(int(ends.argmin()), ends.shape[1])  # ties: fewest nodes (keep spares)
        c_best += min_pipelines
        if not math.isfinite(dp[u_best, c_best]):
            return None
        counts = [0] * len(templates)
        u, c = u_best, c_best
        while u > 0:
            t = int(pick[u, c])
            counts[t] += 1
            u, c = u - int(sizes[t]), (c if stay[u, c] else c - 1)
        return b + float(dp[u_best, c_best]), counts

    def tau(counts: list[int]) -> float:
        return (b + float(np.dot(counts, fill_rate))) / float(np.dot(counts, rate))

    first = solve(0.0)
    if first is None:
        raise PlanningError(
            f"no combination of {min_pipelines}+ pipelines of sizes {sorted(set(sizes.tolist()))} "
            f"fits in {nodes} nodes{' exactly' if use_all_nodes else ''}"
        )
    counts = first[1]
    lam = tau(counts)
    for _ in range(100):  # Dinkelbach: converges in a few rounds
        value, new_counts = solve(lam)  # type: ignore[misc]
        if value >= -1e-12 * max(1.0, b):
            break
        counts, lam = new_counts, tau(new_counts)
    return counts


def instantiate(
    templates: Sequence[PipelineTemplate],
    nodes: int | Sequence[NodeId],
    f: int,
    global_microbatches: int,
    *,
    microbatch_size: int = 1,
    profile: Profile | None = None,
    use_all_nodes: bool = False,
) -> Plan:
    """The best plan for these nodes that survives f failures (>= f+1 pipelines), with the batch split.

    `nodes` is a count (nodes are then 0..N-1) or the node ids; pipelines take consecutive nodes,
    largest templates first, spares last. With `profile`, the predicted step time includes the
    cross-pipeline gradient all-reduce's exposed part.
    """
    ids = tuple(range(nodes)) if isinstance(nodes, int) else tuple(nodes)
    n = len(ids)
    if not templates:
        raise PlanningError("no pipeline templates: the model fits on no node count that was generated")
    if f < 0:
        raise PlanningError(f"failures to tolerate must be >= 0, got {f}")
    n0 = min(t.num_nodes for t in templates)
    if (f + 1) * n0 > n:
        most_f = n // n0 - 1
        fit = f"at most f={most_f} with {n} nodes" if most_f >= 0 else f"no f: one pipeline needs {n0} nodes"
        raise PlanningError(
            f"surviving f={f} failures needs {f + 1} pipelines of at least {n0} nodes = {(f + 1) * n0} nodes, "
            f"but there are {n}; {fit}"
        )
    if global_microbatches < f + 1:
        raise PlanningError(
            f"the batch has {global_microbatches} microbatches; {f + 1} pipelines need at least {f + 1}"
        )
    counts = choose_counts(templates, n, f + 1, global_microbatches, use_all_nodes=use_all_nodes)
    chosen = sorted(
        (t for t, c in zip(templates, counts) for _ in range(c)), key=lambda t: (-t.num_nodes, t.bottleneck_s)
    )
    shares = distribute_batch(chosen, global_microbatches)
    pipelines, node_pos, mb_pos = [], 0, 0
    for t, nb in zip(chosen, shares):
        pipelines.append(PipelinePlan(t, ids[node_pos:node_pos + t.num_nodes], nb, mb_pos))
        node_pos += t.num_nodes
        mb_pos += nb
    sync = 0.0 if profile is None else exposed_sync_time(profile, pipelines)
    return Plan(tuple(pipelines), ids[node_pos:], global_microbatches, microbatch_size, sync)


def exposed_sync_time(profile: Profile, pipelines: Sequence[PipelinePlan]) -> float:
    """The cross-pipeline gradient all-reduce that the last microbatch's backward leaves exposed
    (`cost.exposed_sync`), for these pipelines with their microbatch counts."""
    distinct = {(p.template, p.microbatches) for p in pipelines}
    shapes = [([(s.start, s.stop, s.first_device, s.devices) for s in t.stages], t.latency(nb)) for t, nb in distinct]
    return cost.exposed_sync(profile, shapes, len(pipelines))
