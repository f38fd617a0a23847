"""Exact templates: the DP's optimum equals brute-force enumeration on every small case."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from bruteforce import best_template_brute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_helpers import make_profile, random_profile

from oobleck_slurm.planning import cost
from oobleck_slurm.planning.templates import (
    PipelineTemplate,
    PlanningError,
    explain_infeasible,
    generate_templates,
    template_from_stages,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_layers=st.integers(1, 6),
    devices_per_node=st.sampled_from([1, 2, 4, 6]),
    max_stage_devices=st.sampled_from([1, 2, 3, 4, 6]),
    num_microbatches=st.integers(1, 9),
    tight=st.booleans(),
    microbatch_size=st.sampled_from([1, 2, 3, 4]),
)
def test_same_optimum_as_brute_force(seed, n_layers, devices_per_node, max_stage_devices, num_microbatches, tight,
                                     microbatch_size):
    """Widths included: sharded stages of every divisor of the node's devices (up to the bound), placed
    anywhere inside a node, with microbatches that split evenly, unevenly or not at all."""
    profile = random_profile(random.Random(seed), n_layers, devices_per_node, tight)
    profile = replace(profile, microbatch_size=microbatch_size)
    max_nodes = max(1, min(3, 6 // devices_per_node))
    found = {
        t.num_nodes: t
        for t in generate_templates(profile, max_nodes, num_microbatches=num_microbatches, max_stage_devices=max_stage_devices)
    }
    for n in range(1, max_nodes + 1):
        best = best_template_brute(profile, n, num_microbatches, max_stage_devices)
        if best is None:
            assert n not in found
            continue
        assert n in found, f"DP missed a feasible template for {n} nodes"
        assert math.isclose(found[n].iteration_time_s, best.iteration_time_s, rel_tol=1e-9)


def test_templates_are_well_formed():
    profile = random_profile(random.Random(7), 12, 4, tight_memory=False)
    templates = generate_templates(profile, 3, num_microbatches=6, max_stage_devices=4)
    assert [t.num_nodes for t in templates] == [1, 2, 3]
    for t in templates:
        assert t.stages[0].start == 0 and t.stages[-1].stop == profile.num_layers
        device = 0
        for a, b in zip(t.stages, t.stages[1:]):
            assert a.stop == b.start  # contiguous layers
        for s in t.stages:
            assert s.first_device == device and 4 % s.devices == 0
            assert s.first_device // 4 == (s.first_device + s.devices - 1) // 4  # within one node
            device += s.devices
        assert device == t.num_devices  # every device holds a stage
        assert t.max_memory_bytes <= cost.usable_memory(profile)
        times = [s.time_s for s in t.stages]
        assert math.isclose(t.iteration_time_s, cost.pipeline_time(times, 6, [s.once_s for s in t.stages]))
        assert math.isclose(t.latency(6), t.iteration_time_s)
        assert PipelineTemplate.from_dict(t.to_dict()) == t


def test_balances_uniform_layers():
    profile = make_profile([0.01] * 8)
    (t,) = generate_templates(profile, 4, 4, num_microbatches=8)
    assert [s.num_layers for s in t.stages] == [2, 2, 2, 2]


def test_memory_forces_more_nodes_and_explains():
    # Each layer holds 1000 bytes of state; 1800 usable bytes per device hold one layer, not two (with
    # its activations and boundary buffers of a few bytes).
    profile = make_profile([0.01] * 4, memory=2000, act=[1] * 4, out=[1] * 4)
    templates = generate_templates(profile, 6, num_microbatches=2)
    assert [t.num_nodes for t in templates] == [4]  # 5, 6 nodes: more devices than layers
    small = make_profile([0.01] * 4, memory=500)
    assert generate_templates(small, 4, num_microbatches=2) == []
    assert "layer 0 (l0) alone needs" in explain_infeasible(small, 2)


def test_scalar_and_dp_cost_agree_on_hand_example():
    # Two nodes of one device: the stage boundary is inter-node, both directions paid by both stages.
    profile = make_profile([0.03, 0.03], out=[1_000_000, 0])
    t = template_from_stages(profile, 2, [(0, 1, 0, 1), (1, 2, 1, 1)], num_microbatches=4)
    link = profile.link("inter_node")
    comm = 2 * (link.latency_s + 1_000_000 / link.bandwidth_Bps)
    assert math.isclose(t.stages[0].time_s, 0.03 + comm) and math.isclose(t.stages[1].time_s, 0.03 + comm)
    assert math.isclose(t.iteration_time_s, 2 * (0.03 + comm) + 3 * (0.03 + comm))
    (dp,) = generate_templates(profile, 2, 2, num_microbatches=4)
    assert math.isclose(dp.iteration_time_s, t.iteration_time_s)


def test_bad_arguments():
    profile = make_profile([0.01] * 2)
    with pytest.raises(PlanningError):
        generate_templates(profile, 2, num_microbatches=0)
    with pytest.raises(PlanningError):
        generate_templates(profile, 1, 2, num_microbatches=1)
