"""What the supervisor does about a flagged machine or a straggler (detection/health.py, pure)."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.detection import Flag, Straggler
from oobleck_slurm.detection.health import (
    FAULTY_METRICS,
    REBALANCE_CHANGE,
    STRAGGLER,
    STRAGGLER_MODES,
    Evict,
    HealthPolicy,
    Rebalance,
    Report,
)
from oobleck_slurm.recipe.schema import DetectionConfig


def slow(factor: float, rank: int = 0) -> Straggler:
    return Straggler(rank, factor, 0.01 * factor, 0.01, factor)


FLAG = Flag("node2", 100.0, 99.0, ("procs.cpu_pct", "mem.used_pct"), 6.25)


def test_a_flagged_machine_is_evicted_or_only_reported() -> None:
    evict = HealthPolicy(evict=True).flagged(FLAG, 4.5)
    assert isinstance(evict, Evict) and evict.node == "node2" and evict.cause == FAULTY_METRICS
    assert evict.evidence == {"metrics": ["procs.cpu_pct", "mem.used_pct"], "score": 6.25, "since": 99.0}
    assert "procs.cpu_pct, mem.used_pct" in evict.detail and "6.2" in evict.detail
    report = HealthPolicy(evict=False).flagged(FLAG, 4.5)
    assert isinstance(report, Report) and (report.node, report.cause, report.detail) == (
        evict.node, evict.cause, evict.detail)


@pytest.mark.parametrize("mode, kind", [("evict", Evict), ("report", Report)])
def test_stragglers_evicted_or_reported_once_until_they_recover(mode: str, kind: type) -> None:
    policy = HealthPolicy(stragglers=mode, threshold=1.3)
    assert policy.stragglers({"a": slow(1.0), "b": slow(1.29)}, 0) == []
    (d,) = policy.stragglers({"a": slow(1.0), "b": slow(1.5, rank=3)}, 0)
    assert isinstance(d, kind) and d.node == "b" and d.cause == STRAGGLER
    assert d.evidence["rank"] == 3 and d.evidence["slowdown"] == 1.5 and "1.50x" in d.detail
    assert policy.stragglers({"b": slow(1.6)}, 1) == []  # decided already, whatever the generation
    assert policy.stragglers({"b": slow(1.2)}, 1) == []  # under threshold, above release (1.15): still acted on
    assert policy.stragglers({"b": slow(1.4)}, 1) == []
    assert policy.stragglers({"b": slow(1.1)}, 1) == []  # recovered
    assert [x.node for x in policy.stragglers({"b": slow(1.4)}, 1)] == ["b"]  # slow again: news
    policy.forget("b")
    assert [x.node for x in policy.stragglers({"b": slow(1.4)}, 1)] == ["b"]


@pytest.mark.parametrize("mode", ["rebalance", "evict", "report"])
def test_a_straggler_must_last_confirm_judgements(mode: str) -> None:
    policy = HealthPolicy(stragglers=mode, threshold=1.3, confirm=3)
    for _ in range(2):  # a window's median over the threshold for a moment: nothing
        assert policy.stragglers({"a": slow(1.0), "b": slow(1.4)}, 0) == []
    assert policy.stragglers({"a": slow(1.0), "b": slow(1.2)}, 0) == []  # the count starts again
    assert policy.stragglers({"b": slow(1.4)}, 0) == [] and policy.stragglers({"b": slow(1.4)}, 0) == []
    (d,) = policy.stragglers({"b": slow(1.4)}, 0)  # the third in a row
    assert (getattr(d, "node", None) or next(iter(d.slowdown))) == "b"
    assert policy.stragglers({}, 0) == []  # not judged: no count lost, no new decision
    with pytest.raises(ValueError, match="confirm"):
        HealthPolicy(confirm=0)


def test_off_decides_nothing() -> None:
    assert HealthPolicy(stragglers="off").stragglers({"a": slow(5.0)}, 0) == []


def test_rebalance_with_hysteresis_and_after_every_new_plan() -> None:
    policy = HealthPolicy(stragglers="rebalance", threshold=1.3)
    assert policy.stragglers({"a": slow(1.0), "b": slow(1.25)}, 0) == []
    (d,) = policy.stragglers({"a": slow(1.0), "b": slow(2.0)}, 0)
    assert isinstance(d, Rebalance) and d.slowdown == {"b": 2.0} and "b: rank 0 computes 2.00x" in d.detail
    assert policy.stragglers({"b": slow(2.2)}, 0) == []  # within REBALANCE_CHANGE: the same decision
    assert policy.stragglers({}, 0) == []  # b not judged (early in a generation): kept
    # A new generation (the rebalanced plan, or a failure's plan that split the batch afresh): said again.
    (again,) = policy.stragglers({"b": slow(2.1)}, 1)
    assert again.slowdown == {"b": 2.0}
    assert policy.stragglers({"b": slow(2.1)}, 1) == []
    (moved,) = policy.stragglers({"b": slow(3.5)}, 1)  # much slower now: a new factor
    assert moved.slowdown == {"b": 3.5} and "3.50x" in moved.detail
    # Under the threshold, above the release: it stays, at the factor it had (with fewer microbatches
    # a time-shared node's stalls fall into its waits: it looks faster than it is).
    assert policy.stragglers({"b": slow(1.2)}, 1) == []
    assert policy.stragglers({"b": slow(1.16)}, 1) == [] and policy.applied == {"b": 3.5}
    (back,) = policy.stragglers({"b": slow(1.1)}, 1)  # under the release (1.15): the plain split
    assert back.slowdown == {} and "plain split" in back.detail
    assert policy.stragglers({"b": slow(1.1)}, 2) == []  # nothing to re-assert on a new plan


def test_a_rebalanced_node_leaves_only_after_confirm_judgements_under_the_release() -> None:
    """The `slow` drill's pattern: once its pipeline has fewer microbatches the node measures near 1
    now and then; one such judgement does not give it its microbatches back."""
    policy = HealthPolicy(threshold=1.3, confirm=3)
    for _ in range(2):
        assert policy.stragglers({"b": slow(2.5)}, 0) == []  # not confirmed yet
    (d,) = policy.stragglers({"b": slow(2.5)}, 0)
    assert d.slowdown == {"b": 2.5}
    for factor in (1.1, 1.12, 1.4, 1.1, 1.05):  # never 3 judgements in a row under the release
        assert policy.stragglers({"b": slow(factor)}, 0) == []
    assert policy.applied == {"b": 2.5}
    (back,) = policy.stragglers({"b": slow(1.0)}, 0)  # the third in a row
    assert back.slowdown == {}


def test_a_lost_node_drops_out_of_the_rebalance() -> None:
    policy = HealthPolicy(threshold=1.3)
    policy.stragglers({"a": slow(2.0), "b": slow(1.6)}, 0)
    policy.forget("a")
    assert policy.applied == {"b": 1.6}
    assert policy.stragglers({"b": slow(1.6)}, 0) == []


@settings(max_examples=300, deadline=None)
@given(series=st.lists(st.dictionaries(st.sampled_from("abc"), st.floats(0.5, 4.0)), min_size=1, max_size=30),
       gens=st.lists(st.integers(0, 3), min_size=30, max_size=30))
def test_rebalance_invariants(series: list[dict[str, float]], gens: list[int]) -> None:
    """Whatever the slowdowns: every node decided on was over the threshold when it entered, and is
    over the release while it stays; a decision is made only on a change or a new generation."""
    policy = HealthPolicy(threshold=1.3)
    last_gen = None
    gens = sorted(gens)  # generations only go up
    for sample, gen in zip(series, gens):
        before = dict(policy.applied)
        decisions = policy.stragglers({n: slow(f) for n, f in sample.items()}, gen)
        after = policy.applied
        for node in after:
            if node not in before:
                assert sample[node] >= 1.3
            elif node in sample:
                assert sample[node] >= policy.release
                assert after[node] >= before[node]  # a factor never shrinks while its node stays
        for node in set(before) - set(after):
            assert node in sample and sample[node] < policy.release
        if decisions:
            (d,) = decisions
            assert dict(d.slowdown) == after
            changed = set(after) != set(before) or any(
                max(after[n], before[n]) / min(after[n], before[n]) > REBALANCE_CHANGE for n in after)
            assert changed or gen != last_gen
        else:
            assert set(after) == set(before)
        if decisions:
            last_gen = gen


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="stragglers"):
        HealthPolicy(stragglers="rebalanced")
    with pytest.raises(ValueError, match="threshold"):
        HealthPolicy(threshold=1.0)


def test_every_mode_is_a_recipe_value() -> None:
    assert set(STRAGGLER_MODES) == set(typing.get_args(typing.get_type_hints(DetectionConfig)["stragglers"]))


def test_by_default_a_flagged_machine_is_only_reported() -> None:
    """Eviction on metrics is opt-in (docs/detection.md#what-has-been-validated): the detector has never
    judged a real machine's counters or NVML, and a false alarm would evict a healthy node."""
    assert DetectionConfig().evict is False
    assert isinstance(HealthPolicy().flagged(FLAG, 4.5), Report)


def test_no_shipped_recipe_evicts_on_metrics() -> None:
    from pathlib import Path

    from oobleck_slurm.recipe import load_recipe

    recipes = sorted((Path(__file__).resolve().parents[2] / "recipes").rglob("*.yaml"))
    assert recipes
    assert load_recipe().detection.evict is False  # the embedded default
    for path in recipes:
        assert load_recipe(path).detection.evict is False, path
