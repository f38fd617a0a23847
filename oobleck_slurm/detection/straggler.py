"""MegaScale-style straggler detection from compute-only timings (pure).

Step times cannot find a slow rank in data-parallel training: the all-reduce makes every rank wait
for the slowest, so all step times look alike. Compute-only segments (forward and backward of one
microbatch, no communication) do differ, so each rank reports those and a slow one stands out from
the ranks that do the same work. The slowdown ratio tells the runtime how much less work to give
that rank's pipeline (`rebalance`) or whether to evict it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    rank: Hashable
    slowdown: float  # the rank's median compute time over its peers' (same work), e.g. 1.4
    median_s: float  # the rank's median compute seconds per microbatch
    peers_median_s: float  # the peers' typical compute seconds for the same work


def find_stragglers(compute_s: Mapping[Hashable, Sequence[float]], threshold: float = 1.3, min_samples: int = 3,
                    work: Mapping[Hashable, Hashable] | None = None,
                    expected_s: Mapping[Hashable, float] | None = None) -> list[Straggler]:
    """Ranks whose median compute time exceeds their peers' by `threshold` times, slowest first.

    `compute_s[rank]`: recent compute-only seconds per microbatch. Peers are the ranks with the same
    `work[rank]` key (e.g. the stage's layer range and microbatch size; all ranks when omitted). With
    `expected_s[rank]` (e.g. the profile's forward+backward time of the rank's stage), times are
    divided by it first, so ranks with different stages compare too. Each rank is compared with the
    median of the *other* ranks of its group, so two peers suffice and a slow rank never hides itself
    by moving the median. A rank with fewer than `min_samples` timings is not judged.
    """
    if threshold <= 1:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    medians: dict[Hashable, float] = {}
    for rank, times in compute_s.items():
        if len(times) >= min_samples:
            m = statistics.median(times)
            scale = expected_s.get(rank) if expected_s else 1.0
            if scale and scale > 0 and m > 0:
                medians[rank] = m / scale
    groups: dict[Hashable, list[Hashable]] = {}
    for rank in medians:
        groups.setdefault(work.get(rank) if work else None, []).append(rank)
    found = []
    for ranks in groups.values():
        for rank in ranks:
            peers = [medians[r] for r in ranks if r != rank]
            if not peers:
                continue
            typical = statistics.median(peers)
            ratio = medians[rank] / typical
            if ratio >= threshold:
                scale = expected_s.get(rank, 1.0) if expected_s else 1.0
                found.append(Straggler(rank, ratio, medians[rank] * scale, typical * scale))
    return sorted(found, key=lambda s: -s.slowdown)


class StragglerWatch:
    """Keeps each rank's last `window` compute timings; `stragglers()` judges them (see find_stragglers)."""

    def __init__(self, window: int = 20, threshold: float = 1.3, min_samples: int = 5) -> None:
        if window < 1 or min_samples < 1 or min_samples > window or threshold <= 1:
            raise ValueError("need window >= min_samples >= 1 and threshold > 1")
        self.window, self.threshold, self.min_samples = window, threshold, min_samples
        self._times: dict[Hashable, deque[float]] = {}
        self._work: dict[Hashable, Hashable] = {}
        self._expected: dict[Hashable, float] = {}

    def report(self, rank: Hashable, seconds: float, work: Hashable = None, expected_s: float | None = None) -> None:
        """One compute-only timing of `rank` (per microbatch). A change of `work` (a new plan) restarts it."""
        if self._work.get(rank, work) != work:
            self._times.pop(rank, None)
        self._work[rank] = work
        if expected_s is not None:
            self._expected[rank] = expected_s
        self._times.setdefault(rank, deque(maxlen=self.window)).append(float(seconds))

    def forget(self, rank: Hashable) -> None:
        self._times.pop(rank, None)
        self._work.pop(rank, None)
        self._expected.pop(rank, None)

    def stragglers(self) -> list[Straggler]:
        expected = self._expected if len(self._expected) == len(self._times) and self._expected else None
        return find_stragglers(self._times, self.threshold, self.min_samples, self._work, expected)
