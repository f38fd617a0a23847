"""Straggler rebalancing (planning/reconfigure.py `rebalance`): the same pipelines and nodes, the global
batch redistributed so that a slow pipeline gets fewer microbatches; exact against enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.planning.instantiate import PipelinePlan, Plan
from oobleck_slurm.planning.reconfigure import pipeline_slowdowns, rebalance
from oobleck_slurm.planning.templates import PipelineTemplate, PlanningError, StageTemplate


def fake_template(nodes: int, stage_times: list[float]) -> PipelineTemplate:
    stages = tuple(StageTemplate(i, i + 1, i, 1, w, 0.0) for i, w in enumerate(stage_times))
    return PipelineTemplate(nodes, max(1, len(stage_times) // nodes), 4, stages, 0.0)


def even_plan(templates: list[PipelineTemplate], batch: int, spares: tuple[str, ...] = ()) -> Plan:
    """Pipelines on nodes n0, n1, ... with some split (rebalance must not depend on it)."""
    pipelines, node, first = [], 0, 0
    shares = [batch // len(templates) + (i < batch % len(templates)) for i in range(len(templates))]
    for t, nb in zip(templates, shares):
        nodes = tuple(f"n{node + k}" for k in range(t.num_nodes))
        pipelines.append(PipelinePlan(t, nodes, nb, first))
        node, first = node + t.num_nodes, first + nb
    return Plan(tuple(pipelines), spares, batch, 2, 0.5)


def slowest(plan: Plan, slowdown: dict[int, float], counts: tuple[int, ...] | list[int]) -> float:
    return max(slowdown.get(i, 1.0) * p.template.latency(c) for i, (p, c) in enumerate(zip(plan.pipelines, counts)))


times = st.floats(0.01, 1.0, allow_nan=False)
factors = st.floats(1.0, 4.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(pipes=st.lists(st.tuples(st.integers(1, 2), times, times, factors), min_size=1, max_size=4),
       extra=st.integers(0, 7))
def test_the_split_is_the_best_one_and_everything_else_is_kept(pipes, extra) -> None:
    templates = [fake_template(n, [a, b] * n) for n, a, b, _ in pipes]
    batch = len(templates) + extra
    plan = even_plan(templates, batch, spares=("spare1",))
    slowdown = {i: f for i, (*_, f) in enumerate(pipes) if f > 1.0}
    new = rebalance(plan, slowdown)
    counts = [p.microbatches for p in new.pipelines]
    # Every pipeline keeps its template and nodes; the batch is the same, in the same order.
    assert [(p.template, p.nodes) for p in new.pipelines] == [(p.template, p.nodes) for p in plan.pipelines]
    assert (new.spare_nodes, new.global_microbatches, new.microbatch_size, new.sync_time_s) == \
        (plan.spare_nodes, plan.global_microbatches, plan.microbatch_size, plan.sync_time_s)
    assert sum(counts) == batch and min(counts) >= 1
    assert [p.first_microbatch for p in new.pipelines] == [sum(counts[:i]) for i in range(len(counts))]
    # The slowest pipeline (slowed as given) is as fast as the best of all splits.
    best = min(slowest(plan, slowdown, combo) for combo in itertools.product(range(1, batch + 1), repeat=len(templates))
               if sum(combo) == batch)
    assert math.isclose(slowest(plan, slowdown, counts), best, rel_tol=1e-12)
    # The split depends on the slowdowns alone: applying them again changes nothing.
    assert rebalance(new, slowdown) == new


def test_a_straggler_pipeline_gets_fewer_microbatches_and_gets_them_back() -> None:
    t = fake_template(1, [0.1])
    plan = even_plan([t] * 4, 16)
    assert [p.microbatches for p in rebalance(plan, {}).pipelines] == [4, 4, 4, 4]
    slowed = [p.microbatches for p in rebalance(plan, {1: 2.0}).pipelines]
    assert slowed[1] == 2 and sorted(slowed[:1] + slowed[2:]) == [4, 5, 5]  # 0.4 s and 0.5 s: the best
    slowed_plan = rebalance(plan, {1: 2.0})
    assert rebalance(slowed_plan, {}) == rebalance(plan, {})  # the straggler recovered: the plain split again


def test_pipeline_slowdown_is_its_slowest_node() -> None:
    plan = even_plan([fake_template(2, [0.1, 0.1]), fake_template(1, [0.2]), fake_template(1, [0.2])], 8)
    assert [p.nodes for p in plan.pipelines] == [("n0", "n1"), ("n2",), ("n3",)]
    assert pipeline_slowdowns(plan, {"n1": 1.5, "n0": 1.2, "n3": 2.0, "elsewhere": 9.0}) == {0: 1.5, 2: 2.0}
    assert pipeline_slowdowns(plan, {}) == {}


@pytest.mark.parametrize("slowdown", [{4: 2.0}, {-1: 2.0}, {0: 0.0}, {0: -1.0}, {0: math.inf}, {0: math.nan}])
def test_bad_slowdowns_are_refused_with_the_reason(slowdown) -> None:
    plan = even_plan([fake_template(1, [0.1])] * 2, 4)
    with pytest.raises(PlanningError, match="rebalance"):
        rebalance(plan, slowdown)
