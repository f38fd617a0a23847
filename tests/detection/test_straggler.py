"""Stragglers from compute-only timings (MegaScale): step times cannot show them, compute times do."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.detection import Straggler, StragglerWatch, find_stragglers
from oobleck_slurm.detection.straggler import slowdowns


def test_straggler_is_found_from_compute_times_not_step_times() -> None:
    rng = np.random.default_rng(0)
    compute = {rank: list(0.10 + rng.normal(0, 0.003, 8)) for rank in range(8)}
    compute[5] = list(0.16 + rng.normal(0, 0.003, 8))
    (s,) = find_stragglers(compute)
    assert isinstance(s, Straggler) and s.rank == 5 and s.slowdown == pytest.approx(1.6, rel=0.05)
    assert s.peers_median_s == pytest.approx(0.10, rel=0.05)
    assert find_stragglers({r: compute[r] for r in range(8) if r != 5}) == []
    # Step times are the same everywhere (the all-reduce waits for the slowest): nothing to see there.
    steps = {rank: [0.9] * 8 for rank in range(8)}
    assert find_stragglers(steps) == []


def test_peers_are_ranks_with_the_same_work() -> None:
    # Stage A is twice as heavy as stage B: not a straggler, just more work.
    compute = {0: [0.2] * 5, 1: [0.2] * 5, 2: [0.1] * 5, 3: [0.1] * 5, 4: [0.14] * 5}
    work = {0: "A", 1: "A", 2: "B", 3: "B", 4: "B"}
    assert [s.rank for s in find_stragglers(compute, work=work)] == [4]
    # With the profile's expected times, ranks of different stages compare directly.
    expected = {0: 0.2, 1: 0.2, 2: 0.1, 3: 0.1, 4: 0.1}
    (s,) = find_stragglers(compute, expected_s=expected)
    assert s.rank == 4 and s.slowdown == pytest.approx(1.4) and s.median_s == pytest.approx(0.14)


def test_two_peers_suffice_and_few_samples_are_not_judged() -> None:
    assert [s.rank for s in find_stragglers({"a": [1.0] * 3, "b": [1.5] * 3})] == ["b"]
    assert find_stragglers({"a": [1.0] * 2, "b": [1.5] * 2}) == []
    with pytest.raises(ValueError):
        find_stragglers({}, threshold=1.0)


@settings(max_examples=50, deadline=None)
@given(ranks=st.integers(3, 64), slow=st.floats(1.35, 3.0), seed=st.integers(0, 10**6))
def test_one_slow_rank_among_many_is_found_with_its_ratio(ranks: int, slow: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compute = {r: list(0.05 * (1 + rng.normal(0, 0.01, 10))) for r in range(ranks)}
    victim = int(rng.integers(ranks))
    compute[victim] = [x * slow for x in compute[victim]]
    found = find_stragglers(compute)
    assert [s.rank for s in found] == [victim]
    assert found[0].slowdown == pytest.approx(slow, rel=0.05)


def test_watch_keeps_a_window_and_restarts_on_new_work() -> None:
    watch = StragglerWatch(window=10, threshold=1.3, min_samples=5)
    for i in range(20):
        for rank in range(4):
            watch.report(rank, 0.1 * (1.5 if rank == 2 and i >= 10 else 1.0), work="stage0")
    assert [s.rank for s in watch.stragglers()] == [2]
    watch.report(2, 0.1, work="stage1")  # a new plan: old timings no longer describe its work
    assert watch.stragglers() == []
    watch.forget(2)
    assert watch.stragglers() == []


def naive_slowdowns(compute: dict[int, list[float]], min_samples: int) -> dict[int, tuple[float, float]]:
    """The definition, rank by rank: each timing over the median of the other ranks' of the same step."""
    import statistics

    out = {}
    for rank, mine in compute.items():
        ratios = []
        for back in range(1, len(mine) + 1):
            peers = [compute[r][-back] for r in compute if r != rank and len(compute[r]) >= back]
            if peers:
                ratios.append(mine[-back] / statistics.median(peers))
        if len(mine) >= min_samples and len(ratios) >= min_samples:
            ratios.reverse()  # oldest first, as the window holds them
            out[rank] = (statistics.median(ratios), statistics.median(ratios[len(ratios) // 2:]))
    return out


@settings(max_examples=150, deadline=None)
@given(compute=st.dictionaries(st.integers(0, 6), st.lists(st.floats(0.01, 1.0), max_size=8), max_size=6),
       min_samples=st.integers(1, 4))
def test_vectorised_slowdowns_follow_the_definition(compute: dict[int, list[float]], min_samples: int) -> None:
    got = {r: (s.slowdown, s.recent_slowdown) for r, s in slowdowns(compute, min_samples).items()}
    want = naive_slowdowns(compute, min_samples)
    assert got.keys() == want.keys()
    for rank, (slowdown, recent) in want.items():
        assert got[rank] == pytest.approx((slowdown, recent), rel=1e-12)
