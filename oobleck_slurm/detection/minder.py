"""Minder-style faulty-machine detection from monitoring metrics.

Machines of one training job run the same work, so their metrics (CPU, memory, network, GPU
utilisation, power, temperature, step compute time) move together; a faulty machine's metrics
drift away from its peers' before the job halts. For each metric and sample, values are normalised
across nodes and each node's median distance to its peers is taken; its median over the recent
window, summed over metrics, is the node's score. A node whose score is the largest and stands
out (by `threshold` times the median node's) is a suspect; a suspect for `continuity` consecutive observations is reported faulty. Continuity is what makes it
precise: one noisy sample makes no alarm.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping

import numpy as np


class MinderDetector:
    def __init__(self, window: int = 8, continuity: int = 4, threshold: float = 3.0, min_nodes: int = 4) -> None:
        if window < 2 or continuity < 1 or threshold <= 1 or min_nodes < 3:
            raise ValueError("need window >= 2, continuity >= 1, threshold > 1, min_nodes >= 3")
        self.window, self.continuity, self.threshold, self.min_nodes = window, continuity, threshold, min_nodes
        self._history: dict[tuple[Hashable, str], deque[float]] = {}
        self._suspect: Hashable | None = None
        self._streak = 0

    def observe(self, sample: Mapping[Hashable, Mapping[str, float]]) -> Hashable | None:
        """Add one sample `{node: {metric: value}}`; return a node once it is judged faulty."""
        for node, metrics in sample.items():
            for metric, value in metrics.items():
                self._history.setdefault((node, metric), deque(maxlen=self.window)).append(float(value))
        suspect = self._suspect_now(list(sample))
        if suspect is not None and suspect == self._suspect:
            self._streak += 1
        else:
            self._suspect, self._streak = suspect, int(suspect is not None)
        return suspect if suspect is not None and self._streak >= self.continuity else None

    def forget(self, node: Hashable) -> None:
        """Drop an evicted node's history so that it does not skew its peers' normalisation."""
        for key in [k for k in self._history if k[0] == node]:
            del self._history[key]
        if self._suspect == node:
            self._suspect, self._streak = None, 0

    def scores(self, nodes: list[Hashable]) -> dict[Hashable, float]:
        """Each node's distance to its peers, summed over metrics (larger = more unlike the others)."""
        metrics = sorted({metric for (_, metric) in self._history})
        total = np.zeros(len(nodes))
        for metric in metrics:
            series = [self._history.get((node, metric)) for node in nodes]
            if any(s is None or len(s) < self.window for s in series):
                continue
            x = np.array([list(s) for s in series])  # nodes x window
            # Normalise by the spread across nodes and time, so metrics in % and in bytes weigh alike.
            scale = x.std()
            if scale == 0:
                continue
            x = (x - x.mean()) / scale
            # Per sample, each node's median distance to its peers: a healthy node is close to most
            # of its peers even when one of them is far off, so only the odd one out scores high.
            gaps = np.abs(x[:, None, :] - x[None, :, :])  # nodes x nodes x window
            peers = ~np.eye(len(nodes), dtype=bool)
            per_sample = np.median(gaps[peers].reshape(len(nodes), len(nodes) - 1, -1), axis=1)
            # Median over the window: a deviation must last, a single glitchy reading does not count.
            total += np.median(per_sample, axis=1)
        return dict(zip(nodes, total.tolist()))

    def _suspect_now(self, nodes: list[Hashable]) -> Hashable | None:
        if len(nodes) < self.min_nodes:
            return None
        scores = self.scores(nodes)
        ranked = sorted(scores.items(), key=lambda item: -item[1])
        top_node, top = ranked[0]
        typical = float(np.median([s for _, s in ranked[1:]]))
        if top <= 0 or top < self.threshold * max(typical, 1e-12):
            return None
        return top_node
