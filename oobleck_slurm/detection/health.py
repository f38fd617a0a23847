"""What to do about a faulty machine or a straggler: the recipe's `detection.evict` and
`detection.stragglers` turned into decisions (pure: no clock, no I/O; the supervisor acts on them).

    Evict(node, cause, detail, evidence)      lose the node like a dead one (and replace it)
    Report(node, cause, detail, evidence)     record it, change nothing (`evict: false`, the default;
                                              `stragglers: report`)
    Rebalance(slowdown, detail)               give slow nodes' pipelines fewer microbatches: `slowdown`
                                              maps every node to rebalance for to its factor (a node not
                                              named runs at full speed, so `{}` gives the plain split back)

A machine flagged from its metrics (`minder.Flag`) is only reported (`evict: false`, the default: the
detector has never judged real machine counters), or evicted with `evict: true`.
A straggler (`straggler.Straggler`, per node: its slowest rank) is, by `stragglers:`, rebalanced
(default), evicted, reported, or not watched (`off`). A node counts as a straggler once its slowdown
(over the whole window) has been over `threshold` for `confirm` judgements in a row: on a busy
machine a window's median crosses the threshold for a moment now and then. Rebalancing has
hysteresis: a node enters then, with its recent slowdown as its factor (the newest half of the
window: how slow it is now), and leaves once under `release` (halfway back to 1) for `confirm`
judgements in a row. Meanwhile its factor only grows (when it is confirmed slower by more than
`REBALANCE_CHANGE`), never shrinks: with fewer microbatches a slow node waits more for its peers,
and a stall that falls into a wait (a throttled or time-shared machine) no longer shows in its
compute time, so it looks faster than it is; shrinking its factor on that evidence gave it its
microbatches back, and the plan flapped every few seconds (measured on the `slow` drill). A new
decision is made only when the set of slow nodes changes or a factor grows, and again after every
new generation (a later plan, after a failure or a join, splits the batch afresh: the coordinator
ignores a decision that does not change its plan, since `planning.reconfigure.rebalance` depends on
the factors alone).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from oobleck_slurm.detection.minder import Flag
from oobleck_slurm.detection.straggler import Straggler

FAULTY_METRICS = "faulty_metrics"  # the loss causes, as supervisor.membership.LossCause spells them
STRAGGLER = "straggler"
STRAGGLER_MODES = ("rebalance", "evict", "report", "off")
K = TypeVar("K")
V = TypeVar("V")
REBALANCE_CHANGE = 1.5  # a slow node's factor must grow by more than this ratio for a new decision


def _frozen(mapping: Mapping[K, V]) -> Mapping[K, V]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Evict:
    node: Hashable
    cause: str  # FAULTY_METRICS or STRAGGLER
    detail: str
    evidence: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))  # JSON values: for the event


@dataclass(frozen=True)
class Report:
    node: Hashable
    cause: str
    detail: str
    evidence: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))


@dataclass(frozen=True)
class Rebalance:
    slowdown: Mapping[Hashable, float]  # node -> compute time over its peers'; absent nodes: full speed
    detail: str


Decision = Evict | Report | Rebalance


def flag_evidence(flag: Flag) -> dict[str, Any]:
    return {"metrics": list(flag.metrics), "score": round(flag.score, 3), "since": flag.since}


def flag_detail(flag: Flag, threshold: float) -> str:
    metrics = ", ".join(flag.metrics) or "its metrics"
    return f"{metrics} far from the peers' (score {flag.score:.1f}, threshold {threshold:g})"


def straggler_evidence(s: Straggler) -> dict[str, Any]:
    return {"rank": s.rank, "slowdown": round(s.slowdown, 3), "median_s": s.median_s, "peers_median_s": s.peers_median_s}


def straggler_detail(s: Straggler) -> str:
    return (f"rank {s.rank} computes {s.slowdown:.2f}x its peers' time ({1e3 * s.median_s:.1f} ms vs "
            f"{1e3 * s.peers_median_s:.1f} ms per microbatch)")


class HealthPolicy:
    """Decisions for flagged machines and stragglers; remembers what it decided, per node."""

    def __init__(self, evict: bool = False, stragglers: str = "rebalance", threshold: float = 1.3,
                 confirm: int = 1) -> None:
        """`confirm`: how many judgements in a row (steps) a node's slowdown must be over `threshold`
        before anything is decided for it."""
        if stragglers not in STRAGGLER_MODES:
            raise ValueError(f"stragglers must be one of {', '.join(STRAGGLER_MODES)}, got {stragglers!r}")
        if not threshold > 1:
            raise ValueError(f"threshold must be > 1, got {threshold}")
        if confirm < 1:
            raise ValueError(f"confirm must be >= 1, got {confirm}")
        self.evict, self.mode, self.threshold, self.confirm = evict, stragglers, threshold, confirm
        self._over: dict[Hashable, int] = {}  # judgements in a row over the threshold, per node
        self._under: dict[Hashable, int] = {}  # judgements in a row under the release, per node
        self.release = 1 + (threshold - 1) / 2
        self.applied: dict[Hashable, float] = {}  # rebalance: the factors last decided
        self._applied_generation: int | None = None
        self._acted: set[Hashable] = set()  # evict/report: nodes already decided on (until they recover)

    def flagged(self, flag: Flag, threshold: float) -> Evict | Report:
        """A machine the metrics detector flagged (`threshold`: the detector's, for the message)."""
        kind = Evict if self.evict else Report
        return kind(flag.node, FAULTY_METRICS, flag_detail(flag, threshold), _frozen(flag_evidence(flag)))

    def stragglers(self, by_node: Mapping[Hashable, Straggler], generation: int) -> list[Decision]:
        """Decisions from each judged node's slowdown (its slowest rank's; nodes not judged yet, e.g.
        early in a generation, are left out and keep what was decided for them)."""
        if self.mode == "off":
            return []
        for node, s in by_node.items():
            self._over[node] = self._over.get(node, 0) + 1 if s.slowdown >= self.threshold else 0
            self._under[node] = self._under.get(node, 0) + 1 if s.slowdown < self.release else 0
        if self.mode == "rebalance":
            return self._rebalance(by_node, generation)
        out: list[Decision] = []
        for node, s in sorted(by_node.items(), key=lambda kv: str(kv[0])):
            if s.slowdown < self.release:
                self._acted.discard(node)  # recovered: a later slowdown is news again
            elif self._confirmed(node) and node not in self._acted:
                self._acted.add(node)
                kind = Evict if self.mode == "evict" else Report
                out.append(kind(node, STRAGGLER, straggler_detail(s), _frozen(straggler_evidence(s))))
        return out

    def _rebalance(self, by_node: Mapping[Hashable, Straggler], generation: int) -> list[Decision]:
        wanted = {node: f for node, f in self.applied.items() if node not in by_node}  # not judged now: kept
        for node, s in by_node.items():
            now = max(s.recent_slowdown, self.release)  # how slow it is now
            applied = self.applied.get(node)
            if applied is None:
                if self._confirmed(node):
                    wanted[node] = now
            elif self._under.get(node, 0) < self.confirm:  # it stays, its factor grows only
                grown = self._confirmed(node) and now > applied * REBALANCE_CHANGE
                wanted[node] = now if grown else applied
        changed = wanted != self.applied
        fresh_plan = bool(wanted) and generation != self._applied_generation
        if not (changed or fresh_plan):
            return []
        if changed:
            self.applied = dict(wanted)
        self._applied_generation = generation
        if not self.applied:
            return [Rebalance(MappingProxyType({}), "no straggler left: the plain split")]
        detail = "; ".join(f"{n}: {straggler_detail(by_node[n]) if n in by_node else f'{f:.2f}x'}"
                           for n, f in sorted(self.applied.items(), key=lambda kv: str(kv[0])))
        return [Rebalance(_frozen(self.applied), detail)]

    def _confirmed(self, node: Hashable) -> bool:
        return self._over.get(node, 0) >= self.confirm

    def forget(self, node: Hashable) -> None:
        """The node left the job: nothing decided for it holds any more."""
        self.applied.pop(node, None)
        self._acted.discard(node)
        self._over.pop(node, None)
        self._under.pop(node, None)
