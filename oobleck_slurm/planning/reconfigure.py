"""Reconfiguration: from the current plan and a membership change to a new plan and the state copies.

Pure: no processes, no I/O. The coordinator calls `reconfigure` when nodes are lost or join; the
workers execute the returned `transfers` (parameters and optimizer state of whole layers).

Rules, applied in this order to the pipelines of the current plan (the Oobleck paper, SOSP 2023, §4.2;
cheapest fix first, so that most losses copy few layers):
- unchanged: a pipeline that lost no node keeps its template and nodes;
- simple:    a pipeline with k surviving nodes takes the template for k nodes, on its survivors;
- borrow:    a pipeline whose survivors have no template (k < n0) first takes free nodes (spares,
             joined nodes), else borrows nodes from the largest pipeline that can spare them (the
             donor then runs the template of its smaller size);
- merge:     undersized pipelines that could borrow nothing are merged (their survivors pooled);
             nodes that still fit no template become spares (they keep their state and can send it);
- join:      free nodes (joined, spares) form new pipelines or grow existing ones, one move at a
             time, as long as a move lowers the predicted step time;
- replan:    `instantiate` on all live nodes from scratch; taken instead of the local fix when its
             predicted step time is lower by more than `reoptimize_margin`.
The batch is then redistributed (`distribute_batch`) so that the samples of a step do not change.
`rebalance` does only that, for the same pipelines with some slowed (a straggler's: detection/health.py).
Speed (1,024 nodes, ~1,000 pipelines: ~20 ms a call instead of 10-100 s), with exactly the same
results (tests/simulate/test_reconfigure_equivalence.py holds the old algorithm): the join rule scores
its moves from the number of pipelines of each template shape (`_predicted_shapes`, `_join`), not
by re-splitting the batch over every pipeline; the replan is memoised on node positions (`_replan`);
`plan_copies` picks each copy's sender from a heap per layer instead of scanning ~1,000 holders.

Transfers: for every (device, layer) of the new plan whose device does not already hold the layer,
one surviving holder sends it. Holders are chosen greedily by the bytes they already send, so the
copies spread over all surviving replicas in parallel instead of queueing behind one sender.

Recovery is impossible, and `RecoveryImpossible` says why, when some layer has no surviving holder,
or when no plan with at least f + 1 pipelines fits the live nodes.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from oobleck_slurm.errors import UnrecoverableError
from oobleck_slurm.planning.instantiate import NodeId, PipelinePlan, Plan, distribute_batch, instantiate
from oobleck_slurm.planning.templates import PipelineTemplate, PlanningError

Device = tuple[NodeId, int]  # (node, device index within the node): one worker, one stage


class RecoveryImpossible(UnrecoverableError, PlanningError):
    """No plan can continue from the survivors' in-memory state; `kind` says which rule failed:
    "no_replica" (`layers` lost every copy) or "too_few_pipelines"."""

    def __init__(self, kind: str, message: str, layers: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.layers = tuple(layers)


@dataclass(frozen=True)
class LayerTransfer:
    layer: int
    src: Device
    dst: Device
    bytes: int  # parameters + optimizer state (1 per layer when no sizes were given)


@dataclass(frozen=True)
class Reconfiguration:
    plan: Plan
    transfers: tuple[LayerTransfer, ...]
    rules: tuple[str, ...]  # which rules produced the plan, e.g. ("simple", "borrow") or ("replan",)
    predicted_step_s: float  # slowest pipeline's latency for its share of the batch

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.transfers)

    def senders(self) -> dict[Device, int]:
        """Bytes each source sends: how the copy load is spread."""
        out: dict[Device, int] = {}
        for t in self.transfers:
            out[t.src] = out.get(t.src, 0) + t.bytes
        return out


def _stage_layout(t: PipelineTemplate) -> list[tuple[int, int, range]]:
    """(node position in the pipeline, device index within the node, layers) of each stage of `t`."""
    dpn = t.devices_per_node
    return [(s.first_device // dpn, s.first_device % dpn, range(s.start, s.stop)) for s in t.stages]


def stage_devices(pipeline: PipelinePlan) -> list[tuple[Device, range]]:
    """Each stage's device and its layers, in stage order (stages of > 1 device: their first)."""
    nodes = pipeline.nodes
    return [((nodes[i], d), layers) for i, d, layers in _stage_layout(pipeline.template)]


