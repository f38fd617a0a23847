"""Replica integrity through the production path (supervisor, agents, worker processes, real gloo
groups): a bit flipped in one replica's parameter (faults.py "corrupt") is caught at the next step's
check, attributed to its node by the majority of three replicas, the node evicted, its layers copied
from the replicas that agree, and the run continues on the reference trajectory (the corrupted step
is withheld everywhere and replayed). (A recovery copy that arrives corrupted and is fetched again:
tests/engine/test_integrity.py, on real gloo groups with the ranks as threads.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from job_events import assert_trained_on_the_reference, running_job, wait_for
from jobrun import assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slow


def three_replicas_and_a_spare() -> dict:
    """One-node pipelines (every layer held three times or more), with f = 2 kept after an eviction."""
    recipe = tiny_recipe(nodes=4, f=2, replacement="spare", integrity_max_cost=0.0)  # a check every step
    recipe["cluster"]["spare_nodes"] = 1
    return recipe


def test_a_flipped_bit_in_one_of_three_replicas_evicts_its_node_and_keeps_the_trajectory(tmp_path, templates_cache):
    faults = [{"node": "node2", "step": 2, "at": "start", "do": "corrupt"}]
    run = run_job(tmp_path, three_replicas_and_a_spare(), templates_cache, faults=faults)
    first = run.kind("plan")[0]
    assert len(first["pipelines"]) >= 3, first  # at least three replicas of every layer: a majority
    [mismatch] = run.kind("replica_mismatch")
    assert mismatch["step"] == 2 and mismatch["nodes"] == ["node2"] and mismatch["attributed"], mismatch
    lost = run.kind("node_lost")
    assert [(e["node"], e["cause"]) for e in lost] == [("node2", "replica_mismatch")], lost
    assert run.kind("resumed")[0]["step"] == 2  # the withheld step is replayed
    assert {e["step"] for e in run.kind("step") if e["generation"] == 0} == {0, 1}  # step 2 never logged there
    assert_matches_reference(run, optimizer_state=True)



def test_kill_node_corrupt_drill_is_found_and_its_node_evicted(tmp_path, templates_cache):
    """`kill-node --how corrupt` on a running job (the drill users run): the worker flips a bit at its
    next step, the next check names its node, and training goes on without it."""
    ft = "  f: 2\n  replacement: none\n  checkpoint_interval: 0\n  integrity_max_cost: 0.0\n"
    with running_job(tmp_path, ft, templates_cache, precision="fp64") as job:
        wait_for(job, "steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 2])
        done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "kill-node", str(job), "node3", "--how", "corrupt"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        [mismatch] = wait_for(job, "replica_mismatch", lambda ev: [e for e in ev if e["kind"] == "replica_mismatch"])
        assert mismatch["nodes"] == ["node3"] and mismatch["attributed"], mismatch
        lost = wait_for(job, "node3 lost", lambda ev: [e for e in ev if e["kind"] == "node_lost"])
        assert [(e["node"], e["cause"]) for e in lost] == [("node3", "replica_mismatch")], lost
        steps = len(read_events(job / "events.jsonl", "step"))
        wait_for(job, "training after the eviction", lambda ev: len([e for e in ev if e["kind"] == "step"]) > steps + 2)
        assert not read_events(job / "events.jsonl", "replica_mismatch")[1:]  # the replicas agree again
    assert_trained_on_the_reference(job)  # the corrupted step was withheld and replayed
