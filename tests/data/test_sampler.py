"""GlobalBatchSampler: determinism, epochs, the bijection, the resume cursor, and independence of the
pipeline split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.data import GlobalBatchSampler, contiguous_slices, pipeline_sample_ids
from oobleck_slurm.data.sampler import SAMPLER_VERSION, Bijection


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
    assert s.passes(steps - 1) == [-(-steps * batch // num_samples)]


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
    with pytest.raises(ValueError, match="precedes step 5, where this data stream resumed"):
        GlobalBatchSampler(100, 12, 0, origin=(5, 60)).sample_ids(4)
    with pytest.raises(ValueError, match="seed must be in"):
        GlobalBatchSampler(100, 12, -1)
    assert contiguous_slices([3, 5, 2]) == [(0, 3), (3, 5), (8, 2)]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), key=st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 50), st.integers(0, 10**6)))
def test_bijection_is_a_permutation_of_range_n(n: int, key: tuple[int, int, int]) -> None:
    image = Bijection(n, key)(np.arange(n))
    assert image.dtype == np.int64 and np.array_equal(np.sort(image), np.arange(n))


def test_bijection_every_small_size_and_keys_differ() -> None:
    for n in range(1, 300):  # every size, odd bit counts and powers of two among them
        assert sorted(Bijection(n, (7, 0, 0))(np.arange(n)).tolist()) == list(range(n))
    a, b = Bijection(10_000, (1, 0, 0))(np.arange(10_000)), Bijection(10_000, (1, 0, 1))(np.arange(10_000))
    assert np.mean(a == b) < 0.01  # another pass, another order
    assert abs(np.corrcoef(np.arange(10_000), a)[0, 1]) < 0.05  # no visible trace of the input order
    with pytest.raises(ValueError, match="outside"):
        Bijection(10, (0,))(np.array([10]))


def test_open_and_any_step_are_o1_at_pretraining_scale() -> None:
    import time

    t0 = time.perf_counter()
    s = GlobalBatchSampler(244_140_625, 512, seed=0)  # 1T tokens at seq 4096
    ids = [s.sample_ids(k) for k in (0, 244_140_625 // 512, 10**9)]  # first, the one crossing a pass, far away
    assert time.perf_counter() - t0 < 1.0
    assert all(len(np.unique(i)) == 512 and i.min() >= 0 and i.max() < 244_140_625 for i in ids)
    assert SAMPLER_VERSION == 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), b_old=st.integers(1, 40), b_new=st.integers(1, 40), s0=st.integers(0, 30),
       seed=st.integers(0, 2**31))
def test_batch_change_resumes_at_the_cursor_with_no_gap_and_no_repeat(n, b_old, b_new, s0, seed) -> None:
    old = GlobalBatchSampler(n, b_old, seed)
    before = np.concatenate([old.sample_ids(k) for k in range(s0)] or [np.empty(0, np.int64)])
    cursor = old.cursor(s0)
    new = GlobalBatchSampler(n, b_new, seed, origin=(s0, cursor))
    after = np.concatenate([new.sample_ids(k) for k in range(s0, s0 + 5)])
    whole = old.stream_ids(np.arange(cursor + 5 * b_new))  # the one stream both read from
    assert np.array_equal(np.concatenate([before, after]), whole)