def _layouts(plan: Plan) -> dict[int, list[tuple[int, int, frozenset[int]]]]:
    """`_stage_layout` of each template of `plan` (by id), layers as sets: computed once per template,
    not once per pipeline (1,000 pipelines share a handful of templates)."""
    return {id(t): [(i, d, frozenset(layers)) for i, d, layers in _stage_layout(t)]
            for t in {id(p.template): p.template for p in plan.pipelines}.values()}


def plan_holders(plan: Plan) -> dict[Device, frozenset[int]]:
    """Which layers each device of `plan` holds."""
    layouts = _layouts(plan)
    return {(p.nodes[i], d): layers for p in plan.pipelines for i, d, layers in layouts[id(p.template)]}


def _best_by_size(templates: Sequence[PipelineTemplate]) -> dict[int, PipelineTemplate]:
    best: dict[int, PipelineTemplate] = {}
    for t in templates:
        if t.num_nodes not in best or t.iteration_time_s < best[t.num_nodes].iteration_time_s:
            best[t.num_nodes] = t
    return best


def _predicted(templates: Sequence[PipelineTemplate], batch: int) -> float:
    """The slowest pipeline's latency with the batch split as `distribute_batch` splits it."""
    if not templates or len(templates) > batch:
        return float("inf")
    counts = distribute_batch(templates, batch)
    return max(t.latency(c) for t, c in zip(templates, counts))


# Scoring by shape. `_predicted` depends on a pipeline only through its template's (sum_s, bottleneck_s):
# its "shape". A plan of ~1,000 pipelines has a handful of shapes, so a plan is scored from its shape
# counts in O(shapes) instead of O(pipelines), and a candidate move of the join rule (one pipeline
# changes shape, or one is added) is one shape count up and one down: the join rule no longer rescans
# every pipeline for every candidate (at 1,024 nodes that took seconds per reconfiguration).

Shape = tuple[float, float]  # (sum_s, bottleneck_s): all `_predicted` reads of a template


def _shape(t: PipelineTemplate) -> Shape:
    return (t.sum_s, t.bottleneck_s)


