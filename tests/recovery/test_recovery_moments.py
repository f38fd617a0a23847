"""A second failure at every moment of a recovery (issue 15): while the coordinator collects the
survivors' reports, while they build the next generation's groups, during the state copy, during the
replay, and while a replacement joins. Each restarts the recovery with the new membership (never a
wait for a timeout, never a checkpoint) and the trajectory equals the failure-free reference."""

from __future__ import annotations

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

pytestmark = pytest.mark.slow


def lost_nodes(run):
    return sorted(n for e in run.kind("failure") for n in e["nodes"])


def assert_recovered_in_memory(run, expected_lost):
    assert_matches_reference(run)
    assert lost_nodes(run) == sorted(expected_lost), run.kind("failure")
    assert not run.kind("checkpoint_fallback")
    assert not [e for e in run.kind("failure") if "timeout" in e["cause"]], run.kind("failure")
    for failure in [e for e in run.kind("failure") if e["step"] is not None]:  # the step in progress ...
        resumed = next(e for e in run.kind("resumed") if e["t"] >= failure["t"])  # ... is where training resumes
        assert failure["step"] - 1 <= resumed["step"] <= failure["step"] + 1, (failure, resumed)


@pytest.mark.parametrize("first, gen_first, second, gen_second", [
    # node3 dies while generation 0's reports are collected (one change: generation 1); node5 while
    # generation 2's groups are built
    ("report", 0, "groups", 2),
    # node3 dies during generation 1's state copy (a second change: generation 2); node5 during
    # generation 3's replay
    ("adopt", 1, "replay", 3),
])
def test_a_second_failure_at_each_moment_of_a_recovery(tmp_path, templates_cache, first, gen_first, second,
                                                        gen_second):
    # Two recoveries, each struck a second time: node2 dies in step 2, node3 at `first` of that
    # recovery; node4 dies in step 5, node5 at `second` of that recovery.
    faults = [{"node": "node2", "step": 2, "at": "wait:2"},
              {"node": "node3", "generation": gen_first, "at": first},
              {"node": "node4", "step": 5, "at": "wait:2"},
              {"node": "node5", "generation": gen_second, "at": second}]
    run = run_job(tmp_path, tiny_recipe(nodes=6, steps=8, f=1), templates_cache, faults=faults)
    assert_recovered_in_memory(run, ["node2", "node3", "node4", "node5"])
    final = run.kind("plan")[-1]
    assert sorted(n for p in final["pipelines"] for n in p["nodes"]) == ["node1", "node6"]


def test_a_failure_while_a_replacement_joins(tmp_path, templates_cache):
    # node2 dies in step 2; its replacement r1 joins (generation 2); node3 dies while the members build
    # the join generation's groups: the join completes with the recovery that follows.
    faults = [{"node": "node2", "step": 2, "at": "wait:2"}, {"node": "node3", "generation": 2, "at": "groups"}]
    run = run_job(tmp_path, tiny_recipe(nodes=4, steps=40, f=1, replacement="request"), templates_cache,
                  faults=faults)
    assert_recovered_in_memory(run, ["node2", "node3"])
    assert "r1" in [e["node"] for e in run.kind("node_joined")]
    assert any(e.get("supersedes") for e in run.events), "the loss did not interrupt the join's recovery"
