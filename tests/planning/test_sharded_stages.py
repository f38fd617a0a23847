"""Sharded stages (ZeRO-3 inside a stage of g devices of one node): the cost model's terms, the
templates that use them, the data-parallel bound, and the recipe key that keeps `submit` at width 1."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from planning_helpers import make_profile

from oobleck_slurm.planning import cost, instantiate
from oobleck_slurm.planning.profile import Link
from oobleck_slurm.planning.templates import allowed_stage_devices, generate_templates, template_from_stages

FREE = Link(0.0, 1e30)  # a link that costs nothing


def test_widths_are_the_divisors_of_the_node_up_to_the_bound():
    assert allowed_stage_devices(8, 8) == [1, 2, 4, 8]
    assert allowed_stage_devices(6, 6) == [1, 2]  # the engine's shards nest at powers of two only
    assert allowed_stage_devices(8, 8, microbatch_size=4) == [1, 2, 4]  # each device takes whole samples
    assert allowed_stage_devices(8, 1) == [1]


def test_state_is_divided_by_the_width_and_activations_by_the_share_of_the_samples():
    profile = replace(make_profile([0.01] * 4, state=[4000] * 4, act=[800] * 4, out=[80] * 4, workspace=[40] * 4),
                      microbatch_size=4)
    one = cost.stage_memory_terms(profile, 1, 3, 1, 3)
    for g, c in ((2, 1 / 2), (4, 1 / 4), (8, 1 / 4)):  # 8 devices for 4 samples: the busiest runs one
        terms = cost.stage_memory_terms(profile, 1, 3, g, 3)
        for key in ("parameters", "gradients", "optimizer"):
            assert math.isclose(terms[key], one[key] / g)
        for key in ("activations", "stage_outputs", "boundary_gradients", "workspace"):
            assert math.isclose(terms[key], one[key] * c)
        # resharded: two layers' parameters, and two whole gradients (one scattered behind the next's backward)
        layer = profile.layers[1]
        assert terms["gather_buffers"] == 2 * layer.param_bytes + 2 * layer.grad_bytes
        kept = cost.stage_memory_terms(profile, 1, 3, g, 3, keep=True)  # kept: every layer's, whole
        assert kept["gather_buffers"] == 2 * (layer.param_bytes + layer.grad_bytes)
        assert {k: v for k, v in kept.items() if k != "gather_buffers"} == {k: v for k, v in terms.items()
                                                                            if k != "gather_buffers"}
    assert one["gather_buffers"] == 0
    bf16 = replace(profile, dtype="bf16")  # the engine gathers the fp32 master weights as they are
    assert cost.stage_memory_terms(bf16, 1, 3, 2, 3)["gather_buffers"] == 2 * layer.param_bytes + 2 * layer.grad_bytes


def test_free_collectives_leave_the_share_of_the_compute():
    profile = replace(make_profile([0.03] * 4, devices_per_node=4, intra=FREE), microbatch_size=4)
    profile = replace(profile, links={**profile.links, "allreduce_intra": FREE})
    for g in (1, 2, 4):
        assert math.isclose(cost.stage_time(profile, 0, 4, g, 0), 0.12 / g)


def test_collectives_beyond_a_layers_compute_are_exposed_and_the_ends_always():
    link = Link(0.0, 1000.0)  # 1000 B/s: a layer of 1000 parameter bytes gathers in 0.5 s on 2 devices
    profile = replace(make_profile([0.3, 3.0], devices_per_node=2, state=[4000, 4000]), microbatch_size=2)
    profile = replace(profile, links={**profile.links, "allreduce_intra": link})
    a, b = profile.layers
    assert a.param_bytes == a.grad_bytes == 1000
    comm = 3 * 0.5  # two gathers and a scatter of 1000 bytes on 2 devices
    # Layer 0: 0.15 s of compute hides 0.15 of its 1.5 s; layer 1 (1.5 s) hides all of it. The ends: the
    # first forward gather (layer 0), the first backward gather (layer 1), the last scatter (layer 0).
    expected = (0.3 + 3.0) / 2 + (comm - 0.15) + 0.5 + 0.5 + 0.5
    assert math.isclose(cost.stage_time(profile, 0, 2, 2, 0), expected)


def test_a_kept_stage_gathers_once_per_step_and_only_where_it_fits():
    link = Link(0.0, 1000.0)  # a layer of 1000 parameter bytes gathers in 0.5 s on 2 devices
    profile = replace(make_profile([0.3, 3.0], devices_per_node=2, state=[4000, 4000]), microbatch_size=2)
    profile = replace(profile, links={**profile.links, "allreduce_intra": link})
    # Per microbatch: the compute only. Once per step: layer 0's gather (0.5 s, its 0.05 s of forward
    # hides none of the next) exposed, plus layer 0's gather beyond its forward and layer 1's beyond its.
    assert math.isclose(cost.stage_time(profile, 0, 2, 2, 0, keep=True), (0.3 + 3.0) / 2)
    once = 0.5 + (0.5 - 0.05) + max(0.0, 0.5 - 0.5)
    assert math.isclose(cost.stage_once_time(profile, 0, 2, 2, keep=True), once)
    assert cost.stage_once_time(profile, 0, 2, 2, keep=False) == 0.0
    (t,) = [template_from_stages(profile, 1, [(0, 2, 0, 2)], 4)]
    assert t.stages[0].keep and math.isclose(t.iteration_time_s, 4 * (0.3 + 3.0) / 2 + once)
    # Memory for two layers' gathered parameters and gradients (one scattered behind the next's backward)
    # less than a 3-layer stage kept needs: resharded. A 2-layer stage holds as much either way: kept
    three = replace(make_profile([0.3, 3.0, 3.0], devices_per_node=2, state=[4000] * 3), microbatch_size=2)
    kept = cost.stage_memory(three, 0, 3, 2, 1, keep=True)
    resharded = cost.stage_memory(three, 0, 3, 2, 1, keep=False)
    assert resharded < kept
    assert cost.stage_memory(profile, 0, 2, 2, 1, keep=False) == cost.stage_memory(profile, 0, 2, 2, 1, keep=True)
    tight = replace(three, device_memory_bytes=(kept + resharded) / 2 / cost.USABLE_MEMORY_FRACTION)
    (t,) = [template_from_stages(tight, 1, [(0, 3, 0, 2)], 4)]
    assert not t.stages[0].keep and math.isclose(t.stages[0].time_s, cost.stage_time(tight, 0, 3, 2, 0))
    assert not cost.choose_keep(profile, 0, 2, 1, 1)  # one device: nothing to keep


def test_each_device_all_reduces_its_shard_across_pipelines():
    profile = make_profile([0.01] * 4, devices_per_node=4, state=[4000] * 4)
    assert cost.sync_bytes(profile, 0, 4, 4) == cost.sync_bytes(profile, 0, 4, 1) / 4
    (t,) = [template_from_stages(profile, 1, [(0, 4, 0, 4)], 4)]
    plan = instantiate([t], 2, 1, 8, profile=profile)
    # Every layer's shard (1000 / 4 bytes) all-reduces behind the backward of the layers before it but the
    # first layer's, which starts once its gradient is reduce-scattered inside the stage.
    scatter = cost.allgather_time(profile.link("allreduce_intra"), 1000, 4)
    assert math.isclose(plan.sync_time_s, scatter + cost.allreduce_time(profile.link("allreduce_inter"), 250, 2))


def test_one_node_of_eight_devices_can_be_one_stage():
    # Cheap collectives and 8 samples per microbatch: one stage of 8 devices has no bubble and wins.
    profile = replace(make_profile([0.01] * 8, devices_per_node=8, intra=Link(1e-6, 1e12)), microbatch_size=8)
    (t,) = generate_templates(profile, 1, num_microbatches=4, max_stage_devices=8)
    assert [(s.start, s.stop, s.devices) for s in t.stages] == [(0, 8, 8)]
    # One device per stage (what submit plans with): eight stages.
    (t1,) = generate_templates(profile, 1, num_microbatches=4)
    assert [s.devices for s in t1.stages] == [1] * 8 and t1.iteration_time_s > t.iteration_time_s
    # Its devices hold 1/8 of the state and of a microbatch, where the first of eight stages holds
    # four microbatches in flight.
    assert t.max_memory_bytes < t1.max_memory_bytes


def test_a_nodes_only_stage_wider_than_the_microbatch_folds_microbatches():
    # 8 devices, microbatches of 4: a stage of 8 computes 2 microbatches a pass, one sample a device
    assert [cost.stage_fold(4, g) for g in (1, 2, 4, 8)] == [1, 1, 1, 2]
    assert cost.stage_fold(6, 4) == 2 and cost.stage_fold(3, 8) == 8
    profile = replace(make_profile([0.01] * 8, devices_per_node=8, intra=Link(1e-6, 1e12)), microbatch_size=4)
    assert cost.work_fraction(profile, 8) == 1 / 4  # per pass: each device one of a microbatch's 4 samples
    free = replace(profile, links={**profile.links, "allreduce_intra": FREE})
    assert math.isclose(cost.stage_time(free, 0, 8, 8, 0, keep=True), 0.08 / 8)  # per microbatch: 1/8 of it
    (t,) = generate_templates(profile, 1, num_microbatches=4, max_stage_devices=8)
    assert [(s.start, s.stop, s.devices, s.keep) for s in t.stages] == [(0, 8, 8, True)]
    (split,) = generate_templates(profile, 1, num_microbatches=4, max_stage_devices=4)
    assert len(split.stages) > 1 and split.iteration_time_s > t.iteration_time_s  # a bubble
    # only kept: where the gathered layers do not fit, the DP's best of widths 1, 2 and 4 stays
    tight = replace(profile, device_memory_bytes=int(t.max_memory_bytes / cost.USABLE_MEMORY_FRACTION) - 1)
    for t2 in generate_templates(tight, 1, num_microbatches=4, max_stage_devices=8):
        assert all(s.devices <= 4 for s in t2.stages)


def test_a_stage_may_sit_anywhere_inside_a_node_but_never_across_two():
    profile = replace(make_profile([0.01] * 6, devices_per_node=4), microbatch_size=4)
    for t in generate_templates(profile, 3, num_microbatches=4, max_stage_devices=4):
        for s in t.stages:
            assert s.first_device // 4 == (s.first_device + s.devices - 1) // 4


def test_data_parallel_bound():
    profile = replace(make_profile([0.03] * 4, devices_per_node=8, inter=FREE), microbatch_size=4)
    profile = replace(profile, links={**profile.links, "allreduce_inter": FREE})
    assert math.isclose(cost.data_parallel_step(profile, 1, 16), 16 * 0.12)
    assert math.isclose(cost.data_parallel_step(profile, 8, 16), 2 * 0.12)  # 1/N of the batch, no bubble
    slow = replace(profile, links={**profile.links, "allreduce_inter": Link(0.0, 1000.0)})
    assert cost.data_parallel_step(slow, 8, 16) > 2 * 0.12
    with pytest.raises(ValueError):
        cost.data_parallel_step(profile, 0, 16)


def test_recipe_key_defaults_to_the_nodes_gpus_and_must_divide_the_node(tmp_path):
    from oobleck_slurm.planning.pregenerate import plan_request
    from oobleck_slurm.recipe import RecipeError, load_recipe

    base = "name: r\ncluster:\n  backend: slurm\n  nodes: 2\n  gpus_per_node: 8\n"
    path = tmp_path / "r.yaml"
    path.write_text(base)
    # unset: the planner chooses widths up to the node's GPUs (multi-rank NCCL ran them: docs/engine.md)
    assert plan_request(load_recipe(path)).max_stage_devices == 8
    path.write_text(base.replace("  gpus_per_node: 8\n", "  workers_per_node: 4\n"))
    assert plan_request(load_recipe(path)).max_stage_devices == 1  # CPU workers: width 1 unless asked
    path.write_text(base + "model:\n  factory: tests.factory_model:build\n  seq_len: 64\n  vocab_size: 256\n")
    assert plan_request(load_recipe(path)).max_stage_devices == 1  # a factory's layers may draw random numbers
    path.write_text(base + "  max_stage_devices: 4\n")
    assert plan_request(load_recipe(path)).max_stage_devices == 4
    path.write_text(base + "  max_stage_devices: 3\n")
    with pytest.raises(RecipeError, match="max_stage_devices.*must divide the devices per node \\(8\\), got 3"):
        load_recipe(path)


def test_plan_shows_widths_and_the_data_parallel_bound(tmp_path, capsys):
    import json

    from test_commands import run

    from oobleck_slurm.commands import plan

    recipe = "recipes/h100/gpt-1.3b.yaml"
    assert run(plan, [recipe, "--estimate", "H100", "--cache", str(tmp_path), "--max-stage-devices", "3"]) == 2
    assert "--max-stage-devices must divide the devices per node (8), got 3" in capsys.readouterr().err
    args = [recipe, "--estimate", "H100", "--cache", str(tmp_path), "--nodes", "2", "--json"]
    assert run(plan, [*args, "--max-stage-devices", "1"]) == 0
    narrow = json.loads(capsys.readouterr().out)
    assert narrow["request"]["max_stage_devices"] == 1 and narrow["stage_devices"] == [[1] * 8, [1] * 8]
    assert run(plan, [*args, "--max-stage-devices", "4"]) == 0  # stages that split each microbatch of 4
    split = json.loads(capsys.readouterr().out)
    assert split["stage_devices"] == [[4, 4], [4, 4]]
    assert run(plan, args) == 0  # the recipe's cluster.max_stage_devices: 8
    wide = json.loads(capsys.readouterr().out)
    assert wide["request"]["max_stage_devices"] == 8
    assert wide["stage_devices"] == [[8], [8]]  # each node one stage, two microbatches a pass: no bubble
    assert wide["plan"]["samples_per_s"] > split["plan"]["samples_per_s"] > narrow["plan"]["samples_per_s"]
    assert wide["data_parallel_bound"] == narrow["data_parallel_bound"]
    assert 0.9 * wide["data_parallel_bound"]["samples_per_s"] <= wide["plan"]["samples_per_s"]
    assert wide["plan"]["samples_per_s"] <= wide["data_parallel_bound"]["samples_per_s"]
    assert run(plan, args[:-1]) == 0
    assert "data-parallel bound" in capsys.readouterr().out