def _predicted_shapes(counts: dict[Shape, int], batch: int) -> float | None:
    """`_predicted` of a plan given as {shape: number of pipelines}: the same float, in O(shapes).

    It replays `distribute_batch` with identical pipelines grouped: the bisection computes exactly the
    same levels (the share sums are sums of integers), and the greedy hand-out gives one microbatch to
    every pipeline of a shape in turn, since they all wait at the same key. The one thing grouping
    cannot replay is the heap's tie-break by pipeline position: when the last microbatches go to
    pipelines of different shapes tied on the same key, and those pipelines' latencies differ as
    floats (a rounding coincidence), the answer depends on the order; then this returns None and the
    caller scores the explicit list with `_predicted`.
    """
    items = [(s, m, c) for (s, m), c in counts.items() if c > 0]
    p = sum(c for _, _, c in items)
    if p == 0 or p > batch:
        return float("inf")
    fill = [s - m for s, m, _ in items]

    def total(level: float) -> int:  # sum over pipelines of max(1, floor((level - fill) / m))
        return sum(c * max(1, math.floor((level - f) / m)) for f, (_, m, c) in zip(fill, items))

    lo, hi = 0.0, max(f + batch * m for f, (_, m, _) in zip(fill, items))
    for _ in range(100):  # the same bisection as distribute_batch, on the same floats
        mid = (lo + hi) / 2
        if total(mid) <= batch:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    base = [max(1, math.floor((lo - f) / m)) for f, (_, m, _) in zip(fill, items)]
    if sum(c * b for b, (_, _, c) in zip(base, items)) > batch:
        base = [1] * len(items)
    low = [c for _, _, c in items]  # pipelines of each shape still at `base` (the others are at base + 1)
    left = batch - sum(c * b for b, (_, _, c) in zip(base, items))
    heap = [(f + (b + 1) * m, g) for g, (f, b, (_, m, _)) in enumerate(zip(fill, base, items))]
    heapq.heapify(heap)
    while left > 0:
        key = heap[0][0]
        tied = []
        while heap and heap[0][0] == key:
            tied.append(heapq.heappop(heap)[1])
        waiting = sum(low[g] for g in tied)
        if left < waiting:  # the hand-out ends inside this tie: who gets the last ones matters only
            if len({items[g][0] + base[g] * items[g][1] for g in tied}) > 1:  # if their latencies differ
                return None
            for g in tied:
                give = min(left, low[g])
                low[g] -= give
                left -= give
            break
        left -= waiting
        for g in tied:  # every pipeline of the shape moves up one microbatch
            f, m = fill[g], items[g][1]
            base[g] += 1
            low[g] = items[g][2]
            nxt = f + (base[g] + 1) * m
            if not nxt > key:  # no progress in floats: the heap's order by position would decide
                return None
            heapq.heappush(heap, (nxt, g))
    # latency(c) = sum_s + (c - 1) * bottleneck_s, as PipelineTemplate.latency computes it
    return max(s + (b if low[g] < c else b - 1) * m for g, (b, (s, m, c)) in enumerate(zip(base, items)))


def _shape_counts(templates: Sequence[PipelineTemplate]) -> dict[Shape, int]:
    """{shape: pipelines}; a template's shape is computed once (sum_s, bottleneck_s scan its stages)."""
    counts: dict[Shape, int] = {}
    seen: dict[int, Shape] = {}
    for t in templates:
        sh = seen.get(id(t)) or seen.setdefault(id(t), _shape(t))
        counts[sh] = counts.get(sh, 0) + 1
    return counts


def _predicted_fast(templates: Sequence[PipelineTemplate], batch: int) -> float:
    """`_predicted`, scored by shape when it can be (see `_predicted_shapes`)."""
    out = _predicted_shapes(_shape_counts(templates), batch)
    return _predicted(templates, batch) if out is None else out


def _local_fix(current: Plan, lost: set[NodeId], free: list[NodeId], by_size: dict[int, PipelineTemplate],
               batch: int) -> tuple[list[tuple[PipelineTemplate, list[NodeId]]], list[NodeId], list[str]]:
    """Apply unchanged/simple/borrow/merge/join to the current pipelines; returns (pipelines, spares, rules)."""
    rules: list[str] = []
    groups: list[list[NodeId]] = []
    kept: list[PipelineTemplate | None] = []  # the current template when the pipeline lost nothing
    for p in current.pipelines:
        alive = [n for n in p.nodes if n not in lost]
        if not alive:
            continue
        groups.append(alive)
        kept.append(p.template if len(alive) == len(p.nodes) else None)
        if len(alive) < len(p.nodes) and len(alive) in by_size:
            rules.append("simple")
    free = list(free)

    def fits(i: int) -> bool:
        return len(groups[i]) in by_size

    # borrow: undersized pipelines take free nodes first, then nodes of the largest possible donor.
    for i in range(len(groups)):
        if fits(i):
            continue
        k = len(groups[i])
        for size in sorted(s for s in by_size if s > k):
            need = size - k
            if need <= len(free):
                groups[i] += free[:need]
                free = free[need:]
                kept[i] = None
                rules.append("borrow")
                break
            donors = [j for j in range(len(groups)) if j != i and fits(j) and len(groups[j]) - need in by_size]
            if donors:
                j = max(donors, key=lambda j: (len(groups[j]), -j))
                groups[i] += groups[j][-need:]
                groups[j] = groups[j][:-need]
                kept[i] = kept[j] = None
                rules.append("borrow")
                break
    # merge: pool what is still undersized, cut it into the largest templates that fit.
    small = [i for i in range(len(groups)) if not fits(i)]
    if small:
        small_set = set(small)
        pool = [n for i in small for n in groups[i]]
        groups = [g for i, g in enumerate(groups) if i not in small_set]
        kept = [t for i, t in enumerate(kept) if i not in small_set]
        merged = 0
        while pool:
            size = max((s for s in by_size if s <= len(pool)), default=0)
            if size == 0:
                break
            groups.append(pool[:size])
            kept.append(None)
            pool = pool[size:]
            merged += 1
        if merged:
            rules.append("merge")
        free = pool + free  # survivors first: they hold state and may serve as spares for later moves
    pipelines = [(kept[i] or by_size[len(g)], g) for i, g in enumerate(groups)]
    pipelines, free, joined = _join(pipelines, free, by_size, batch)
    if joined:
        rules.append("join")
    return pipelines, free, rules


