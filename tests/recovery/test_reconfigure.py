"""The pure reconfiguration function: every starting plan x every failure set, invariants hold;
each rule on a case built for it; impossibility reported precisely."""

from __future__ import annotations

import itertools
import random

import pytest
from planning_helpers import make_profile, random_profile

from oobleck_slurm.planning import cost, generate_templates, instantiate
from oobleck_slurm.planning.reconfigure import (
    RecoveryImpossible,
    plan_holders,
    reconfigure,
    stage_devices,
)
from oobleck_slurm.planning.templates import PlanningError

B = 12


def profile_and_templates(n_layers=6, dpn=1, tight=False, seed=0, max_nodes=8):
    rng = random.Random(seed)
    if tight:  # the model needs >= 2 nodes: borrow and merge come into play
        state = [1000] * n_layers
        mem = (sum(state) * 0.6 + 2000) / 0.9
        profile = make_profile([rng.uniform(0.01, 0.1) for _ in range(n_layers)], devices_per_node=dpn,
                               memory=mem, state=state, out=[100] * n_layers)  # outputs ~ activations
    else:
        profile = random_profile(rng, n_layers, dpn, tight_memory=False)
    return profile, generate_templates(profile, max_nodes, num_microbatches=4)


def check(profile, templates, before, lost, joined, f, result):
    """Every invariant a reconfiguration must keep."""
    plan = result.plan
    L = profile.num_layers
    lost = set(lost)
    used = [n for p in plan.pipelines for n in p.nodes]
    assert len(used) == len(set(used)), "a node in two pipelines"
    assert not lost & set(used) and not lost & set(plan.spare_nodes), "a lost node is used"
    live = {n for p in before.pipelines for n in p.nodes} | set(before.spare_nodes) | set(joined)
    assert set(used) | set(plan.spare_nodes) == live - lost, "a live node went missing"
    assert len(plan.pipelines) >= f + 1
    budget = cost.usable_memory(profile)
    first = 0
    for p in plan.pipelines:
        t = p.template
        assert t in templates and len(p.nodes) == t.num_nodes
        covered = [layer for s in t.stages for layer in range(s.start, s.stop)]
        assert covered == list(range(L)), "layers not covered exactly once, in order"
        assert all(s.memory_bytes <= budget for s in t.stages)
        assert p.microbatches >= 1 and p.first_microbatch == first
        first += p.microbatches
    assert first == before.global_microbatches
    # Transfers: from live holders of the layer, exactly the missing (device, layer) pairs.
    holders = {d: ls for d, ls in plan_holders(before).items() if d[0] not in lost}
    need = {(d, layer) for p in plan.pipelines for d, ls in stage_devices(p) for layer in ls
            if layer not in holders.get(d, ())}
    got = [(t.dst, t.layer) for t in result.transfers]
    assert sorted(got, key=repr) == sorted(need, key=repr) and len(got) == len(set(got))
    for t in result.transfers:
        assert t.src[0] not in lost and t.layer in holders[t.src]


def starting_plans():
    cases = []
    for n_layers, dpn, tight, seed in [(4, 1, False, 0), (6, 1, True, 1), (6, 2, False, 2), (8, 1, True, 3)]:
        profile, templates = profile_and_templates(n_layers, dpn, tight, seed)
        n0 = min(t.num_nodes for t in templates)
        for f in (1, 2):
            for nodes in range((f + 1) * n0, 9):
                cases.append((profile, templates, f, instantiate(templates, nodes, f, B)))
    return cases


def test_every_failure_set_up_to_f_plus_one():
    runs = impossible = 0
    for profile, templates, f, before in starting_plans():
        nodes = [n for p in before.pipelines for n in p.nodes] + list(before.spare_nodes)
        n0 = min(t.num_nodes for t in templates)
        for k in range(1, f + 2):
            for lost in itertools.combinations(nodes, k):
                runs += 1
                alive_layers = set().union(*[ls for d, ls in plan_holders(before).items() if d[0] not in lost])
                live = len(nodes) - k
                try:
                    result = reconfigure(before, lost, [], templates, f)
                except RecoveryImpossible as e:
                    impossible += 1
                    if e.kind == "no_replica":
                        assert k > f, "f failures can never remove every replica of f+1 pipelines"
                        assert set(e.layers) == set(range(profile.num_layers)) - alive_layers
                        assert str(list(e.layers)) in str(e)
                    else:
                        assert e.kind == "too_few_pipelines" and live < (f + 1) * n0, (live, f, n0)
                        assert f"{f + 1} pipelines" in str(e)
                    continue
                assert live >= (f + 1) * n0
                check(profile, templates, before, lost, [], f, result)
    assert runs > 500 and 0 < impossible < runs


def test_failure_then_joins_restore_throughput():
    profile, templates = profile_and_templates(6, 1, True, 1)
    for f in (1, 2):
        for nodes in range(3 * 2, 9):
            before = instantiate(templates, nodes, f, B)
            for lost in [(0,), (nodes - 1,), (0, nodes - 1)][: f]:
                if nodes - len(lost) < (f + 1) * 2:
                    continue  # recovery impossible: tested above
                after = reconfigure(before, lost, [], templates, f)
                back = reconfigure(after.plan, [], [f"new{i}" for i in range(len(lost))], templates, f)
                check(profile, templates, after.plan, [], [f"new{i}" for i in range(len(lost))], f, back)
                assert back.predicted_step_s <= before.pipeline_time_s * (1 + 1e-9)
                assert back.predicted_step_s <= after.predicted_step_s
                assert any(str(t.dst[0]).startswith("new") for t in back.transfers)


