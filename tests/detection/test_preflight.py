"""The pre-flight verdict (detection/preflight.py): a node below a fraction of the fleet's median on any
figure is refused, with a reason naming the figure; too small a fleet judges nothing."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.detection.preflight import ALLREDUCE, LINK, MATMUL, decide, decide_fleet

FLEET = [{MATMUL: 100.0, LINK: 1000.0}, {MATMUL: 110.0, LINK: 900.0}, {MATMUL: 90.0, LINK: 1100.0}]
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)
figures = st.fixed_dictionaries({MATMUL: positive, LINK: positive})


def test_a_node_as_fast_as_the_fleet_is_admitted_with_the_medians() -> None:
    verdict = decide(FLEET, {MATMUL: 95.0, LINK: 1000.0}, 0.5)
    assert verdict.admit and verdict.reason == ""
    assert verdict.medians == {MATMUL: 100.0, LINK: 1000.0}


def test_a_slow_matmul_is_refused_with_its_figure_and_the_median() -> None:
    verdict = decide(FLEET, {MATMUL: 30.0, LINK: 1000.0}, 0.5)
    assert not verdict.admit
    assert verdict.reason.startswith("matmul 30 GFLOP/s is 0.30 x the fleet's median 100")
    assert "link" not in verdict.reason


def test_a_slow_link_is_refused_too_and_both_are_named() -> None:
    verdict = decide(FLEET, {MATMUL: 10.0, LINK: 100.0}, 0.5)
    assert not verdict.admit and "matmul" in verdict.reason and "link to the supervisor 100 MiB/s" in verdict.reason


def test_the_threshold_is_inclusive_of_the_fraction() -> None:
    assert decide(FLEET, {MATMUL: 80.0, LINK: 800.0}, 0.8).admit
    assert not decide(FLEET, {MATMUL: 79.9, LINK: 800.0}, 0.8).admit


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_broken_measurement_is_refused(bad: float) -> None:
    verdict = decide(FLEET, {MATMUL: bad, LINK: 1000.0}, 0.5)
    assert not verdict.admit and verdict.reason.startswith("matmul measured")


def test_too_small_a_fleet_admits_and_says_what_was_not_judged() -> None:
    verdict = decide(FLEET[:2], {MATMUL: 1.0, LINK: 1.0}, 0.9)
    assert verdict.admit and verdict.medians == {}
    assert verdict.reason == "not judged: link to the supervisor (2 of 3 nodes measured), matmul (2 of 3 nodes measured)"


def test_a_figure_only_some_nodes_measure_is_judged_where_the_fleet_has_enough() -> None:
    # The all-reduce of >= 2 GPUs: a fleet of one-GPU nodes has none; a candidate with it is not judged on it.
    verdict = decide(FLEET, {MATMUL: 100.0, LINK: 1000.0, ALLREDUCE: 1.0}, 0.5)
    assert verdict.admit and "intra-node all-reduce (0 of 3" in verdict.reason
    fleet = [{**f, ALLREDUCE: 100.0} for f in FLEET]
    assert not decide(fleet, {MATMUL: 100.0, LINK: 1000.0, ALLREDUCE: 10.0}, 0.5).admit
    assert decide(fleet, {MATMUL: 100.0, LINK: 1000.0}, 0.5).admit  # a candidate without it: not judged on it


def test_unusable_fleet_figures_are_left_out_of_the_median() -> None:
    fleet = [*FLEET, {MATMUL: math.nan, LINK: 0.0}]
    assert decide(fleet, {MATMUL: 100.0, LINK: 1000.0}, 0.5).medians == {MATMUL: 100.0, LINK: 1000.0}


@pytest.mark.parametrize(("fraction", "nodes"), [(0.0, 3), (1.5, 3), (-0.1, 3), (0.5, 0)])
def test_bad_settings_are_refused(fraction: float, nodes: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        decide(FLEET, {MATMUL: 1.0}, fraction, nodes)


@settings(max_examples=300, deadline=None)
@given(st.lists(figures, min_size=0, max_size=9), figures, st.floats(min_value=0.01, max_value=1.0))
def test_the_verdict_is_the_definition(fleet: list[dict[str, float]], candidate: dict[str, float],
                                       fraction: float) -> None:
    verdict = decide(fleet, candidate, fraction)
    if len(fleet) < 3:
        assert verdict.admit and verdict.medians == {} and verdict.reason.startswith("not judged")
        return
    medians = {n: statistics.median(f[n] for f in fleet) for n in (MATMUL, LINK)}
    assert verdict.medians == medians
    slow = [n for n in (MATMUL, LINK) if candidate[n] < fraction * medians[n]]
    assert verdict.admit == (not slow)
    for name, label in ((MATMUL, "matmul"), (LINK, "link to the supervisor")):
        assert (label in verdict.reason) == (name in slow)


@settings(max_examples=200, deadline=None)
@given(figures, st.floats(min_value=1.0, max_value=1e3), st.floats(min_value=0.05, max_value=1.0))
def test_a_faster_candidate_is_never_refused_where_a_slower_is_admitted(candidate: dict[str, float], factor: float,
                                                                         fraction: float) -> None:
    faster = {n: v * factor for n, v in candidate.items()}
    if decide(FLEET, candidate, fraction).admit:
        assert decide(FLEET, faster, fraction).admit


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["n1", "n2", "n3", "n4", "n5"]), figures, min_size=3),
       st.floats(min_value=0.01, max_value=1.0))
def test_at_the_start_the_median_member_is_always_admitted(measured: dict[str, dict[str, float]],
                                                          fraction: float) -> None:
    verdicts = decide_fleet(measured, fraction)
    assert set(verdicts) == set(measured)
    for name in (MATMUL, LINK):  # a member at or above the median on every figure passes
        median = statistics.median(f[name] for f in measured.values())
        for node, f in measured.items():
            if f[name] < fraction * median:
                assert not verdicts[node].admit


def test_at_the_start_one_slow_member_of_four_is_refused() -> None:
    measured = {f"n{i}": {MATMUL: 100.0 + i, LINK: 1000.0} for i in range(3)} | {"n3": {MATMUL: 33.0, LINK: 1000.0}}
    verdicts = decide_fleet(measured, 0.5)
    assert [n for n, v in verdicts.items() if not v.admit] == ["n3"]