def _join(pipelines: list[tuple[PipelineTemplate, list[NodeId]]], free: list[NodeId],
          by_size: dict[int, PipelineTemplate], batch: int,
          ) -> tuple[list[tuple[PipelineTemplate, list[NodeId]]], list[NodeId], bool]:
    """The join rule: spend free nodes on whichever move lowers the predicted step time most.

    A move is a new pipeline of `size` free nodes, scored (time, -1, size), or pipeline i grown by
    `extra` free nodes to the template of its new size, scored (time, i, extra); the smallest score
    wins, and moves go on while the best one makes the step faster than `base`, the current time.

    Scoring every move over the whole pipeline list cost O(pipelines) per move and O(pipelines x
    sizes) moves per round: seconds per reconfiguration at 1,024 nodes. Instead each move is scored
    from the shape counts with one count changed (`_predicted_shapes`, O(shapes)), memoised since the
    same counts come back across moves and rounds; and pipelines of one shape and one node count have
    the same grow moves at the same times, so only the first of them, whose score is the smallest, is
    scored. When `_predicted_shapes` cannot decide (a float tie that only pipeline order breaks),
    every move concerned is scored on its explicit list by `_predicted`, exactly as before.
    Returns (pipelines, spares, whether a move was made).
    """
    shape: dict[int, Shape] = {id(t): _shape(t) for t in by_size.values()}
    memo: dict[tuple[tuple[Shape, int], ...], float | None] = {}
    pipelines = list(pipelines)

    def by_shape(counts: dict[Shape, int], out: Shape | None, into: Shape) -> float | None:
        new = dict(counts)
        if out is not None:
            new[out] -= 1
        new[into] = new.get(into, 0) + 1
        key = tuple(sorted(new.items()))
        if key not in memo:
            memo[key] = _predicted_shapes(new, batch)
        return memo[key]

    moved = False
    while free:
        templates = [t for t, _ in pipelines]
        counts: dict[Shape, int] = {}
        group: dict[tuple[Shape, int], list[int]] = {}  # (shape, nodes) -> its pipelines, in order
        for i, (t, nodes) in enumerate(pipelines):
            sh = shape.get(id(t)) or shape.setdefault(id(t), _shape(t))
            counts[sh] = counts.get(sh, 0) + 1
            group.setdefault((sh, len(nodes)), []).append(i)
        base = _predicted_shapes(counts, batch)
        if base is None:
            base = _predicted(templates, batch)
        best: tuple[float, int, int] | None = None  # (time, pipeline index or -1 for new, nodes)
        for size, t_new in by_size.items():
            if size <= len(free):
                time = by_shape(counts, None, shape[id(t_new)])
                if time is None:
                    time = _predicted(templates + [t_new], batch)
                best = min(best or (float("inf"), 0, 0), (time, -1, size))
        for (sh, n), members in group.items():
            for size, t_new in by_size.items():
                extra = size - n
                if 0 < extra <= len(free):
                    time = by_shape(counts, sh, shape[id(t_new)])
                    if time is not None:
                        best = min(best or (float("inf"), 0, 0), (time, members[0], extra))
                        continue
                    for i in members:  # undecided by shape: the old way, pipeline by pipeline
                        cand = templates[:i] + [t_new] + templates[i + 1:]
                        best = min(best or (float("inf"), 0, 0), (_predicted(cand, batch), i, extra))
        if best is None or (pipelines and not best[0] < base * (1 - 1e-9)):
            break  # no move makes the step faster: keep the rest as spares
        _, i, k = best
        if i < 0:
            pipelines.append((by_size[k], free[:k]))
        else:
            nodes = pipelines[i][1] + free[:k]
            pipelines[i] = (by_size[len(nodes)], nodes)
        free = free[k:]
        moved = True
    return pipelines, free, moved


