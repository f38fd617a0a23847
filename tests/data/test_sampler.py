"""GlobalBatchSampler: determinism, epochs, and independence of the pipeline split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.data import GlobalBatchSampler, contiguous_slices, pipeline_sample_ids


def test_same_seed_same_ids_fresh_instance_and_any_order() -> None:
    a = GlobalBatchSampler(1000, 64, seed=3)
    first = [a.sample_ids(s) for s in range(40)]
    b = GlobalBatchSampler(1000, 64, seed=3)  # a "restarted" process, asked out of order
    for s in reversed(range(40)):
        assert np.array_equal(b.sample_ids(s), first[s])
    assert not np.array_equal(GlobalBatchSampler(1000, 64, seed=4).sample_ids(0), first[0])
    assert first[0].dtype == np.int64 and first[0].shape == (64,)


@pytest.mark.parametrize(("num_samples", "batch"), [(100, 10), (97, 10), (5, 8), (64, 64)])
def test_epochs_cover_every_sample_once(num_samples: int, batch: int) -> None:
    s = GlobalBatchSampler(num_samples, batch, seed=1)
    steps = 3 * num_samples  # at least 3 epochs: every step takes >= 1 sample
    stream = np.concatenate([s.sample_ids(k) for k in range(steps)])
    for epoch in range(3):
        chunk = stream[epoch * num_samples : (epoch + 1) * num_samples]
        assert sorted(chunk.tolist()) == list(range(num_samples))
    # Different epochs use different orders.
    assert not np.array_equal(stream[:num_samples], stream[num_samples : 2 * num_samples])
    assert s.epoch_of(steps - 1) == (steps - 1) * batch // num_samples


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    microbatch=st.integers(1, 4),
    step=st.integers(0, 50),
    seed=st.integers(0, 2**31),
)
def test_union_of_pipeline_slices_is_the_step(counts, microbatch, step, seed) -> None:
    gbs = sum(counts) * microbatch
    sampler = GlobalBatchSampler(37, gbs, seed)
    ids = sampler.sample_ids(step)
    parts = [pipeline_sample_ids(ids, microbatch, a, n) for a, n in contiguous_slices(counts)]
    assert np.array_equal(np.concatenate(parts), ids)
    # A different split of the same step (one pipeline lost, its work spread) trains on the same
    # samples: the sampler never saw the plan.
    other = GlobalBatchSampler(37, gbs, seed).sample_ids(step)
    regrouped = [pipeline_sample_ids(other, microbatch, a, n) for a, n in contiguous_slices([sum(counts)])]
    assert np.array_equal(np.concatenate(regrouped), ids)


def test_slice_errors() -> None:
    ids = GlobalBatchSampler(100, 12, 0).sample_ids(0)
    with pytest.raises(ValueError, match="not a whole number of microbatches of 5"):
        pipeline_sample_ids(ids, 5, 0, 1)
    with pytest.raises(ValueError, match=r"\[2, 5\) is outside the step's 4 microbatches"):
        pipeline_sample_ids(ids, 3, 2, 3)
    with pytest.raises(ValueError, match="step must be >= 0"):
        GlobalBatchSampler(100, 12, 0).sample_ids(-1)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        GlobalBatchSampler(0, 12, 0)
    assert contiguous_slices([3, 5, 2]) == [(0, 3), (3, 5), (8, 2)]
