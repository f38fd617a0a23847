"""Failure traces: what happens to which node when, from a file or from a failure model.

A trace is a time-ordered list of membership events: `fail` (a node is lost) and `join` (a node
arrives, e.g. a replacement). Times are seconds from the start of the run. Two generators:

- `fixed_interval_trace`: the Oobleck artifact's traces (tools/simulator/traces/{6h,3h,1h,30m,10m}.csv
  in SymbioticLab/Oobleck): N nodes at the start, then one node lost every `interval` until M are
  left; nothing joins. The artifact's files are exactly this shape with N=30, M=15.
- `random_failure_trace`: every node fails independently after an exponential (or Weibull) lifetime
  with the given per-node MTTF; a failed node's replacement joins `replacement_delay` later and is
  itself subject to failures. This is how production failure rates are quoted (a job-level MTTF of
  T at N nodes is a node MTTF of N*T under independent exponential lifetimes).

Pure: no I/O (the CSV reader is in `loader`).
"""

from __future__ import annotations

import heapq
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from oobleck_slurm.errors import BadInputError

EVENT_KINDS = ("fail", "join")


class TraceError(BadInputError, ValueError):
    """A bad trace or trace option; the message names the file and line when there is one."""


@dataclass(frozen=True, order=True)
class TraceEvent:
    time: float  # seconds from the start
    kind: str  # "fail" | "join"
    node: str


@dataclass(frozen=True)
class Trace:
    """Initial nodes and the events after them, sorted by time (stable for equal times)."""

    initial_nodes: tuple[str, ...]
    events: tuple[TraceEvent, ...]
    horizon_s: float  # the simulated run ends here
    source: str = ""

    @property
    def failures(self) -> int:
        return sum(1 for e in self.events if e.kind == "fail")

    def mean_time_between_failures(self) -> float:
        """Horizon / failures (inf without failures): what checkpoint intervals are tuned against."""
        n = self.failures
        return self.horizon_s / n if n else math.inf


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h|d)?\s*$", re.IGNORECASE)
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float | int, what: str = "duration") -> float:
    """Seconds from '30s', '10m', '6h', '2d', '250ms' or a bare number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _DURATION.match(str(text))
        if not match:
            raise TraceError(f"{what}: {text!r} is not a duration (examples: 30s, 10m, 6h, 2d, or seconds)")
        value = float(match.group(1)) * _UNIT[(match.group(2) or "s").lower()]
    if not math.isfinite(value) or value <= 0:
        raise TraceError(f"{what}: must be > 0, got {text!r}")
    return value


def node_names(count: int, start: int = 0) -> list[str]:
    return [f"node{i}" for i in range(start + 1, start + count + 1)]


def build_trace(initial: Sequence[str], events: Iterable[TraceEvent], horizon_s: float | None = None,
                source: str = "") -> Trace:
    """Check that events make sense against the membership (a node fails only while present, joins only
    while absent) and sort them; the horizon defaults to the last event plus the mean gap."""
    ordered = sorted(events, key=lambda e: e.time)
    present = set(initial)
    if len(present) != len(initial):
        raise TraceError(f"{source or 'trace'}: initial nodes repeat a name")
    for e in ordered:
        if e.kind == "fail":
            if e.node not in present:
                raise TraceError(f"{source or 'trace'}: t={e.time:g}: node {e.node!r} fails but is not present")
            present.discard(e.node)
        elif e.kind == "join":
            if e.node in present:
                raise TraceError(f"{source or 'trace'}: t={e.time:g}: node {e.node!r} joins but is already present")
            present.add(e.node)
        else:
            raise TraceError(f"{source or 'trace'}: unknown event kind {e.kind!r} (expected fail or join)")
    if horizon_s is None:
        last = ordered[-1].time if ordered else 0.0
        gap = last / len(ordered) if ordered else 3600.0
        horizon_s = last + max(gap, 1.0)
    if ordered and horizon_s < ordered[-1].time:
        ordered = [e for e in ordered if e.time <= horizon_s]
    return Trace(tuple(initial), tuple(ordered), float(horizon_s), source)


def fixed_interval_trace(nodes: int, min_nodes: int, interval_s: float, *, seed: int = 0,
                         horizon_s: float | None = None) -> Trace:
    """The artifact's trace: `nodes` at t=0, one node lost every `interval_s` (first at interval_s)
    until `min_nodes` remain; which node is random (seeded), as in the artifact. The horizon defaults
    to one interval after the last loss, so the smallest membership is run for one interval too."""
    if nodes < 1 or min_nodes < 0 or min_nodes > nodes:
        raise TraceError(f"--nodes {nodes} / --min-nodes {min_nodes}: need nodes >= 1 and 0 <= min-nodes <= nodes")
    names = node_names(nodes)
    order = names[:]
    random.Random(seed).shuffle(order)
    events = [TraceEvent(interval_s * (i + 1), "fail", order[i]) for i in range(nodes - min_nodes)]
    if horizon_s is None:
        horizon_s = interval_s * (nodes - min_nodes + 1)
    return build_trace(names, events, horizon_s, f"fixed interval {interval_s:g}s, {nodes} -> {min_nodes} nodes")


def random_failure_trace(nodes: int, node_mttf_s: float, horizon_s: float, *, replacement_delay_s: float | None = 600.0,
                         weibull_shape: float | None = None, seed: int = 0) -> Trace:
    """Independent node lifetimes (exponential with mean `node_mttf_s`, or Weibull with that mean and
    shape k); each loss brings a replacement `replacement_delay_s` later (None: no replacements)."""
    if nodes < 1:
        raise TraceError(f"--nodes must be >= 1, got {nodes}")
    if weibull_shape is not None and weibull_shape <= 0:
        raise TraceError(f"--weibull-shape must be > 0, got {weibull_shape}")
    rng = random.Random(seed)
    if weibull_shape is None:
        def lifetime() -> float:
            return rng.expovariate(1.0 / node_mttf_s)
    else:
        scale = node_mttf_s / math.gamma(1.0 + 1.0 / weibull_shape)

        def lifetime() -> float:
            return rng.weibullvariate(scale, weibull_shape)
    names = node_names(nodes)
    heap = [(lifetime(), name) for name in names]
    heapq.heapify(heap)
    events: list[TraceEvent] = []
    next_id = nodes
    while heap and heap[0][0] <= horizon_s:
        t, name = heapq.heappop(heap)
        events.append(TraceEvent(t, "fail", name))
        if replacement_delay_s is not None and t + replacement_delay_s <= horizon_s:
            next_id += 1
            new = f"node{next_id}"
            events.append(TraceEvent(t + replacement_delay_s, "join", new))
            heapq.heappush(heap, (t + replacement_delay_s + lifetime(), new))
    kind = f"Weibull k={weibull_shape:g}" if weibull_shape is not None else "exponential"
    return build_trace(names, events, horizon_s,
                       f"random failures ({kind}), node MTTF {node_mttf_s:g}s, {nodes} nodes")