def _assemble(pipelines: list[tuple[PipelineTemplate, list[NodeId]]], spares: Iterable[NodeId],
              current: Plan, slowdown: Sequence[float] | None = None) -> Plan:
    shares = distribute_batch([t for t, _ in pipelines], current.global_microbatches, slowdown)
    out, first = [], 0
    for (t, nodes), nb in zip(pipelines, shares):
        out.append(PipelinePlan(t, tuple(nodes), nb, first))
        first += nb
    return Plan(tuple(out), tuple(spares), current.global_microbatches, current.microbatch_size,
                current.sync_time_s)



# ---- stragglers: the same pipelines, the batch redistributed ---------------------------------------

def pipeline_slowdowns(plan: Plan, node_slowdown: Mapping[NodeId, float]) -> dict[int, float]:
    """Each pipeline's slowdown (index -> factor) from its nodes' (a straggler's compute time over its
    peers'): its slowest node's, since every stage waits for the slowest in 1F1B (conservative when the
    slow node holds a stage with slack). Pipelines with no slow node are left out (factor 1)."""
    out = {}
    for i, p in enumerate(plan.pipelines):
        factor = max((float(node_slowdown[n]) for n in p.nodes if n in node_slowdown), default=1.0)
        if factor != 1.0:
            out[i] = factor
    return out


def rebalance(plan: Plan, slowdown: Mapping[int, float]) -> Plan:
    """`plan` with the same pipelines on the same nodes and the global batch redistributed for
    pipelines that run `slowdown[i]` times slower than their template (a straggler's pipeline): the
    exact integer split minimising the slowest pipeline (`distribute_batch`), so a slow pipeline gets
    fewer microbatches. The global batch and its order are kept (pipeline i still reads the
    contiguous slice after pipeline i-1's), so every step trains on the same samples with the same
    weights: the trajectory does not change, only the time a step takes. The split depends on the
    templates and `slowdown` alone, not on the current split, so applying the same slowdowns twice
    changes nothing (and `{}` gives back the plain split)."""
    bad = {i: f for i, f in slowdown.items() if not (isinstance(i, int) and 0 <= i < len(plan.pipelines))}
    if bad:
        raise PlanningError(f"rebalance: no pipeline {sorted(map(str, bad))} in a plan of {len(plan.pipelines)}")
    bad = {i: f for i, f in slowdown.items() if not (math.isfinite(f) and f > 0)}
    if bad:
        raise PlanningError(f"rebalance: slowdowns must be finite and > 0, got {bad}")
    factors = [float(slowdown.get(i, 1.0)) for i in range(len(plan.pipelines))]
    return _assemble([(p.template, list(p.nodes)) for p in plan.pipelines], plan.spare_nodes, plan, factors)


