"""Minder-style faulty-machine detection from monitoring metrics (pure: no clock, no I/O).

The machines of one training job run the same work in lock step, so their metrics move together:
compute and communication phases, step boundaries, checkpoints, even a recovery where every machine
idles. A faulty machine's metrics drift away from its peers' (often for a while before the job
halts). Following Minder's principles, per sample:

1. **Machine-level similarity.** For each metric, every node's value is compared with the median of
   all nodes at the same instant, in units of the nodes' spread (a robust z-score: median absolute
   deviation, with floors so that a moment when all nodes happen to agree cannot inflate it: the
   metric's usual spread, in its units and relative to its level, and `rel_floor`). Whatever
   the whole job does at once (a rhythm, a dip) moves the median too and scores nothing. A node
   whose value lies between the median's previous and current values is lagging, not deviating:
   pipeline stages run the job's phases a fraction of a second apart, so at a phase edge a later
   stage reads what its peers read a moment ago.
2. **Per-metric denoising.** The z-scores are clipped and their median over a short window taken,
   once the window is three quarters full: one or two wild readings count for nothing, and so do
   the opposite deviations a lagging node still shows at the two edges of a phase, while a lasting
   deviation keeps its full size. Each node also keeps a slow
   average of its own lasting offset from its peers (up to `offset_cap`), so a node that always runs
   a little warmer or holds a little more memory is its own normal, while a fault still stands out.
3. **Metric prioritisation.** Each metric's score is weighted (`priorities`; 0 switches one off);
   a node's score is its worst metric's, so a fault seen in a single metric counts fully, and the
   metrics behind a flag are reported most deviant first.
4. **Continuity.** A node is flagged once its score has been over `threshold` for `continuity`
   seconds in a row (by default one sample: the window's median already asks for a deviation that
   holds for most of the window). Slow-onset faults are caught once they cross the threshold;
   intermittent ones when they are on for most of a window.

A node is not judged during its first `grace` seconds (a replacement loading its layers behaves
unlike its peers for a moment), nor while fewer than `min_nodes` nodes report.

**Roles.** Heterogeneous pipelines break the premise that machines behave alike: a node that holds
twice the layers holds about twice the memory, and a stage of a 2-stage pipeline computes longer
than one of a 3-stage pipeline, by far more than `offset_cap`. `relearn()` (the runtime calls it for
every new plan) makes nodes learn their role's level: during their next `grace` seconds, when they
are not judged, each metric's ratio to the peers' median is averaged, and from then on the node's
values are divided by it before they are compared (a metric whose ratio lies outside
[1/MAX_ROLE_RATIO, MAX_ROLE_RATIO] is not compared for that node: no scaling makes it alike). A
fault already there when a plan starts is learnt as that node's level; one that starts or grows
later (a leak, a hog, a throttled clock) is measured from it. Nodes never relearnt keep ratio 1.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

_MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution is 0.6745 sigma
_ABS_FLOOR = 1e-6
MAX_ROLE_RATIO = 20.0  # a role's level further than this from its peers' is not compared


@dataclass(frozen=True)
class DetectorConfig:
    """The detector's knobs; times in seconds (converted to samples with `interval`)."""

    interval: float = 1.0  # time between samples
    window: float = 5.0  # denoising window: z-scores are averaged over it
    continuity: float = 1.0  # how long a node's score must stay over the threshold
    threshold: float = 4.5  # robust z-score (in units of the nodes' spread) that counts as deviating
    clip: float = 12.0  # a single reading's z-score is clipped to +-clip before averaging
    # The spread is at least this fraction of the metric's median: a deviation of under ~2% x
    # threshold of a metric's level is no machine fault, however alike the nodes happen to be.
    rel_floor: float = 0.02
    grace: float = 10.0  # a node that just appeared is not judged for this long
    baseline: float = 120.0  # time constant of each node's own average offset from its peers
    offset_cap: float = 3.0  # the largest lasting offset (in z) accepted as a node's normal
    min_nodes: int = 4
    priorities: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        problems = [name for name, ok in (
            ("interval > 0", self.interval > 0), ("window >= interval", self.window >= self.interval),
            ("continuity >= interval", self.continuity >= self.interval), ("threshold > 0", self.threshold > 0),
            ("clip >= threshold", self.clip >= self.threshold), ("grace >= 0", self.grace >= 0),
            ("baseline >= 0", self.baseline >= 0), ("offset_cap >= 0", self.offset_cap >= 0), ("rel_floor >= 0", self.rel_floor >= 0),
            ("min_nodes >= 3", self.min_nodes >= 3),
            ("priorities >= 0", all(w >= 0 for w in self.priorities.values()))) if not ok]
        if problems:
            raise ValueError("bad detector config: need " + ", ".join(problems))

    @classmethod
    def from_recipe(cls, section: object) -> DetectorConfig:
        """The detector's knobs from a recipe's `detection:` section (recipe.schema.DetectionConfig)."""
        return cls(**{name: getattr(section, name) for name in
                      ("interval", "window", "continuity", "threshold", "grace", "min_nodes", "priorities")})

    @property
    def window_samples(self) -> int:
        return max(1, round(self.window / self.interval))

    @property
    def continuity_samples(self) -> int:
        return max(1, round(self.continuity / self.interval))

    def weight(self, metric: str) -> float:
        """A metric's priority: by full name (`gpu0.temp_c`), then its kind (`temp_c`), then its
        group (`gpu0`); 1 when not named."""
        p = self.priorities
        for key in (metric, metric.rsplit(".", 1)[-1], metric.split(".", 1)[0]):
            if key in p:
                return float(p[key])
        return 1.0


