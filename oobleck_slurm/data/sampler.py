"""Which samples each training step uses, independent of the pipeline plan and of restarts.

The samples form an endless stream: epoch e is a permutation of all `num_samples` sample ids,
seeded by (seed, e), and step s takes the stream positions [s*B, s*B + B). So the ids of a step
are a pure function of (seed, step): a job that lost nodes, changed its number of pipelines or
replayed a step after a failure trains on exactly the samples it would have without the failure.
Pipelines then take contiguous microbatch slices of that fixed list (`pipeline_sample_ids`).

The permutation comes from numpy's `Generator` (PCG64). numpy may change a Generator's stream
between its versions, so every process of one job must use the same numpy (they do: one image).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class GlobalBatchSampler:
    """Sample ids per step for a global batch of `global_batch_size` samples."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        # Only the most recent epochs are kept: consecutive steps touch at most two.
        self._cache: dict[int, np.ndarray] = {}

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """All sample ids in the order epoch `epoch` visits them (int64)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            perm = rng.permutation(self.num_samples).astype(np.int64)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm

    def epoch_of(self, step: int) -> int:
        """The epoch in which step `step` starts."""
        return step * self.global_batch_size // self.num_samples

    def sample_ids(self, step: int) -> np.ndarray:
        """The `global_batch_size` sample ids (int64) that step `step` trains on, in order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        out = np.empty(self.global_batch_size, dtype=np.int64)
        pos = step * self.global_batch_size  # position in the endless stream
        filled = 0
        while filled < self.global_batch_size:
            epoch, offset = divmod(pos + filled, self.num_samples)
            take = min(self.global_batch_size - filled, self.num_samples - offset)
            out[filled : filled + take] = self.epoch_permutation(epoch)[offset : offset + take]
            filled += take
        return out


def pipeline_sample_ids(
    step_ids: np.ndarray, microbatch_size: int, start: int, count: int
) -> np.ndarray:
    """The samples of microbatches [start, start + count) of a step's ids: one pipeline's share.

    Microbatch k of the step is step_ids[k*b : (k+1)*b]; a pipeline owns a contiguous run of them.
    """
    n = len(step_ids)
    if microbatch_size < 1 or n % microbatch_size:
        raise ValueError(
            f"the global batch of {n} samples is not a whole number of microbatches of "
            f"{microbatch_size}"
        )
    num_microbatches = n // microbatch_size
    if start < 0 or count < 0 or start + count > num_microbatches:
        raise ValueError(
            f"microbatch slice [{start}, {start + count}) is outside the step's "
            f"{num_microbatches} microbatches"
        )
    return step_ids[start * microbatch_size : (start + count) * microbatch_size]


def contiguous_slices(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) per pipeline for microbatch counts given in pipeline order.

    E.g. counts [3, 5, 2] -> [(0, 3), (3, 5), (8, 2)].
    """
    slices: list[tuple[int, int]] = []
    start = 0
    for count in counts:
        if count < 0:
            raise ValueError(f"microbatch counts must be >= 0, got {list(counts)}")
        slices.append((start, count))
        start += count
    return slices
