"""Instantiation and batch distribution: exact against enumeration; the coverage guarantee holds."""

from __future__ import annotations

import itertools
import math

import pytest
from bruteforce import best_counts_brute
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_helpers import make_profile

from oobleck_slurm.planning.instantiate import Plan, choose_counts, distribute_batch, fluid_time, instantiate
from oobleck_slurm.planning.templates import PipelineTemplate, PlanningError, StageTemplate, generate_templates


def fake_template(nodes: int, stage_times: list[float]) -> PipelineTemplate:
    """A template with given stage times (instantiation only reads the times and the size)."""
    stages = tuple(StageTemplate(i, i + 1, i, 1, w, 0.0) for i, w in enumerate(stage_times))
    return PipelineTemplate(nodes, len(stage_times) // nodes, 4, stages, 0.0)


times = st.floats(0.01, 1.0, allow_nan=False)
templates_st = st.lists(
    st.tuples(st.integers(1, 4), st.lists(times, min_size=1, max_size=3)), min_size=1, max_size=3,
    unique_by=lambda x: x[0],
).map(lambda xs: [fake_template(n, ws * n) for n, ws in xs])


@settings(max_examples=120, deadline=None)
@given(templates=templates_st, nodes=st.integers(1, 10), f=st.integers(0, 3), batch=st.integers(1, 12),
       use_all=st.booleans())
def test_counts_match_brute_force(templates, nodes, f, batch, use_all):
    brute = best_counts_brute(templates, nodes, f + 1, batch, use_all_nodes=use_all)
    if brute is None:
        with pytest.raises(PlanningError):
            choose_counts(templates, nodes, f + 1, batch, use_all_nodes=use_all)
        return
    counts = choose_counts(templates, nodes, f + 1, batch, use_all_nodes=use_all)
    chosen = [t for c, t in zip(counts, templates) for _ in range(c)]
    used = sum(t.num_nodes for t in chosen)
    assert used <= nodes and len(chosen) >= f + 1 and len(chosen) <= batch
    assert not use_all or used == nodes
    assert math.isclose(fluid_time(chosen, batch), brute[0], rel_tol=1e-9)


@settings(max_examples=150, deadline=None)
@given(pipes=st.lists(st.tuples(times, times), min_size=1, max_size=4), extra=st.integers(0, 8))
def test_batch_distribution_is_optimal(pipes, extra):
    templates = [fake_template(1, [a, b]) for a, b in pipes]
    batch = len(templates) + extra
    counts = distribute_batch(templates, batch)
    assert sum(counts) == batch and min(counts) >= 1
    worst = max(t.latency(c) for t, c in zip(templates, counts))
    best = min(
        max(t.latency(c) for t, c in zip(templates, combo))
        for combo in itertools.product(range(1, batch + 1), repeat=len(templates))
        if sum(combo) == batch
    )
    assert math.isclose(worst, best, rel_tol=1e-12)


def test_faster_pipelines_get_more_microbatches():
    fast, slow = fake_template(1, [0.1]), fake_template(1, [0.3])
    assert distribute_batch([fast, slow], 8) == [6, 2]


@pytest.mark.parametrize("f", [0, 1, 2])
def test_coverage_every_node_count_from_f_plus_1_times_n0(f):
    # A model that needs 2 nodes (memory): n0 = 2; templates 2..3 = n0..2n0-1 cover every N' >= (f+1) n0.
    # (Outputs of 1 byte: the boundary buffers, cost.stage_memory, leave the state as what decides.)
    profile = make_profile([0.01] * 6, memory=2000 * 3 / 0.9 * 1.0001, act=[1] * 6, out=[1] * 6)
    templates = generate_templates(profile, 3, num_microbatches=4)
    assert [t.num_nodes for t in templates] == [2, 3]
    n0 = 2
    for nodes in range((f + 1) * n0, 16):
        plan = instantiate(templates, nodes, f, 64, use_all_nodes=True)
        assert plan.num_pipelines >= f + 1 and plan.nodes_used == nodes and not plan.spare_nodes
        plan = instantiate(templates, nodes, f, 64)  # spares allowed: never slower
        assert plan.num_pipelines >= f + 1
    with pytest.raises(PlanningError, match=r"needs 2 pipelines .* = 4 nodes, but there are 3; at most f=0"):
        instantiate(templates, 3, 1, 64)


def test_plan_slices_are_contiguous_and_serialise():
    profile = make_profile([0.01, 0.02, 0.01, 0.03, 0.01])
    templates = generate_templates(profile, 5, num_microbatches=8)
    plan = instantiate(templates, [f"node{i}" for i in range(9)], 2, 24, microbatch_size=4, profile=profile)
    assert plan.num_pipelines >= 3
    start = 0
    for p in plan.pipelines:
        assert p.first_microbatch == start and p.microbatches >= 1
        assert len(p.nodes) == p.template.num_nodes
        start += p.microbatches
    assert start == 24
    nodes = [n for p in plan.pipelines for n in p.nodes] + list(plan.spare_nodes)
    assert sorted(nodes) == sorted(f"node{i}" for i in range(9))
    assert plan.sync_time_s > 0 and plan.samples_per_s == pytest.approx(96 / plan.step_time_s)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_batch_smaller_than_pipelines_is_refused():
    with pytest.raises(PlanningError, match="at least 3"):
        instantiate([fake_template(1, [0.1])], 8, 2, 2)