def fixed_templates():
    """Sizes 2, 3, 4 (the model needs 2 nodes), 6 equal layers."""
    profile = make_profile([0.03] * 6, memory=(6000 * 0.6 + 2000) / 0.9, state=[1000] * 6, out=[100] * 6)
    templates = generate_templates(profile, 6, num_microbatches=4)
    assert [t.num_nodes for t in templates][:3] == [2, 3, 4]
    return profile, {t.num_nodes: t for t in templates}


def manual_plan(by_size, groups, spares=()):
    from oobleck_slurm.planning.instantiate import PipelinePlan, Plan
    pipes, first = [], 0
    for g in groups:
        pipes.append(PipelinePlan(by_size[len(g)], tuple(g), 4, first))
        first += 4
    return Plan(tuple(pipes), tuple(spares), first, 1, 0.0)


def test_simple_rule_shrinks_onto_the_template_of_the_new_size():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1, 2], [3, 4, 5]])
    r = reconfigure(before, [1], [], list(by_size.values()), 1, reoptimize_margin=1.0)
    assert r.rules == ("simple",)
    assert [list(p.nodes) for p in r.plan.pipelines] == [[0, 2], [3, 4, 5]]
    assert r.plan.pipelines[0].template is by_size[2]
    assert r.plan.pipelines[1].microbatches > r.plan.pipelines[0].microbatches  # faster one gets more


def test_borrow_takes_nodes_from_the_largest_pipeline():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1], [2, 3, 4, 5]])
    r = reconfigure(before, [1], [], list(by_size.values()), 1, reoptimize_margin=1.0)
    assert r.rules == ("borrow",)
    assert [list(p.nodes) for p in r.plan.pipelines] == [[0, 5], [2, 3, 4]]


def test_borrow_prefers_spares_and_merge_when_nobody_can_lend():
    profile, by_size = fixed_templates()
    spare = reconfigure(manual_plan(by_size, [[0, 1], [2, 3]], spares=[9]), [1], [], list(by_size.values()), 1)
    assert [list(p.nodes) for p in spare.plan.pipelines] == [[0, 9], [2, 3]] and spare.rules == ("borrow",)
    before = manual_plan(by_size, [[0, 1], [2, 3], [4, 5]])
    merged = reconfigure(before, [1, 3], [], list(by_size.values()), 0, reoptimize_margin=1.0)
    assert "merge" in merged.rules and [list(p.nodes) for p in merged.plan.pipelines] == [[4, 5], [0, 2]]


def test_join_forms_a_new_pipeline_or_grows_one():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1], [2, 3]])
    one = reconfigure(before, [], ["a"], list(by_size.values()), 1, reoptimize_margin=1.0)
    assert one.rules == ("join",) and sorted(len(p.nodes) for p in one.plan.pipelines) == [2, 3]
    two = reconfigure(before, [], ["a", "b"], list(by_size.values()), 1, reoptimize_margin=1.0)
    assert len(two.plan.pipelines) == 3 and two.predicted_step_s < one.predicted_step_s
    assert all(t.dst[0] in ("a", "b") for t in two.transfers)  # only the newcomers receive


def test_replan_wins_when_much_faster():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1, 2, 3], [4, 5]], spares=[6, 7])
    r = reconfigure(before, [0], [], list(by_size.values()), 1, reoptimize_margin=0.0)
    local = reconfigure(before, [0], [], list(by_size.values()), 1, reoptimize_margin=1.0)
    assert r.predicted_step_s <= local.predicted_step_s
    assert (r.rules == ("replan",)) == (r.predicted_step_s < local.predicted_step_s)


def test_copies_are_spread_over_holders():
    profile, templates = profile_and_templates(8, 1, False, 5)
    by_size = {t.num_nodes: t for t in templates}
    before = manual_plan(by_size, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    r = reconfigure(before, [], ["x"], list(by_size.values()), 1, reoptimize_margin=1.0)
    if r.transfers:
        assert len(r.senders()) > 1
    lose = reconfigure(before, [0, 1, 2], [], list(by_size.values()), 1, reoptimize_margin=1.0)
    senders = lose.senders()
    assert len(senders) >= 2 and max(senders.values()) < lose.bytes


def test_layer_bytes_balance_the_senders():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1], [2, 3], [4, 5]])
    r = reconfigure(before, [], ["a", "b"], list(by_size.values()), 1, layer_bytes=[10, 1, 1, 1, 1, 100],
                    reoptimize_margin=1.0)
    per = r.senders()
    assert len(per) >= 2 and sum(per.values()) == r.bytes


def test_bad_input_is_named():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1], [2, 3]])
    with pytest.raises(PlanningError, match="not in the current plan"):
        reconfigure(before, [7], [], list(by_size.values()), 1)
    with pytest.raises(PlanningError, match="already members"):
        reconfigure(before, [], [2], list(by_size.values()), 1)
    with pytest.raises(PlanningError, match="no pipeline templates"):
        reconfigure(before, [1], [], [], 1)


def test_impossible_messages():
    profile, by_size = fixed_templates()
    before = manual_plan(by_size, [[0, 1], [2, 3]])
    with pytest.raises(RecoveryImpossible, match=r"layer\(s\) \[0, 1, 2\] lost every replica") as e:
        reconfigure(before, [0, 2], [], list(by_size.values()), 1)
    assert e.value.kind == "no_replica"
    with pytest.raises(RecoveryImpossible, match="cannot form the 2 pipelines") as e:
        reconfigure(before, [1], [], list(by_size.values()), 1)
    assert e.value.kind == "too_few_pipelines"
