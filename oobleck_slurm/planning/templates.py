"""Pipeline templates: for each node count, the exact best stage partition and device assignment.

Exact for the cost model in `cost` (T = sum_i w_i + (N_b - 1) max_i w_i, memory per device):

1. For a cap c on the stage time, a DP finds the partition with the least sum of stage times whose
   every stage has w_i <= c and fits in memory. The DP runs from the end of the pipeline: state
   (a, r) = "layers [a, L) on the last r devices". Whether a boundary is inter-node depends only on
   r (devices are numbered node by node and the pipeline has a whole number of nodes), and so does
   the in-flight count min(N_b, r); so one pass over r = 1 .. n_max * devices_per_node answers
   every node count n at once (read (0, n * devices_per_node)).
2. T* = min over c of [minsum(c) + (N_b - 1) * c], and c need only range over the stage times that
   occur (the bottleneck of the optimum is one of them). We walk the caps downwards: evaluating c
   gives a partition of sum s and bottleneck m <= c, and every cap in [m, c] has the same minsum,
   so the next cap worth trying is the largest candidate below m. We stop when even the least
   possible bottleneck (a min-max DP, one pass) cannot beat the best T with a sum >= s. Each
   evaluation serves every node count that is waiting for a cap it covers.
3. Each node count n has its own N_b (`microbatches_by_nodes`: what a pipeline of n nodes runs in the
   plan, pregenerate.py), used in step 2's objective only. The memory check (the DP's tables in
   step 1) counts one N_b for every n, the most a pipeline may run: so one DP pass still serves all n.

Why not the original's divide and conquer: it keeps one locally best sub-plan per sub-problem, but
T is not decomposable that way (whether a sub-plan's sum or its bottleneck matters depends on the
rest), which made it return plans up to 6% slower than the best. Here every candidate bottleneck is
considered, and for each the sum is minimised exactly, so the result is optimal; tests compare with
brute-force enumeration.

Device assignment: each stage runs on g consecutive devices of one node, every device of the pipeline
holding one stage. g is what the engine can run (`allowed_stage_devices`): a power of two dividing
devices_per_node and the microbatch size (a stage splits each microbatch's samples evenly), at most
`max_stage_devices` (`cluster.max_stage_devices`: by default the node's GPUs, 1 on CPU workers). A stage of g > 1 devices is sharded
inside the stage, kept or resharded (see `cost`). Whether a stage of g devices fits in the current
node, and its in-flight bound min(N_b, r - g + 1), depend only on r, so the DP stays exact over widths.

One more 1-node template is not in the DP's space: the whole node as the pipeline's only stage when
the node's devices do not divide the microbatch size (`folded_width`; the stage computes several
microbatches per pass, `cost.stage_fold`). It is evaluated alone and taken where it beats the DP's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from oobleck_slurm.errors import BadInputError
from oobleck_slurm.planning import cost
from oobleck_slurm.planning.profile import Profile

INF = math.inf


class PlanningError(BadInputError, ValueError):
    """A request the planner cannot satisfy; the message says what would fit."""


@dataclass(frozen=True)
class StageTemplate:
    start: int  # first layer
    stop: int  # one past the last layer
    first_device: int  # index within the pipeline; node = first_device // devices_per_node
    devices: int
    time_s: float  # w_i, per microbatch
    memory_bytes: float  # per device
    keep: bool = False  # devices > 1: parameters gathered once per step and kept (cost.choose_keep)
    once_s: float = 0.0  # once_i: what the stage adds once per step (a kept stage's gathers)

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class PipelineTemplate:
    """The best way found to run the whole model on `num_nodes` nodes."""

    num_nodes: int
    devices_per_node: int
    num_microbatches: int  # N_b the template was optimised for: what each of its pipelines runs in the plan
    stages: tuple[StageTemplate, ...]
    iteration_time_s: float  # T at num_microbatches
    profile_key: str = ""
    # N_b the memory check counted in flight (None: num_microbatches). May exceed num_microbatches:
    # memory is checked for the most a pipeline may run after failures, not for what it runs at first.
    memory_microbatches: int | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def sum_s(self) -> float:
        """What one microbatch's pass through every stage takes, with what stages add once per step."""
        return sum(s.time_s + s.once_s for s in self.stages)

    def latency(self, num_microbatches: int) -> float:
        """Iteration time for `num_microbatches` microbatches (linear in it under 1F1B)."""
        return self.sum_s + (num_microbatches - 1) * self.bottleneck_s

    @property
    def max_memory_bytes(self) -> float:
        return max(s.memory_bytes for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stages"] = [asdict(s) for s in self.stages]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineTemplate:
        stages = tuple(StageTemplate(**s) for s in data["stages"])
        return cls(**{**data, "stages": stages})


def allowed_stage_devices(devices_per_node: int, max_stage_devices: int = 1, microbatch_size: int = 0) -> list[int]:
    """Device counts a stage may have (module doc): the powers of two up to the bound that divide
    devices_per_node and, when given, the microbatch size."""
    return [g for g in range(1, min(devices_per_node, max_stage_devices) + 1)
            if g & (g - 1) == 0 and devices_per_node % g == 0 and (not microbatch_size or microbatch_size % g == 0)]


def folded_width(devices_per_node: int, max_stage_devices: int, microbatch_size: int) -> int | None:
    """The width of a 1-node template's only stage that folds microbatches (module doc): the node's
    devices, where `allowed_stage_devices` leaves them out only because they do not divide the
    microbatch size; else None."""
    d = devices_per_node
    if 1 < d <= max_stage_devices and d & (d - 1) == 0 and microbatch_size % d:
        return d
    return None


def fits_in_node(devices_per_node: int, devices_left: int, g: int) -> bool:
    """Whether a stage of g devices starting where `devices_left` devices of the pipeline remain stays
    inside one node (devices are numbered node by node; the pipeline has whole nodes)."""
    return g <= (devices_left % devices_per_node or devices_per_node)


def stage_in_flight(num_microbatches: int, devices_left: int, g: int) -> int:
    """The in-flight count the memory model charges a stage of g devices with `devices_left` devices
    from its first to the pipeline's end (cost module doc: an upper bound on S - i)."""
    return cost.in_flight(num_microbatches, devices_left - g + 1)


def template_from_stages(
    profile: Profile, num_nodes: int, stages: list[tuple[int, int, int, int]], num_microbatches: int,
    memory_microbatches: int | None = None,
) -> PipelineTemplate:
    """Build a template from (start, stop, first_device, devices) tuples with the scalar cost model:
    T at `num_microbatches`, memory with `memory_microbatches` (default: the same) in flight."""
    total = num_nodes * profile.devices_per_node
    k_nb = num_microbatches if memory_microbatches is None else memory_microbatches
    out = []
    for start, stop, first, g in stages:
        k = stage_in_flight(k_nb, total - first, g)
        keep = cost.choose_keep(profile, start, stop, g, k)
        out.append(StageTemplate(start, stop, first, g, cost.stage_time(profile, start, stop, g, first, keep),
                                 cost.stage_memory(profile, start, stop, g, k, keep), keep,
                                 cost.stage_once_time(profile, start, stop, g, keep)))
    times, once = [s.time_s for s in out], [s.once_s for s in out]
    return PipelineTemplate(
        num_nodes=num_nodes, devices_per_node=profile.devices_per_node, num_microbatches=num_microbatches,
        stages=tuple(out), iteration_time_s=cost.pipeline_time(times, num_microbatches, once), profile_key=profile.key,
        memory_microbatches=None if k_nb == num_microbatches else k_nb,
    )


class _Tables:
    """Stage costs for every (start layer a, stop layer b) as (L+1, L+1) arrays, per stage shape."""

    def __init__(self, profile: Profile, num_microbatches: int, max_stage_devices: int) -> None:
        L = profile.num_layers
        self.L, self.d, self.nb = L, profile.devices_per_node, num_microbatches
        self.gs = allowed_stage_devices(self.d, max_stage_devices, profile.microbatch_size)
        layers = profile.layers

        def prefix(values: list[float]) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])

        fb = prefix([x.forward_s + x.backward_s for x in layers])
        state = prefix([x.state_bytes for x in layers])
        act = prefix([x.activation_bytes for x in layers])

        def range_max(values: list[float]) -> np.ndarray:
            """[a, b] -> the largest of values[a..b-1] (for a < b)."""
            out = np.zeros((L + 1, L + 1))
            for a in range(L):
                out[a, a + 1:] = np.maximum.accumulate(np.asarray(values[a:], dtype=np.float64))
            return out

        ws = range_max([x.workspace_bytes for x in layers])
        span = lambda p: p[None, :] - p[:, None]  # noqa: E731  [a, b] -> sum over layers a..b-1
        valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)
        out = np.array([0.0] + [x.output_bytes for x in layers])  # out[a] = bytes entering layer a
        links = (profile.link("intra_node"), profile.link("inter_node"))
        links = (profile.link("intra_node"), profile.link("inter_node"))

        def boundaries(c: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
            """[kind][x]: both directions of a device's share c of the transfer at layer boundary x (0 at
            the ends), as the start and as the end boundary of a stage (out[b] is layer b-1's output)."""
            start = []
            for link in links:
                v = 2 * (link.latency_s + c * out / link.bandwidth_Bps)
                v[0] = 0.0
                start.append(v)
            return start, [np.concatenate([v[:L], [0.0]]) for v in start]

        budget = cost.usable_memory(profile)
        coll = profile.link("allreduce_intra")
        gathered = [cost.gathered_bytes(profile, x) for x in layers]
        grads = [float(x.grad_bytes) for x in layers]
        # A sharded stage's gather buffers (cost.stage_memory): resharded, two layers' gathered parameters
        # and one's gradient; kept, every layer's parameters and gradient.
        gather_mem = {False: 2 * range_max(gathered) + range_max(grads), True: span(prefix(gathered)) + span(prefix(grads))}
        # per (g, keep): stage times for each (start kind, end kind), and the most microbatches in flight
        self.w: dict[tuple[int, bool, int, int], np.ndarray] = {}
        self.kmax: dict[tuple[int, bool], np.ndarray] = {}
        self.once: dict[tuple[int, bool], np.ndarray] = {}  # once_i, per step (kept stages)
        # Memory (cost.stage_memory): the stage's output (out[b], none after the last layer) is held per
        # microbatch in flight; the boundary gradients (out[b] + out[a]) and one layer's workspace once.
        end_out = np.concatenate([out[:L], [0.0]])
        for g in self.gs:
            c = cost.work_fraction(profile, g)
            boundary, end_boundary = boundaries(c)
            for keep in ((False, True) if g > 1 else (False,)):
                static = span(state) / g + c * (end_out[None, :] + out[:, None] + ws)
                base = c * span(fb)
                self.once[g, keep] = np.zeros((L + 1, L + 1))
                if g > 1 and keep:  # cost.exposed_kept_time: once per step
                    hidden = prefix([max(0.0, cost.allgather_time(coll, v, g) - c * x.forward_s)
                                     for v, x in zip(gathered, layers)])
                    first = np.array([cost.allgather_time(coll, v, g) for v in gathered] + [0.0])
                    self.once[g, keep] = np.where(valid, span(hidden) + first[:, None], 0.0)
                    static = static + gather_mem[True]
                elif g > 1:  # cost.exposed_shard_time: per layer beyond its compute, plus the pass's ends
                    excess = prefix([max(0.0, cost.shard_comm_time(profile, x, g, coll) - c * (x.forward_s + x.backward_s))
                                     for x in layers])
                    gath = np.array([cost.allgather_time(coll, v, g) for v in gathered] + [0.0])
                    scat = np.array([cost.allgather_time(coll, x.grad_bytes, g) for x in layers] + [0.0])
                    last = np.concatenate([[0.0], gath[:L]])  # last[b] = the gather of layer b-1
                    base = base + span(excess) + (gath + scat)[:, None] + last[None, :]
                    static = static + gather_mem[False]
                for st in (0, 1):
                    for et in (0, 1):
                        w = base + boundary[st][:, None] + end_boundary[et][None, :]
                        self.w[g, keep, st, et] = np.where(valid, w, INF)
                per_mb = c * (span(act) + end_out[None, :])
                with np.errstate(divide="ignore", invalid="ignore"):
                    kmax = np.floor((budget - static) / per_mb)
                kmax = np.where(per_mb <= 0, np.where(static <= budget, INF, -1.0), kmax)
                self.kmax[g, keep] = np.where(valid & (static <= budget), kmax, -1.0)
        self._mem_cache: dict[tuple[int, int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def masked(self, g: int, st: int, et: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Stage times and once-per-step times of the mode each stage runs in with k microbatches in
        flight (cost.choose_keep: kept where it fits), inf where neither fits."""
        key = (g, st, et, k)
        tables = self._mem_cache.get(key)
        if tables is None:
            w = np.where(self.kmax[g, False] >= k, self.w[g, False, st, et], INF)
            once = self.once[g, False]
            if g > 1:
                kept = self.kmax[g, True] >= k
                w = np.where(kept, self.w[g, True, st, et], w)
                once = np.where(kept, self.once[g, True], once)
            tables = (w, once)
            self._mem_cache[key] = tables
        return tables

    def steps(self, r: int) -> list[tuple[int, int, int, int, int]]:
        """Transitions out of state (., r): (g, r - g, start kind, end kind, in-flight count)."""
        st = 1 if r % self.d == 0 else 0
        return [(g, r - g, st, 1 if (r - g) % self.d == 0 else 0, stage_in_flight(self.nb, r, g))
                for g in self.gs if fits_in_node(self.d, r, g)]

    def candidates(self) -> np.ndarray:
        vals = [t[np.isfinite(t)] for t in self.w.values()]
        return np.unique(np.concatenate(vals))


@dataclass
class _Pass:
    value: np.ndarray  # (R+1, L+1): least sum (or least max) of stage times for state (a, r)
    peak: np.ndarray  # (R+1, L+1): bottleneck of the chosen partition
    stop: np.ndarray  # chosen stop layer of the first stage
    devices: np.ndarray  # chosen device count of the first stage


def _run_pass(tab: _Tables, cap: float, r_max: int, minmax: bool = False) -> _Pass:
    L = tab.L
    value = np.full((r_max + 1, L + 1), INF)
    peak = np.full((r_max + 1, L + 1), INF)
    stop = np.zeros((r_max + 1, L + 1), dtype=np.int64)
    devs = np.zeros((r_max + 1, L + 1), dtype=np.int64)
    value[0, L] = 0.0
    peak[0, L] = 0.0 if not minmax else -INF
    if minmax:
        value[0, L] = -INF
    rows = np.arange(L + 1)
    capped: dict[tuple[int, int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    for r in range(1, r_max + 1):
        cur_v, cur_p = value[r], peak[r]
        for g, rem, st, et, k in tab.steps(r):
            key = (g, st, et, k)
            pair = capped.get(key)
            if pair is None:
                w, once = tab.masked(g, st, et, k)
                if cap < INF:
                    w = np.where(w <= cap, w, INF)
                pair = capped[key] = (w, once)
            w, once = pair
            nxt = value[rem]
            # the sum pass adds each stage's once-per-step time; the bottleneck (peak, cap) is w alone
            tmp = np.maximum(w, nxt[None, :]) if minmax else w + once + nxt[None, :]
            b = tmp.argmin(axis=1)
            v = tmp[rows, b]
            better = v < cur_v
            if better.any():
                cur_v[better] = v[better]
                cur_p[better] = np.maximum(w[rows, b], peak[rem, b])[better]
                stop[r, better] = b[better]
                devs[r, better] = g
    return _Pass(value, peak, stop, devs)


def _extract(tab: _Tables, res: _Pass, n: int) -> list[tuple[int, int, int, int]]:
    total = n * tab.d
    r, a, stages = total, 0, []
    while a < tab.L:
        b, g = int(res.stop[r, a]), int(res.devices[r, a])
        stages.append((a, b, total - r, g))
        a, r = b, r - g
    assert r == 0, "DP reconstruction left devices unassigned"
    return stages


def generate_templates(
    profile: Profile,
    max_nodes: int,
    min_nodes: int = 1,
    *,
    num_microbatches: int,
    microbatches_by_nodes: Mapping[int, int] | None = None,
    max_stage_devices: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[PipelineTemplate]:
    """The optimal template for every feasible node count in [min_nodes, max_nodes], smallest first.

    Memory is checked with `num_microbatches` in flight; the template of n nodes minimises T for
    `microbatches_by_nodes[n]` microbatches (default: `num_microbatches`), what its pipelines will run.
    Sizes that cannot hold the model (memory) or have more devices than stages can fill are left out;
    an empty list means none fits (see `explain_infeasible`).
    """
    if num_microbatches < 1:
        raise PlanningError(f"num_microbatches must be >= 1, got {num_microbatches}")
    by_nodes = dict(microbatches_by_nodes or {})
    if any(v < 1 for v in by_nodes.values()):
        raise PlanningError(f"microbatches per template must be >= 1, got {by_nodes}")
    if min_nodes < 1 or max_nodes < min_nodes:
        raise PlanningError(f"node range [{min_nodes}, {max_nodes}] is empty or starts below 1")
    tab = _Tables(profile, num_microbatches, max_stage_devices)
    d = tab.d

    def nb_of(n: int) -> int:
        return by_nodes.get(n, num_microbatches)
    # Every device holds >= 1 layer of a stage of <= max g devices: more devices cannot be filled.
    top = min(max_nodes, (tab.L * max(tab.gs)) // d)
    sizes = list(range(min_nodes, top + 1))
    if not sizes:
        return _with_folded(profile, {}, min_nodes, nb_of(1), num_microbatches, max_stage_devices)
    r_all = d * top
    cands = tab.candidates()
    least_peak = _run_pass(tab, INF, r_all, minmax=True).value[:, 0]
    free = _run_pass(tab, INF, r_all)  # unconstrained: the least possible sum
    best: dict[int, float] = {}
    chosen: dict[int, list[tuple[int, int, int, int]]] = {}
    pending: dict[int, float] = {}

    def absorb(res: _Pass, n: int) -> None:
        """Take the partition `res` gives for n; queue the next cap worth trying, or finish n."""
        # Only the objective depends on n's count: the DP's tables (memory) are shared by every n, and
        # the cap walk below is exact for any count (every cap in [m, c] has the same minsum).
        s, m, nb = res.value[n * d, 0], res.peak[n * d, 0], nb_of(n)
        t = s + (nb - 1) * m
        if t < best.get(n, INF):
            best[n], chosen[n] = t, _extract(tab, res, n)
        i = int(np.searchsorted(cands, m, side="left")) - 1
        floor = least_peak[n * d]
        if i < 0 or cands[i] < floor or s + (nb - 1) * floor >= best[n]:
            pending.pop(n, None)
            if progress:
                progress(len(sizes) - len(pending), len(sizes))
        else:
            pending[n] = float(cands[i])

    for n in sizes:
        if math.isfinite(free.value[n * d, 0]):
            absorb(free, n)
    while pending:
        cap = max(pending.values())
        res = _run_pass(tab, cap, d * max(pending))
        for n, want in list(pending.items()):
            if res.peak[n * d, 0] <= want:  # the partition for cap also is the one for `want`
                absorb(res, n)
    if progress:
        progress(len(sizes), len(sizes))
    out = {n: template_from_stages(profile, n, chosen[n], nb_of(n), num_microbatches) for n in sizes if n in chosen}
    return _with_folded(profile, out, min_nodes, nb_of(1), num_microbatches, max_stage_devices)


def _with_folded(profile: Profile, templates: dict[int, PipelineTemplate], min_nodes: int, nb: int,
                 num_microbatches: int, max_stage_devices: int) -> list[PipelineTemplate]:
    """`templates` by node count, with the 1-node template replaced by the folded one (module doc) where
    that is faster; smallest first."""
    g = folded_width(profile.devices_per_node, max_stage_devices, profile.microbatch_size)
    if g is not None and min_nodes == 1:
        folded = template_from_stages(profile, 1, [(0, profile.num_layers, 0, g)], nb, num_microbatches)
        # kept or not at all: a resharded stage's ranks must run every pass, and a partial one has none
        fits = folded.stages[0].keep and folded.stages[0].memory_bytes <= cost.usable_memory(profile)
        if fits and folded.iteration_time_s < (templates[1].iteration_time_s if 1 in templates else INF):
            templates[1] = folded
    return [templates[n] for n in sorted(templates)]


def explain_infeasible(profile: Profile, num_microbatches: int, max_stage_devices: int = 1) -> str:
    """Why no template fits, in words: the layer that does not fit alone, or the device-count limit."""
    budget = cost.usable_memory(profile)
    widest = max(allowed_stage_devices(profile.devices_per_node, max_stage_devices, profile.microbatch_size))
    for i, layer in enumerate(profile.layers):
        need = cost.stage_memory(profile, i, i + 1, widest, 1)
        if need > budget:
            return (
                f"layer {i} ({layer.name}) alone needs {_size(need)} per device with one microbatch "
                f"in flight, more than the usable {_size(budget)} of a {profile.device_name}"
            )
    per_node = profile.devices_per_node
    return (
        f"no partition of the {profile.num_layers} layers over whole nodes of {per_node} devices fits in "
        f"{_size(budget)} per device with up to {num_microbatches} microbatches in flight"
    )


def _size(nbytes: float) -> str:
    """Bytes in the unit that shows them (GiB for devices, MiB for a budget set in a recipe)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
