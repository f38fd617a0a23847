"""MegaScale-style straggler detection.

Step times cannot find a slow rank in data-parallel training: the all-reduce makes every rank wait
for the slowest, so all step times look alike. Compute-only segments (forward/backward kernels, no
communication) do differ, so each rank reports those and the slow ones stand out from their peers.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence


def find_stragglers(compute_s: Mapping[Hashable, Sequence[float]], slowdown: float = 1.3,
                    min_samples: int = 3) -> list[Hashable]:
    """Ranks whose median compute time exceeds the peers' median by `slowdown` times.

    `compute_s[rank]` are recent compute-only durations of comparable work (e.g. per microbatch of
    the same stage shape). The median of medians is robust to a minority of slow ranks.
    """
    medians = {rank: statistics.median(times) for rank, times in compute_s.items() if len(times) >= min_samples}
    if len(medians) < 2:
        return []
    typical = statistics.median(medians.values())
    slow = [(m / typical, rank) for rank, m in medians.items() if m > slowdown * typical]
    return [rank for _, rank in sorted(slow, key=lambda item: -item[0])]
