"""The pre-flight verdict on a node: admit it, or refuse it because it measured below a fraction of
the fleet's median (pure: no I/O; agent/preflight.py measures, supervisor/agent_nodes.py asks).

A node's figures are a mapping of figure name -> throughput (higher is better; FIGURES lists those
measured): its matmul throughput, the bandwidth of its TCP path to the supervisor, and on a node with
two or more GPUs the bus bandwidth of an all-reduce over its own GPUs. Each figure the candidate
reports is compared with the median of the same figure over the fleet; the candidate is refused when
any is below `min_fraction` of that median, or is not a positive finite number (a broken measurement
admits nothing). A figure that fewer than `min_nodes` fleet members reported is not judged (a median
of one or two nodes says nothing about which is slow): the node is admitted on it and the verdict
says so. A fleet figure that is not positive and finite is left out of the median.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MATMUL = "matmul_gflops"  # the node's slowest device, GFLOP/s (GPU: bf16 GEMM; CPU: fp32 on the worker's threads)
LINK = "link_mib_s"  # its TCP path to the supervisor (gloo), MiB/s
ALLREDUCE = "allreduce_gib_s"  # intra-node all-reduce bus bandwidth over its GPUs (NCCL), GiB/s; >= 2 GPUs only
FIGURES = (MATMUL, LINK, ALLREDUCE)
DESCRIPTIONS = {MATMUL: "matmul", LINK: "link to the supervisor", ALLREDUCE: "intra-node all-reduce"}
UNITS = {MATMUL: "GFLOP/s", LINK: "MiB/s", ALLREDUCE: "GiB/s"}

Figures = Mapping[str, float]


@dataclass(frozen=True)
class Verdict:
    admit: bool
    reason: str  # why refused; when admitted, what was not judged ("" if everything was)
    medians: dict[str, float] = field(default_factory=dict)  # the fleet medians it was judged against


def _usable(value: float) -> bool:
    return math.isfinite(value) and value > 0


def fleet_medians(fleet: Sequence[Figures], min_nodes: int) -> tuple[dict[str, float], dict[str, int]]:
    """The median of each figure over the fleet where at least `min_nodes` reported it usably, and the
    count of usable reports of every figure seen."""
    values: dict[str, list[float]] = {}
    for figures in fleet:
        for name, value in figures.items():
            values.setdefault(name, [])
            if _usable(value):
                values[name].append(value)
    counts = {name: len(v) for name, v in values.items()}
    return {name: statistics.median(v) for name, v in values.items() if len(v) >= min_nodes}, counts


def decide(fleet: Sequence[Figures], candidate: Figures, min_fraction: float, min_nodes: int = 3) -> Verdict:
    """Admit `candidate` or refuse it against `fleet` (the figures of the nodes measured so far; at
    the start, every member's, the candidate's included)."""
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}")
    if min_nodes < 1:
        raise ValueError(f"min_nodes must be >= 1, got {min_nodes}")
    medians, counts = fleet_medians(fleet, min_nodes)
    refusals, unjudged = [], []
    for name in sorted(candidate):
        value = candidate[name]
        label = DESCRIPTIONS.get(name, name)
        if not _usable(value):
            refusals.append(f"{label} measured {value!r}")
        elif name not in medians:
            unjudged.append(f"{label} ({counts.get(name, 0)} of {min_nodes} nodes measured)")
        elif value < min_fraction * medians[name]:
            refusals.append(f"{label} {value:.4g} {UNITS.get(name, '')} is "
                            f"{value / medians[name]:.2f} x the fleet's median {medians[name]:.4g} "
                            f"(below {min_fraction:g})")
    judged = {n: m for n, m in medians.items() if n in candidate}
    if refusals:
        return Verdict(False, "; ".join(refusals), judged)
    return Verdict(True, f"not judged: {', '.join(unjudged)}" if unjudged else "", judged)


def decide_fleet(measured: Mapping[str, Figures], min_fraction: float, min_nodes: int = 3) -> dict[str, Verdict]:
    """The start's verdicts: every member measured at the start against the median of them all."""
    fleet = list(measured.values())
    return {node: decide(fleet, figures, min_fraction, min_nodes) for node, figures in measured.items()}