@dataclass(frozen=True)
class Flag:
    """A node judged faulty: when (`time`), since when it deviated (`since`), and on which metrics."""

    node: Hashable
    time: float
    since: float
    metrics: tuple[str, ...]  # most deviant first
    score: float  # the node's score when flagged (robust z, weighted)


class MinderDetector:
    """Feed one sample per interval with `observe(t, {node: {metric: value}})`; it returns the nodes
    newly judged faulty. `scores()` gives every node's current score (for a dashboard)."""

    def __init__(self, config: DetectorConfig | None = None, **overrides: object) -> None:
        base = config or DetectorConfig()
        self.config = DetectorConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **overrides})
        self._nodes: dict[Hashable, int] = {}  # node -> slot
        self._relearn_first: set[Hashable] = set()  # nodes to relearn, named before their first sample
        self._free: list[int] = []
        self._metrics: dict[str, int] = {}
        self._weights = np.zeros(0)
        cap = 8
        w = self.config.window_samples
        self._z = np.full((w, cap, 0), np.nan)  # ring of clipped z-scores: window x slot x metric
        self._pos = 0
        self._base = np.zeros((cap, 0))  # each node's own lasting offset (z)
        self._spread = np.full(0, np.nan)  # slow average of each metric's spread across nodes
        self._rel_spread = np.full(0, np.nan)  # the same relative to the metric's level (median)
        self._prev_median = np.full(0, np.nan)  # each metric's median across nodes at the previous sample
        self._streak = np.zeros(cap, dtype=int)
        self._since = np.zeros(cap)
        self._first_seen = np.zeros(cap)  # when the node's current learning started (or will start)
        self._relearn = np.zeros(cap, dtype=bool)  # learn the role afresh once judgement resumes
        self._role = np.zeros(cap, dtype=bool)  # its role's level is learnt during its grace
        self._ratio_sum = np.zeros((cap, 0))  # the role's level: sum and count of value / peers' median
        self._ratio_n = np.zeros((cap, 0))
        self._age = np.zeros(cap)  # samples seen per slot
        self._flagged = np.zeros(cap, dtype=bool)
        self._score = np.zeros(cap)
        self._metric_score = np.zeros((cap, 0))
        self._present = np.zeros(cap, dtype=bool)
        self._hold_until = -np.inf
        self.flags: list[Flag] = []  # every flag so far, in order

    # ---- bookkeeping ------------------------------------------------------------------------------

    def _slot(self, node: Hashable, t: float) -> int:
        slot = self._nodes.get(node)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._nodes)
            if slot >= self._streak.shape[0]:
                self._grow_nodes(2 * self._streak.shape[0])
        self._nodes[node] = slot
        self._reset_slot(slot)
        self._first_seen[slot] = t
        if node in self._relearn_first:
            self._relearn_first.discard(node)
            self._relearn[slot] = True
        return slot

    def _grow_nodes(self, cap: int) -> None:
        def grow(a: np.ndarray, axis: int, fill: float) -> np.ndarray:
            shape = list(a.shape)
            shape[axis] = cap - a.shape[axis]
            return np.concatenate([a, np.full(shape, fill, dtype=a.dtype)], axis=axis)

        self._z = grow(self._z, 1, np.nan)
        self._base, self._metric_score = grow(self._base, 0, 0.0), grow(self._metric_score, 0, 0.0)
        self._streak, self._since = grow(self._streak, 0, 0), grow(self._since, 0, 0.0)
        self._first_seen, self._score = grow(self._first_seen, 0, 0.0), grow(self._score, 0, 0.0)
        self._relearn, self._role = grow(self._relearn, 0, False), grow(self._role, 0, False)
        self._ratio_sum, self._ratio_n = grow(self._ratio_sum, 0, 0.0), grow(self._ratio_n, 0, 0.0)
        self._age = grow(self._age, 0, 0.0)
        self._flagged, self._present = grow(self._flagged, 0, False), grow(self._present, 0, False)

    def _metric(self, name: str) -> int:
        idx = self._metrics.get(name)
        if idx is None:
            idx = self._metrics[name] = len(self._metrics)
            self._z = np.concatenate([self._z, np.full((*self._z.shape[:2], 1), np.nan)], axis=2)
            self._base = np.concatenate([self._base, np.zeros((self._base.shape[0], 1))], axis=1)
            self._ratio_sum = np.concatenate([self._ratio_sum, np.zeros((self._base.shape[0], 1))], axis=1)
            self._ratio_n = np.concatenate([self._ratio_n, np.zeros((self._base.shape[0], 1))], axis=1)
            self._metric_score = np.concatenate([self._metric_score, np.zeros((self._base.shape[0], 1))], axis=1)
            self._spread = np.append(self._spread, np.nan)
            self._rel_spread = np.append(self._rel_spread, np.nan)
            self._prev_median = np.append(self._prev_median, np.nan)
            self._weights = np.append(self._weights, self.config.weight(name))
        return idx

    def _reset_slot(self, slot: int) -> None:
        self._z[:, slot, :] = np.nan
        self._base[slot] = 0.0
        self._metric_score[slot] = 0.0
        self._relearn[slot] = self._role[slot] = False
        self._ratio_sum[slot] = self._ratio_n[slot] = 0.0
        self._streak[slot], self._score[slot], self._age[slot] = 0, 0.0, 0.0
        self._flagged[slot] = self._present[slot] = False

    def forget(self, node: Hashable) -> None:
        """Drop a node (evicted, or left the job): its history no longer counts; its slot is reused."""
        slot = self._nodes.pop(node, None)
        if slot is not None:
            self._reset_slot(slot)
            self._free.append(slot)

    def relearn(self, nodes: Sequence[Hashable] | None = None) -> None:
        """Nodes (default: every known one) whose work changed, e.g. under a new plan: they learn their
        role's level afresh once judgement resumes (after any `hold`), and are not judged meanwhile.
        A node named before its first sample learns its role from its first sample on."""
        for node in list(self._nodes) if nodes is None else nodes:
            slot = self._nodes.get(node)
            if slot is None:
                self._relearn_first.add(node)
            else:
                self._relearn[slot] = True

    def _role_levels(self) -> np.ndarray:
        """Each node's level per metric relative to its peers (1: never learnt; NaN: not comparable)."""
        level = np.where(self._ratio_n > 0, self._ratio_sum / np.maximum(self._ratio_n, 1), 1.0)
        return np.where((level >= 1 / MAX_ROLE_RATIO) & (level <= MAX_ROLE_RATIO), level, np.nan)

    def hold(self, until: float) -> None:
        """Judge no node before time `until` (samples are still taken in). For the runtime to call
        during a recovery, when some nodes copy state and others wait: uneven, but not a fault."""
        self._hold_until = max(self._hold_until, until)
        self._streak[:] = 0

    # ---- observing --------------------------------------------------------------------------------

    def observe(self, t: float, sample: Mapping[Hashable, Mapping[str, float]]) -> list[Flag]:
        """One sample of every reporting node; returns the nodes flagged at this sample (usually none).

        A node missing from the sample, or a metric missing for a node, is simply not compared this
        time. Non-finite values count as missing.
        """
        slots = [self._slot(node, t) for node in sample]
        per_node = [(slot, [(self._metric(m), v) for m, v in metrics.items()]) for slot, metrics in zip(slots, sample.values())]
        values = np.full((self._streak.shape[0], len(self._metrics)), np.nan)
        for slot, pairs in per_node:
            if pairs:
                idx, vals = zip(*pairs)
                values[slot, list(idx)] = np.asarray(vals, dtype=float)
        return self._step(t, values, np.asarray(slots, dtype=int))

    def observe_array(self, t: float, nodes: Sequence[Hashable], metrics: Sequence[str], values: np.ndarray) -> list[Flag]:
        """The same as `observe` for a dense `values[node, metric]` array (NaN = missing): no dicts."""
        slots = np.asarray([self._slot(node, t) for node in nodes], dtype=int)
        cols = np.asarray([self._metric(m) for m in metrics], dtype=int)
        full = np.full((self._streak.shape[0], len(self._metrics)), np.nan)
        full[np.ix_(slots, cols)] = values
        return self._step(t, full, slots)

    def _step(self, t: float, x: np.ndarray, slots: np.ndarray) -> list[Flag]:
        cfg = self.config
        present = np.zeros(x.shape[0], dtype=bool)
        present[slots] = True
        self._present = present
        x = np.where(present[:, None] & np.isfinite(x), x, np.nan)
        restart = self._relearn & present
        if restart.any():  # a role is learnt once judgement resumes; until then the node is not judged
            self._first_seen[restart] = max(t, self._hold_until)
            self._age[restart] = 0.0
            self._base[restart] = self._ratio_sum[restart] = self._ratio_n[restart] = 0.0
            self._role[restart] = True
            self._relearn[restart & (t >= self._hold_until)] = False
        raw, x = x, x / self._role_levels()
        counts = np.sum(~np.isnan(x), axis=0)
        usable = counts >= max(3, cfg.min_nodes)  # a median of fewer nodes says nothing
        z = np.full_like(x, np.nan)
        if usable.any():
            xu = x[:, usable]
            med = np.nanmedian(xu, axis=0)
            spread = _MAD_TO_SIGMA * np.nanmedian(np.abs(xu - med), axis=0)
            # The spread's slow average stands in when the nodes agree unusually well for a moment
            # (which, with a handful of nodes, is no rare luck: three of five agreeing closely make
            # the MAD tiny). It is kept twice: in the metric's units, and relative to its level, for
            # a metric whose level jumps while its spread scales with it (a checkpoint's disk writes:
            # ~5 MB/s with +-1 between checkpoints, ~800 +-10% during one; the spread in units learnt
            # between checkpoints would say nothing about the nodes' spread during one).
            alpha = 1.0 / max(1.0, cfg.baseline / cfg.interval)
            slow = self._spread[usable]
            self._spread[usable] = np.where(np.isnan(slow), spread, slow + alpha * (spread - slow))
            level = np.abs(med)
            has_level = level > _ABS_FLOOR
            rel = np.minimum(spread / np.where(has_level, level, 1.0), 1.0)  # capped: a median near 0 says little
            slow_rel = self._rel_spread[usable]
            self._rel_spread[usable] = np.where(~has_level, slow_rel,
                                                np.where(np.isnan(slow_rel), rel, slow_rel + alpha * (rel - slow_rel)))
            scale = np.maximum.reduce([spread, 0.5 * self._spread[usable],
                                       0.5 * np.nan_to_num(self._rel_spread[usable]) * level,
                                       cfg.rel_floor * level, np.full_like(med, _ABS_FLOOR)])
            # A node that reads what its peers read a moment ago is lagging, not deviating: the
            # stages of a pipeline run the job's phases a fraction of a second apart, so at a phase
            # edge a later stage's one-second average lies between its peers' previous and current
            # ones. Deviations are measured from that range, not from the current median alone.
            prev = self._prev_median[usable]
            prev = np.where(np.isnan(prev), med, prev)
            low, high = np.minimum(prev, med), np.maximum(prev, med)
            dev = np.where(xu > high, xu - high, np.where(xu < low, xu - low, 0.0))
            z[:, usable] = np.clip(dev / scale, -cfg.clip, cfg.clip)
            # Nodes learning their role: each metric's ratio to the peers' median, averaged.
            learning = self._role & present & (t >= self._first_seen) & (t - self._first_seen < cfg.grace)
            if learning.any():
                ratio = raw[np.ix_(learning, np.flatnonzero(usable))] / np.where(has_level & (med > 0), med, np.nan)
                seen = np.isfinite(ratio)
                self._ratio_sum[np.ix_(learning, np.flatnonzero(usable))] += np.where(seen, ratio, 0.0)
                self._ratio_n[np.ix_(learning, np.flatnonzero(usable))] += seen
        previous = np.full(x.shape[1], np.nan)
        if usable.any():
            previous[usable] = med
        self._prev_median = previous
        self._z[self._pos] = z
        self._pos = (self._pos + 1) % self._z.shape[0]

        # Denoise: the median of the window's clipped z-scores, where at least three quarters of the
        # window have a value. A deviation counts once it holds for most of the window: one or two
        # glitches count for nothing (even next to a phase edge), and so do the opposite deviations a
        # lagging stage still shows at both edges of a phase (the range above takes most of them),
        # while a lasting deviation keeps its full size and an intermittent one that is on more often
        # than off still shows. A window that is mostly empty is no median: after the metric could
        # not be compared for a while (fewer than `min_nodes` reporting, until a replacement joins),
        # two readings would make one phase edge count as half the evidence.
        smooth = self._denoise()
        dev = smooth - self._base
        if cfg.baseline > 0:
            # A running mean while the node is young (its offset is learnt within seconds, not
            # minutes), then a moving average over `baseline`; capped, so a fault never becomes normal.
            self._age += present & (t >= self._first_seen)
            beta = np.maximum(1.0 / np.maximum(self._age, 1), 1.0 / max(1.0, cfg.baseline / cfg.interval))[:, None]
            target = np.clip(smooth, -cfg.offset_cap, cfg.offset_cap)
            self._base = np.where(np.isnan(smooth), self._base, self._base + beta * (target - self._base))
        metric_score = np.nan_to_num(np.abs(dev) * self._weights[None, :], nan=0.0)
        metric_score[~present] = 0.0
        score = metric_score.max(axis=1) if metric_score.shape[1] else np.zeros(x.shape[0])
        # What scores() shows: 0 for a node not judged now (in its grace, learning its role, or held),
        # so that a dashboard never shows an alarming score that cannot lead to a flag.
        quiet = (t - self._first_seen < cfg.grace) | (t < self._hold_until)
        self._metric_score = np.where(quiet[:, None], 0.0, metric_score)
        self._score = np.where(quiet, 0.0, score)

        judged = (present & (t - self._first_seen >= cfg.grace) & ~self._flagged
                  & (len(slots) >= cfg.min_nodes) & (t >= self._hold_until))
        hit = judged & (score >= cfg.threshold)
        starting = hit & (self._streak == 0)
        self._since = np.where(starting, t, self._since)
        self._streak = np.where(hit, self._streak + 1, 0)
        new = np.flatnonzero(self._streak >= cfg.continuity_samples)
        if not len(new):
            return []
        names = list(self._metrics)
        slot_node = {slot: node for node, slot in self._nodes.items()}
        flags = []
        for slot in new:
            order = np.argsort(-metric_score[slot])
            behind = tuple(names[i] for i in order if metric_score[slot, i] >= cfg.threshold)
            flags.append(Flag(slot_node[int(slot)], float(t), float(self._since[slot]), behind, float(score[slot])))
            self._flagged[slot] = True
            self._streak[slot] = 0
        self.flags.extend(flags)
        return flags

    def _denoise(self) -> np.ndarray:
        """Each node's and metric's median over the window of its clipped z-scores (NaN: too few)."""
        w = self._z.shape[0]
        valid = np.sum(~np.isnan(self._z), axis=0)
        enough = valid >= max(1, min(w, 3), -(-3 * w // 4))
        with warnings.catch_warnings():  # all-NaN slices (a node or metric with no value yet) are expected
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.where(enough, np.nanmedian(self._z, axis=0), np.nan)

    # ---- for dashboards ---------------------------------------------------------------------------

    def scores(self) -> dict[Hashable, float]:
        """Every known node's score at the last sample (weighted robust z of its worst metric; 0 while
        the node is not judged)."""
        return {node: float(self._score[slot]) for node, slot in self._nodes.items()}

    def metric_scores(self, node: Hashable) -> dict[str, float]:
        """One node's score per metric at the last sample."""
        slot = self._nodes[node]
        return {m: float(self._metric_score[slot, i]) for m, i in self._metrics.items()}

    def is_flagged(self, node: Hashable) -> bool:
        slot = self._nodes.get(node)
        return slot is not None and bool(self._flagged[slot])


def detect(trace: Sequence[tuple[float, Mapping[Any, Mapping[str, float]]]],
           config: DetectorConfig | None = None) -> list[Flag]:
    """Run a detector over a whole recorded trace `[(t, sample)]`; every flag, in time order."""
    detector = MinderDetector(config)
    for t, sample in trace:
        detector.observe(t, sample)
    return detector.flags

