"""MegaScale-style straggler detection from compute-only timings (pure).

Step times cannot find a slow rank in data-parallel training: the all-reduce makes every rank wait
for the slowest, so all step times look alike. Compute-only segments (forward and backward of one
microbatch, no communication) do differ, so each rank reports those and a slow one stands out from
the ranks that do the same work. The slowdown ratio tells the runtime how much less work to give
that rank's pipeline (`rebalance`) or whether to evict it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Straggler:
    rank: Hashable
    slowdown: float  # the rank's median compute time over its peers' (same work), e.g. 1.4
    median_s: float  # the rank's median compute seconds per microbatch
    peers_median_s: float  # the peers' typical compute seconds for the same work
    # The same ratio over the newest half of the timings: how slow it is now. A rank that just became
    # slow crosses the threshold while half its window is still fast (slowdown ~1.5 for a 2x rank);
    # this says 2x, the factor to rebalance by.
    recent_slowdown: float = 0.0


def _others_median(x: np.ndarray) -> np.ndarray:
    """For each row (a step) and column (a rank): the median of the row's *other* values (NaN =
    missing; NaN where there is no other value). Vectorised: a rank's peers' median is the row's
    sorted values with that rank's own taken out, so no per-rank list is built (1,024 ranks per step)."""
    rows, cols = x.shape
    order = np.argsort(x, axis=1)  # NaN last
    ordered = np.take_along_axis(x, order, axis=1)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.broadcast_to(np.arange(cols), (rows, cols)).copy(), axis=1)
    others = np.sum(~np.isnan(x), axis=1, keepdims=True) - 1

    def without_own(j: np.ndarray) -> np.ndarray:  # the j-th smallest value once the rank's own is removed
        return np.take_along_axis(ordered, np.clip(np.where(j < position, j, j + 1), 0, cols - 1), axis=1)

    median = (without_own((others - 1) // 2) + without_own(others // 2)) / 2
    return np.where((others >= 1) & ~np.isnan(x), median, np.nan)


def slowdowns(compute_s: Mapping[Hashable, Sequence[float]], min_samples: int = 3,
              work: Mapping[Hashable, Hashable] | None = None,
              expected_s: Mapping[Hashable, float] | None = None) -> dict[Hashable, Straggler]:
    """Every judged rank's slowdown against its peers (see `find_stragglers`), straggling or not."""
    groups: dict[Hashable, list[Hashable]] = {}
    for rank in compute_s:
        scale = expected_s.get(rank) if expected_s else 1.0
        if scale and scale > 0:
            groups.setdefault(work.get(rank) if work else None, []).append(rank)
    out = {}
    for ranks in groups.values():
        depth = max(len(compute_s[r]) for r in ranks)
        x = np.full((depth, len(ranks)), np.nan)
        for j, rank in enumerate(ranks):  # aligned on the newest timing: row i is the same step for all
            times = np.asarray(compute_s[rank], dtype=float)
            if len(times):
                x[depth - len(times):, j] = times / (expected_s[rank] if expected_s else 1.0)
        x[~(x > 0)] = np.nan
        reference = _others_median(x)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = x / reference
        valid = np.isfinite(ratio) & (reference > 0)
        for j, rank in enumerate(ranks):
            mine = valid[:, j]
            if len(compute_s[rank]) < min_samples or mine.sum() < min_samples:
                continue
            scale = expected_s.get(rank, 1.0) if expected_s else 1.0
            ratios = ratio[mine, j]
            out[rank] = Straggler(rank, float(np.median(ratios)), float(np.nanmedian(x[:, j])) * scale,
                                  float(np.median(reference[mine, j])) * scale,
                                  float(np.median(ratios[len(ratios) // 2:])))
    return out


def find_stragglers(compute_s: Mapping[Hashable, Sequence[float]], threshold: float = 1.3, min_samples: int = 3,
                    work: Mapping[Hashable, Hashable] | None = None,
                    expected_s: Mapping[Hashable, float] | None = None) -> list[Straggler]:
    """Ranks whose compute time exceeds their peers' by `threshold` times, slowest first.

    `compute_s[rank]`: recent compute-only seconds per microbatch, one per step, oldest first, the
    last ones of all ranks from the same steps (the runtime reports every rank of a step together).
    Peers are the ranks with the same `work[rank]` key (e.g. the stage's layer range; all ranks when
    omitted). With `expected_s[rank]` (e.g. the profile's forward+backward time of the rank's stage),
    times are divided by it first, so ranks with different stages compare too.

    Each timing is compared with the median of the *other* ranks' timings of the same step (counted
    from the newest), and a rank's slowdown is the median of those ratios: machine-level similarity
    at one instant, as in the Minder detector, so a moment when the whole machine or job was slow (a
    busy host, a checkpoint) cancels out instead of making whoever was unlucky look slow; two peers
    suffice, and a slow rank never hides itself by moving the median. A rank with fewer than
    `min_samples` timings is not judged.
    """
    if threshold <= 1:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    found = [s for s in slowdowns(compute_s, min_samples, work, expected_s).values() if s.slowdown >= threshold]
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

    def _expected_times(self) -> dict[Hashable, float] | None:
        return self._expected if len(self._expected) == len(self._times) and self._expected else None

    def stragglers(self) -> list[Straggler]:
        return find_stragglers(self._times, self.threshold, self.min_samples, self._work, self._expected_times())

    def slowdowns(self) -> dict[Hashable, Straggler]:
        """Every judged rank's slowdown against its peers, straggling or not (for hysteresis, dashboards)."""
        return slowdowns(self._times, self.min_samples, self._work, self._expected_times())
