"""Checkpoint-free recovery with real worker processes, real gloo groups and SIGKILL: after each
failure the trajectory (losses, final parameters of every surviving replica) equals the
failure-free single-process reference within 1e-5 relative (fp64, see tests/engine/test_exact.py)."""

from __future__ import annotations

import pytest

from elastic_helpers import TIMEOUTS, plan_of, tiny_job, tiny_templates
from oobleck_slurm.engine.reference import train_reference
from oobleck_slurm.supervisor.coordinator import CoordinatorError
from oobleck_slurm.supervisor.local import run_elastic_local

pytestmark = pytest.mark.slow
RTOL = 1e-5
RECOVERY_EVENTS = ["failure", "detection", "replan", "plan", "group_rebuild", "state_copy", "replay", "resumed"]


def assert_matches_reference(run, job):
    ref_losses, ref_params = train_reference(job)
    losses = run.losses()
    assert sorted(losses) == list(range(job.train.steps))
    for step, ref in enumerate(ref_losses):
        assert abs(losses[step] - ref) <= RTOL * abs(ref), (step, losses[step], ref)
    checked = set()
    for node, layers in run.params.items():
        for key, tensors in layers.items():
            for name, p in tensors.items():
                ref = ref_params[key][name]
                err = float((p - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
                assert err <= RTOL, f"node {node} {key}.{name}: relative error {err:.2e}"
                checked.add(key)
    assert checked == set(ref_params)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-6  # training moved: the comparison can fail


def kinds(run):
    return [e["kind"] for e in run.events if e["kind"] in RECOVERY_EVENTS]


@pytest.mark.parametrize("optimizer, at", [("adamw", "wait:3"), ("came", "wait:3"), ("adamw", "wait:last"),
                                           ("came", "optimizer")])
def test_kill_mid_step_keeps_the_trajectory(tmp_path, optimizer, at):
    job = tiny_job(optimizer, faults=[{"node": 1, "step": 2, "at": at}])
    templates = tiny_templates(job)
    run = run_elastic_local(job, plan_of(templates, [2, 2]), templates, tmp_path, f=1, timeouts=TIMEOUTS)
    assert_matches_reference(run, job)
    assert kinds(run) == ["plan"] + RECOVERY_EVENTS  # initial plan, then one failure, every phase recorded once, in order
    failure = run.kind("failure")[0]
    assert failure["nodes"] == ["1"] and failure["generation"] == 0
    assert run.kind("state_copy")[0]["bytes"] > 0
    resumed = run.kind("resumed")[0]
    assert resumed["generation"] == 1 and resumed["step"] in (2, 3) and resumed["total_seconds"] < 30
    assert "1" not in run.params  # the dead node is gone; survivors kept their processes
    steps = run.kind("step")
    assert {e["generation"] for e in steps if e["step"] < 2} == {0}


def test_two_simultaneous_failures_f2(tmp_path):
    job = tiny_job("adamw", faults=[{"node": 1, "step": 2, "at": "wait:2"}, {"node": 4, "step": 2, "at": "wait:2"}])
    templates = tiny_templates(job)
    run = run_elastic_local(job, plan_of(templates, [2, 2, 2]), templates, tmp_path, f=2, timeouts=TIMEOUTS)
    assert_matches_reference(run, job)
    lost = sorted(n for e in run.kind("failure") for n in e["nodes"])
    assert lost == ["1", "4"]
    final = run.kind("plan")[-1]
    assert len(final["pipelines"]) >= 3 and not {"1", "4"} & {n for p in final["pipelines"] for n in p["nodes"]}


def test_failure_during_recovery(tmp_path):
    # Node 1 dies in step 2; node 3 dies while the survivors rebuild (groups up, copies pending).
    job = tiny_job("came", faults=[{"node": 1, "step": 2, "at": "wait:3"}, {"node": 3, "step": 2, "at": "adopt"}])
    templates = tiny_templates(job)
    run = run_elastic_local(job, plan_of(templates, [2, 3]), templates, tmp_path, f=1, timeouts=TIMEOUTS)
    assert_matches_reference(run, job)
    failures = run.kind("failure")
    assert [e["nodes"] for e in failures] == [["1"], ["3"]]
    assert failures[1]["generation"] == 1  # the second failure struck the recovery generation
    assert run.kind("resumed")[-1]["generation"] == 2


def test_replacement_joins_after_a_loss(tmp_path):
    job = tiny_job("adamw", steps=40, faults=[{"node": 0, "step": 2, "at": "wait:3"}])
    templates = tiny_templates(job)
    run = run_elastic_local(job, plan_of(templates, [2, 2]), templates, tmp_path, f=1, timeouts=TIMEOUTS,
                            replacement=True)
    assert_matches_reference(run, job)
    joined = run.kind("node_joined")
    assert [e["node"] for e in joined] == ["r1"]
    final = run.kind("plan")[-1]
    assert final["reason"] == "join" and "r1" in {n for p in final["pipelines"] for n in p["nodes"]}
    assert "r1" in run.params  # the newcomer trained to the end with layers copied from replicas


def test_every_replica_lost_falls_back_to_the_checkpoint(tmp_path):
    # Both pipelines hold layers 3-5 on nodes 1 and 3 only: killing both loses every replica.
    faults = [{"node": 1, "step": 3, "at": "wait:2"}, {"node": 3, "step": 3, "at": "wait:2"}]
    job = tiny_job("adamw", faults=faults)
    templates = tiny_templates(job)
    run = run_elastic_local(job, plan_of(templates, [2, 2], spares=2), templates, tmp_path, f=1,
                            timeouts=TIMEOUTS, checkpoint_interval=2)
    assert_matches_reference(run, job)
    fallback = run.kind("checkpoint_fallback")
    assert len(fallback) == 1 and "lost every replica" in fallback[0]["reason"]
    assert "['1', '3']" in fallback[0]["reason"] or "1" in fallback[0]["reason"]
    assert any(e["step"] == 2 for e in run.kind("checkpoint"))


def test_every_replica_lost_without_checkpoint_says_why(tmp_path):
    faults = [{"node": 1, "step": 1, "at": "wait:2"}, {"node": 3, "step": 1, "at": "wait:2"}]
    job = tiny_job("adamw", steps=3, faults=faults)
    templates = tiny_templates(job)
    with pytest.raises(CoordinatorError, match=r"lost every replica.*no complete checkpoint"):
        run_elastic_local(job, plan_of(templates, [2, 2]), templates, tmp_path, f=1, timeouts=TIMEOUTS)
