"""Each template optimised for the microbatches its pipelines run, and the cross-pipeline all-reduce
overlapped with the last microbatch's backward as the engine does it (cost module doc)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from bruteforce import best_template_brute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_helpers import make_profile, random_profile

from oobleck_slurm.planning import cost, instantiate
from oobleck_slurm.planning.pregenerate import PlanRequest
from oobleck_slurm.planning.profile import Link
from oobleck_slurm.planning.templates import generate_templates, template_from_stages


def _one_stage_plan(allreduce_s: float):
    """Two one-device pipelines of three layers (backward 0.02 s each, 250 gradient bytes each), on a
    network that all-reduces one layer's gradient between two pipelines in `allreduce_s`."""
    profile = make_profile([0.03] * 3, inter=Link(0.0, 250 / allreduce_s))
    t = template_from_stages(profile, 1, [(0, 3, 0, 1)], 2)
    return profile, instantiate([t], 2, 1, 4, profile=profile)


def test_all_reduces_hide_behind_the_backward_of_the_layers_below():
    # Layer 2 is ready 0.04 s before the end (layers 1 and 0 still in backward), layer 1 0.02 s before:
    # each all-reduce (0.015 s) ends before the next layer's is ready; only layer 0's is exposed.
    profile, plan = _one_stage_plan(0.015)
    assert math.isclose(plan.sync_time_s, 0.015)
    # The old charge, everything after the step, was three times that.
    assert cost.sync_time(profile, [cost.sync_bytes(profile, 0, 3, 1)], 2) > 2.9 * plan.sync_time_s


def test_a_devices_all_reduces_run_one_after_another():
    # 0.03 s each: layer 2's ends 0.01 s before the end, layer 1's waits for it (ends at +0.02), then layer 0.
    _, plan = _one_stage_plan(0.03)
    assert math.isclose(plan.sync_time_s, 0.05)


def test_layers_of_other_stages_do_not_queue_and_a_boundary_adds_to_the_window():
    profile = make_profile([0.03] * 3, devices_per_node=2, inter=Link(0.0, 250 / 0.03))
    stages = [(0, 2, 0, 1), (2, 3, 1, 1)]
    t = template_from_stages(profile, 1, stages, 2)
    end = cost.sync_end(profile, [(stages, 1.0)], 2)
    # Layer 2 (its own device) ends before layer 1 is ready; layer 1 starts when ready (1 - 0.02), not
    # behind layer 2; layer 0 waits for layer 1: 0.04 s exposed, where one stage of the three had 0.05.
    assert math.isclose(end, max(1.0 - 0.02 + 0.03, 1.0) + 0.03)
    assert math.isclose(instantiate([t], 2, 1, 4, profile=profile).sync_time_s, 0.04)
    # Layer 2's gradient is complete before the backward of layers 1 and 0 and the transfer between the
    # stages: with a 40x larger layer 2 (1.2 s all-reduce) the step ends 1.2 s after that point.
    big = make_profile([0.03] * 3, devices_per_node=2, state=[1000, 1000, 40_000], intra=Link(0.1, 1e10),
                       inter=Link(0.0, 250 / 0.03))
    transfer = cost.p2p_time(big.link("intra_node"), big.layers[1].output_bytes)
    assert math.isclose(cost.sync_end(big, [(stages, 1.0)], 2), 1.0 - 0.04 - transfer + 1.2)


def test_one_pipeline_has_nothing_to_all_reduce():
    profile = make_profile([0.03] * 3)
    t = template_from_stages(profile, 1, [(0, 3, 0, 1)], 2)
    assert instantiate([t], 1, 0, 4, profile=profile).sync_time_s == 0.0


def test_a_template_is_optimised_for_the_microbatches_its_pipelines_run():
    request = PlanRequest(max_nodes=8, failures=1, global_microbatches=128, microbatch_size=4)
    assert request.num_microbatches == 64  # memory: the most a pipeline may run after failures
    assert request.microbatches_by_nodes == {n: 16 * n for n in range(1, 9)}
    assert replace(request, global_microbatches=5).template_microbatches(1) == 1
    assert replace(request, global_microbatches=12).template_microbatches(3) == 5  # ceil(12 * 3 / 8)
    profile = random_profile(random.Random(3), 8, 2, tight_memory=False)
    templates = generate_templates(profile, 3, num_microbatches=64, microbatches_by_nodes={1: 2, 2: 5, 3: 64})
    assert [(t.num_nodes, t.num_microbatches) for t in templates] == [(1, 2), (2, 5), (3, 64)]
    for t in templates:
        assert math.isclose(t.iteration_time_s, t.latency(t.num_microbatches))
        assert t.memory_microbatches == (None if t.num_microbatches == 64 else 64)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_layers=st.integers(1, 6),
    devices_per_node=st.sampled_from([1, 2, 4]),
    max_stage_devices=st.sampled_from([1, 2, 4]),
    memory_microbatches=st.integers(1, 9),
    counts=st.lists(st.integers(1, 12), min_size=3, max_size=3),
    tight=st.booleans(),
)
def test_per_size_counts_stay_exact(seed, n_layers, devices_per_node, max_stage_devices, memory_microbatches,
                                    counts, tight):
    profile = random_profile(random.Random(seed), n_layers, devices_per_node, tight)
    profile = replace(profile, microbatch_size=2)
    max_nodes = max(1, min(3, 6 // devices_per_node))
    by_nodes = {n: counts[n - 1] for n in range(1, max_nodes + 1)}
    found = {t.num_nodes: t for t in generate_templates(
        profile, max_nodes, num_microbatches=memory_microbatches, microbatches_by_nodes=by_nodes,
        max_stage_devices=max_stage_devices)}
    for n in range(1, max_nodes + 1):
        best = best_template_brute(profile, n, by_nodes[n], max_stage_devices, memory_microbatches)
        if best is None:
            assert n not in found
            continue
        assert n in found and found[n].num_microbatches == by_nodes[n]
        assert math.isclose(found[n].iteration_time_s, best.iteration_time_s, rel_tol=1e-9)
        assert found[n].max_memory_bytes <= cost.usable_memory(profile)