def plan_copies(plan: Plan, holders: dict[Device, frozenset[int]],
                layer_bytes: Sequence[int] | None = None) -> tuple[LayerTransfer, ...]:
    """The copies that give every device of `plan` the layers of its stage, spread over the holders.

    Largest layers are placed first, each on the holder that sends the fewest bytes so far (ties:
    the first holder in device order), so no single replica carries the whole recovery.

    At 1,024 nodes most stages already hold their layers and a layer has ~1,000 holders, so: a stage
    is checked with one set inclusion, holders are listed only for the layers some device needs, and
    the least loaded holder (load, then device order) is kept at the top of a heap per layer instead
    of scanning every holder for every copy. Loads only grow (layer sizes are >= 0), so an entry whose
    load is out of date is re-pushed when it comes to the top (a negative size, meaningless, takes
    the scan).
    """
    layouts = _layouts(plan)
    needed = []
    for p in plan.pipelines:
        for i, d, layers in layouts[id(p.template)]:
            dev = (p.nodes[i], d)
            have = holders.get(dev, ())
            if not layers.issubset(have):
                needed += [(layer, dev) for layer in sorted(layers) if layer not in have]
    if not needed:
        return ()
    size = (lambda layer: int(layer_bytes[layer])) if layer_bytes is not None else (lambda layer: 1)
    want = {layer for layer, _ in needed}
    by_layer: dict[int, list[tuple[int, int, Device]]] = {}  # layer -> [(load, position, holder)]
    for pos, dev in enumerate(sorted(holders, key=repr)):
        for layer in want.intersection(holders[dev]):
            by_layer.setdefault(layer, []).append((0, pos, dev))
    scan = any(size(layer) < 0 for layer in want)
    load: dict[Device, int] = {}
    out = []
    for layer, dev in sorted(needed, key=lambda x: (-size(x[0]), x[0], repr(x[1]))):
        heap = by_layer.get(layer)
        if not heap:
            raise RecoveryImpossible("no_replica", f"layer {layer} has no surviving holder to copy it from",
                                     [layer])
        if scan:
            src = min((h[2] for h in heap), key=lambda s: load.get(s, 0))  # heap: in device order
        else:
            while heap[0][0] != load.get(heap[0][2], 0):  # out of date: the holder sent since
                heapq.heapreplace(heap, (load.get(heap[0][2], 0), heap[0][1], heap[0][2]))
            src = heap[0][2]
        load[src] = load.get(src, 0) + size(layer)
        if not scan:
            heapq.heapreplace(heap, (load[src], heap[0][1], src))
        out.append(LayerTransfer(layer, src, dev, size(layer)))
    return tuple(sorted(out, key=lambda t: (t.layer, repr(t.dst))))


@functools.lru_cache(maxsize=64)
def _replan(templates: tuple[PipelineTemplate, ...], n: int, f: int, batch: int,
            ) -> tuple[float, tuple[tuple[int, tuple[int, ...]], ...], tuple[int, ...]] | None:
    """The replan candidate on n live nodes: (predicted time, pipelines as (template position in
    `templates`, node positions 0..n-1), spare positions), or None when `instantiate` finds no plan.

    `instantiate` depends on the node ids only through their positions (pipelines take consecutive
    nodes, spares last), so its plan on positions, renamed by live[position], is its plan on the live
    nodes; templates are returned by position too, so that the caller gets its own template objects
    (callers key on them), not equal ones from an earlier call. Memoised: a run at 1,024 nodes
    reconfigures again and again with the same number of live nodes, and the DP of `instantiate`
    (~50 ms there) was most of a reconfiguration once the join rule was fast; most of the time the
    local fix is kept and the replan is only compared.
    """
    try:
        plan = instantiate(list(templates), n, f, batch)
    except PlanningError:
        return None
    position = {id(t): i for i, t in reversed(list(enumerate(templates)))}
    # Planned on a count, the nodes are the positions 0..n-1 (ints; NodeId also allows names).
    pipelines = tuple((position[id(p.template)], tuple(int(x) for x in p.nodes)) for p in plan.pipelines)
    spares = tuple(int(x) for x in plan.spare_nodes)
    return _predicted_fast([p.template for p in plan.pipelines], batch), pipelines, spares


