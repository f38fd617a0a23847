"""Weighted mixtures: the apportionment, O(1) location against a brute-force count, the realised mix
of every 1,000-step window, and a step's samples whatever the number of pipelines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.data import GlobalBatchSampler, contiguous_slices, pipeline_sample_ids
from oobleck_slurm.data.mixture import Mixture, apportion

WEIGHTS = [0.6, 0.3, 0.1]


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.floats(0.001, 100), min_size=1, max_size=12), total=st.integers(12, 10**6))
def test_apportion_sums_and_stays_near_the_share(weights: list[float], total: int) -> None:
    q = apportion(weights, total)
    assert sum(q) == total and min(q) >= 1
    exact = [w / sum(weights) * total for w in weights]
    bumped = sum(e < 1 for e in exact)  # a share under one slot still gets one, from the largest quota
    assert all(abs(a - e) < 1 + bumped for a, e in zip(q, exact))


def test_apportion_errors_and_holdout_mode() -> None:
    with pytest.raises(ValueError, match="finite and > 0"):
        apportion([1.0, 0.0], 10)
    with pytest.raises(ValueError, match="at least one source"):
        apportion([], 10)
    assert apportion([3.0, 1.0], 0, at_least_one=False) == [0, 0]
    assert apportion([0.6, 0.3, 0.1], 10, at_least_one=False) == [6, 3, 1]


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0.01, 10), min_size=1, max_size=6), period=st.integers(6, 300),
       start=st.integers(0, 10**12))
def test_locate_matches_a_brute_force_count(weights: list[float], period: int, start: int) -> None:
    m = Mixture(weights, period=period)
    first = start - start % period  # a cycle boundary: the brute force counts from there
    pos = np.arange(first, first + 3 * period + 5)
    src, k = m.locate(pos)
    seen = [first // period * q for q in m.quotas]
    for j, kk in zip(src.tolist(), k.tolist()):
        assert kk == seen[j]  # each source's stream index counts up by one, no gap, no repeat
        seen[j] += 1
    assert m.drawn(int(pos[-1]) + 1) == seen


def test_every_1000_step_window_is_within_1_percent_of_the_weights() -> None:
    batch, steps = 8, 12_000
    s = GlobalBatchSampler([5000, 3000, 700], batch, seed=1, weights=WEIGHTS)
    for base in (0, 10**9):  # the start of training, and far into it
        src, _ = s.mixture.locate(np.arange(base * batch, (base + steps) * batch))
        per_step = np.stack([(src == j).reshape(steps, batch).sum(axis=1) for j in range(3)], axis=1)
        cum = np.concatenate([np.zeros((1, 3), np.int64), np.cumsum(per_step, axis=0)])
        window = (cum[1000:] - cum[:-1000]) / (1000 * batch)  # every window of 1,000 steps
        for j, w in enumerate(WEIGHTS):
            assert np.abs(window[:, j] - w).max() <= 0.01 * w  # within 1% of the weight itself


def test_sources_take_their_own_samples_in_their_own_passes() -> None:
    sizes = [50, 30, 7]
    s = GlobalBatchSampler(sizes, 10, seed=3, weights=WEIGHTS)
    ids = np.concatenate([s.sample_ids(k) for k in range(200)])
    src, k = s.mixture.locate(np.arange(len(ids)))
    starts = [0, 50, 80]
    for j, n in enumerate(sizes):
        mine = ids[src == j]
        assert ((mine >= starts[j]) & (mine < starts[j] + n)).all()
        for e in range(len(mine) // n):  # every full pass is a permutation of the source
            assert sorted(mine[e * n : (e + 1) * n].tolist()) == list(range(starts[j], starts[j] + n))
    assert s.passes(199) == [-(-d // n) for d, n in zip(s.mixture.drawn(2000), sizes)]


@settings(max_examples=50, deadline=None)
@given(pipelines=st.integers(1, 8), step=st.integers(0, 10**6), seed=st.integers(0, 2**40))
def test_a_step_is_bitwise_the_same_whatever_the_pipeline_count(pipelines: int, step: int, seed: int) -> None:
    microbatch, microbatches = 2, 24
    ids = GlobalBatchSampler([900, 400, 101], microbatch * microbatches, seed, WEIGHTS).sample_ids(step)
    counts = [microbatches // pipelines + (i < microbatches % pipelines) for i in range(pipelines)]
    parts = [pipeline_sample_ids(ids, microbatch, a, n) for a, n in contiguous_slices(counts)]
    # A fresh sampler (a restarted process under another plan) gives the same bytes.
    again = GlobalBatchSampler([900, 400, 101], microbatch * microbatches, seed, WEIGHTS).sample_ids(step)
    assert np.concatenate(parts).tobytes() == ids.tobytes() == again.tobytes()
