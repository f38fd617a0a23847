"""Which source each position of the sample stream comes from: a weighted, deterministic interleaving.

The weights are apportioned to integer quotas q_j over a period of PERIOD positions (largest
remainders, so sum q_j = PERIOD and |q_j - w_j * PERIOD| < 1). Inside a period the slots are ordered
as a divisor-method (Sainte-Lague) sequence: source j's k-th slot has the key (k + 1/2) / q_j, and
the slots are sorted by key. Every prefix of that sequence is then within a couple of slots of its
share, so the realised mix of any window of the stream matches the weights (to a few samples per
source, plus the quantisation, below 1e-5 of the weight), not only on average.

Position p is slot r = p % PERIOD of cycle p // PERIOD. The source's own stream index k (how many
earlier positions went to the same source) is cycle * q_j + (its rank among that source's slots), so
locating a position costs O(1) and the tables O(PERIOD), whatever the step or the number of sources.
Pure logic: no I/O, no plan, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERIOD = 1 << 16


def apportion(weights: Sequence[float], total: int, at_least_one: bool = True) -> list[int]:
    """Integer quotas summing to `total`, each within 1 of its exact share (largest remainders; ties
    to the earlier source). With `at_least_one`, every weight gets at least one slot."""
    if not weights:
        raise ValueError("a mixture needs at least one source")
    if any(not (w > 0 and np.isfinite(w)) for w in weights):
        raise ValueError(f"mixture weights must be finite and > 0, got {list(weights)}")
    if at_least_one and total < len(weights):
        raise ValueError(f"{len(weights)} sources cannot share {total} slots")
    s = float(sum(weights))
    exact = [w / s * total for w in weights]
    quotas = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda j: (-(exact[j] - quotas[j]), j))
    for j in by_remainder[: total - sum(quotas)]:
        quotas[j] += 1
    for j in range(len(quotas) if at_least_one else 0):  # a tiny weight still gets its slot, taken from the largest quota
        if quotas[j] == 0:
            quotas[j] = 1
            quotas[max(range(len(quotas)), key=lambda i: (quotas[i], -i))] -= 1
    return quotas


class Mixture:
    """Positions of the global sample stream -> (source, index in that source's own stream)."""

    def __init__(self, weights: Sequence[float], period: int = PERIOD) -> None:
        self.weights = [float(w) for w in weights]
        self.period = period
        self.quotas = apportion(self.weights, period)
        source = np.repeat(np.arange(len(self.quotas), dtype=np.int64), self.quotas)
        rank = np.concatenate([np.arange(q, dtype=np.int64) for q in self.quotas])
        keys = (2 * rank + 1) / (2 * np.asarray(self.quotas, dtype=np.float64)[source])
        order = np.argsort(keys, kind="stable")  # stable: equal keys go to the earlier source
        self.slot_source = source[order]
        self.slot_rank = rank[order]
        # Each source's slots, in order: how many of its slots a prefix of a period holds.
        self._slots = [np.flatnonzero(self.slot_source == j) for j in range(len(self.quotas))]

    @property
    def num_sources(self) -> int:
        return len(self.quotas)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) for each stream position: k is the position's index in its source's stream."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and int(p.min()) < 0:
            raise ValueError(f"stream positions must be >= 0, got {int(p.min())}")
        cycle, slot = np.divmod(p, self.period)
        src = self.slot_source[slot]
        return src, cycle * np.asarray(self.quotas, dtype=np.int64)[src] + self.slot_rank[slot]

    def drawn(self, position: int) -> list[int]:
        """How many of the positions [0, position) each source supplies."""
        if position < 0:
            raise ValueError(f"a stream position must be >= 0, got {position}")
        cycle, slot = divmod(position, self.period)
        return [cycle * q + int(np.searchsorted(s, slot)) for q, s in zip(self.quotas, self._slots)]