def reconfigure(
    current: Plan,
    lost: Iterable[NodeId],
    joined: Iterable[NodeId],
    templates: Sequence[PipelineTemplate],
    f: int,
    *,
    holders: dict[Device, frozenset[int]] | None = None,
    layer_bytes: Sequence[int] | None = None,
    reoptimize_margin: float = 0.05,
) -> Reconfiguration:
    """The plan after losing `lost` and adding `joined`, and the layer copies that realise it.

    `holders` (default: the current plan's stages) says which device holds a valid copy of which
    layer, e.g. after a recovery that was itself interrupted. `layer_bytes[l]` (parameters +
    optimizer state) balances the copies; without it every layer counts 1.
    Raises RecoveryImpossible when the survivors cannot continue (the message says which layers or
    how many pipelines), PlanningError on inconsistent input.
    """
    lost, joined = set(lost), list(dict.fromkeys(joined))
    members = [n for p in current.pipelines for n in p.nodes] + list(current.spare_nodes)
    unknown = lost - set(members)
    if unknown:
        raise PlanningError(f"lost node(s) {sorted(map(str, unknown))} are not in the current plan")
    again = set(joined) & (set(members) - lost)
    if again:
        raise PlanningError(f"joining node(s) {sorted(map(str, again))} are already members")
    if not templates:
        raise PlanningError("no pipeline templates to reconfigure with")
    if f < 0:
        raise PlanningError(f"failures to tolerate must be >= 0, got {f}")
    by_size = _best_by_size(templates)
    num_layers = current.pipelines[0].template.stages[-1].stop
    if holders is None:
        holders = plan_holders(current)
    holders = {d: frozenset(ls) for d, ls in holders.items() if d[0] not in lost}
    held = set().union(*holders.values()) if holders else set()
    missing = [layer for layer in range(num_layers) if layer not in held]
    if missing:
        raise RecoveryImpossible(
            "no_replica",
            f"layer(s) {missing} lost every replica (nodes lost: {sorted(map(str, lost))}); "
            f"their parameters and optimizer state exist only in a checkpoint", missing)
    batch = current.global_microbatches
    free = [n for n in current.spare_nodes if n not in lost] + joined
    live = [n for p in current.pipelines for n in p.nodes if n not in lost] + free
    candidates: list[tuple[float, tuple[str, ...], list, list]] = []
    pipelines, spares, rules = _local_fix(current, lost, free, by_size, batch)
    if len(pipelines) >= f + 1:
        candidates.append((_predicted_fast([t for t, _ in pipelines], batch), tuple(rules) or ("unchanged",),
                           pipelines, spares))
    listed = tuple(templates)
    fresh = _replan(listed, len(live), f, batch)
    if fresh is not None:
        t_replan, positions, spare_positions = fresh
        if not candidates or t_replan < candidates[0][0] * (1 - reoptimize_margin):
            replan = [(listed[t], [live[i] for i in nodes]) for t, nodes in positions]
            candidates.insert(0, (t_replan, ("replan",), replan, [live[i] for i in spare_positions]))
    if not candidates:
        n0 = min(by_size)
        raise RecoveryImpossible(
            "too_few_pipelines",
            f"{len(live)} live node(s) cannot form the {f + 1} pipelines that f={f} requires "
            f"(smallest template: {n0} node(s); at most {len(live) // n0} pipeline(s))")
    predicted, rules_t, chosen, spare_nodes = candidates[0]
    plan = _assemble(chosen, spare_nodes, current)
    return Reconfiguration(plan, plan_copies(plan, holders, layer_bytes), rules_t, predicted)
