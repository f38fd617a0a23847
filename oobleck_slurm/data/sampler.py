"""Which samples each training step uses, independent of the pipeline plan and of restarts.

The samples form an endless stream. Stream position p goes to a source (`Mixture`: a deterministic,
weighted interleaving; one source takes every position) and becomes the k-th position of that
source's own stream; pass e = k // n over a source of n samples visits its samples in the order of a
seeded bijection of [0, n) keyed by (seed, source, e) (`Bijection`, below). Step s takes the stream
positions [cursor(s), cursor(s) + B), cursor(s) = c0 + (s - s0) * B: (s0, c0) = (0, 0) for a job
that starts from the seed, and the (step, consumed samples) of the checkpoint a job resumed from
(which lets the global batch change there with no gap and no repeat).

So the ids of a step are a pure function of (seed, step, data, origin): a job that lost nodes,
changed its number of pipelines or replayed a step after a failure trains on exactly the samples it
would have without the failure. Pipelines then take contiguous microbatch slices of that fixed list
(`pipeline_sample_ids`). Nothing is materialised: opening, any step, the step that crosses a pass
and a replacement's first step each cost O(global batch) time and O(1) memory beyond it.

`SAMPLER_VERSION` names the order: it goes into every checkpoint's data identity, and changes
whenever any of this (the bijection, its keys, the interleaving) would give other samples.
Version 1 was a numpy `Generator.permutation` per epoch (O(n) time and memory at each epoch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from oobleck_slurm.data.mixture import Mixture

SAMPLER_VERSION = 2
ROUNDS = 6  # Feistel rounds: 4 already make a pseudorandom permutation (Luby-Rackoff); 2 to spare
_MASK64 = (1 << 64) - 1
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int: a fixed, well-spread 64-bit hash (no numpy version
    or platform in it, unlike a Generator's stream)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Bijection:
    """A seeded permutation of [0, n), evaluated pointwise: a balanced Feistel network over the
    smallest even number of bits holding n, cycle-walking back into [0, n) (the domain is < 4n, so
    a value takes under 4 rounds of the network on average). O(1) to build, O(len(x)) to apply."""

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half) - 1)
        k = 0
        for part in key:
            k = mix64(k ^ (part & _MASK64))
        self._keys = [np.uint64(mix64(k ^ r)) for r in range(ROUNDS)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self._mask
        for k in self._keys:
            z = (right ^ k) * _MUL1
            z ^= z >> np.uint64(31)
            z *= _MUL2
            z ^= z >> np.uint64(29)
            left, right = right, left ^ (z & self._mask)
        return (left << h) | right

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The images of `x` (ints in [0, n)) as int64."""
        v = np.asarray(x, dtype=np.int64).reshape(-1)
        if v.size and (int(v.min()) < 0 or int(v.max()) >= self.n):
            raise ValueError(f"permutation input outside [0, {self.n})")
        y = self._network(v.astype(np.uint64))
        out = y >= self.n
        while out.any():  # cycle-walking: stays a bijection of [0, n)
            y[out] = self._network(y[out])
            out = y >= self.n
        return y.astype(np.int64)


class GlobalBatchSampler:
    """Sample ids per step for a global batch of `global_batch_size` samples.

    `num_samples`: one source's sample count, or each source's; ids number the sources' samples back
    to back (source j's local id i is sum(num_samples[:j]) + i). `weights`: the share of the stream
    each source takes (default: in proportion to its size, so a pass covers everything once).
    `origin`: (s0, c0), the step and the samples consumed so far at which this stream resumed."""

    def __init__(self, num_samples: int | Sequence[int], global_batch_size: int, seed: int,
                 weights: Sequence[float] | None = None, origin: tuple[int, int] = (0, 0)) -> None:
        sizes = [num_samples] if isinstance(num_samples, int) else [int(n) for n in num_samples]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"num_samples must be >= 1 for every source, got {sizes}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        if weights is not None and len(weights) != len(sizes):
            raise ValueError(f"{len(weights)} weights for {len(sizes)} sources")
        if origin[0] < 0 or origin[1] < 0:
            raise ValueError(f"origin (step, consumed samples) must be >= 0, got {origin}")
        self.sizes = sizes
        self.num_samples = sum(sizes)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.origin = (int(origin[0]), int(origin[1]))
        self.mixture = Mixture(list(weights) if weights is not None else [float(n) for n in sizes])
        self._offsets = np.cumsum([0, *sizes[:-1]]).astype(np.int64)

    def cursor(self, step: int) -> int:
        """The stream position of step `step`'s first sample: the samples consumed before it."""
        s0, c0 = self.origin
        if step < s0:
            raise ValueError(f"step {step} precedes step {s0}, where this data stream resumed")
        return c0 + (step - s0) * self.global_batch_size

    def passes(self, step: int) -> list[int]:
        """Per source, how many passes over it steps up to and including `step` start (1 = within
        the first pass)."""
        drawn = self.mixture.drawn(self.cursor(step) + self.global_batch_size)
        return [-(-d // n) for d, n in zip(drawn, self.sizes)]

    def stream_ids(self, positions: np.ndarray) -> np.ndarray:
        """The sample ids (int64) at stream positions `positions`."""
        src, k = self.mixture.locate(positions)
        out = np.empty(len(src), dtype=np.int64)
        for j in np.unique(src).tolist():
            at = np.flatnonzero(src == j)
            n = self.sizes[j]
            passes, offsets = np.divmod(k[at], n)
            for e in np.unique(passes).tolist():  # a step spans at most a few passes of a source
                sel = passes == e
                out[at[sel]] = Bijection(n, (self.seed, j, e))(offsets[sel]) + self._offsets[j]
        return out

    def sample_ids(self, step: int) -> np.ndarray:
        """The `global_batch_size` sample ids (int64) that step `step` trains on, in order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = self.cursor(step)
        return self.stream_ids(np.arange(start, start + self.global_batch_size, dtype=np.int64))


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
