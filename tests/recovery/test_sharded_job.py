"""Sharded stages (stages of several workers of one node, engine/shard.py) through the production path:
`submit`'s supervisor, agents and workers as real processes, 4 workers per node, real gloo groups. The
plan event names each stage's workers; a node killed -9 (its workers fail together) and a replacement
join change the stages' widths between plans, and the losses and final layers equal the fp64
single-process reference with no checkpoint."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from documents_corpus import documents_folder
from jobrun import JobRun, assert_matches_reference, run_job, start_and_wait, tiny_recipe
from reference import train_reference

from oobleck_slurm.engine.checkpoint import layer_file, read_layer_file
from oobleck_slurm.protocol.events import read_events

pytestmark = pytest.mark.slow
WORKERS = 4
JOB_TIMEOUT_S = 600.0  # 12 worker processes on a shared 2-core machine


def sharded_recipe(nodes: int, steps: int, **fault_tolerance: Any) -> dict[str, Any]:
    """The tiny GPT on `nodes` x 4 workers, stages up to a node wide. 8MB per worker does not hold a
    1-node pipeline of 1-worker stages, so the planner shards (widths 2 and 4); microbatches of 4 split
    evenly over a stage of 4."""
    recipe = tiny_recipe(nodes=nodes, workers=WORKERS, steps=steps, memory="8MB", **fault_tolerance)
    recipe["cluster"]["max_stage_devices"] = WORKERS
    recipe["training"]["microbatch_size"] = 4
    return recipe


def widths(plan: dict[str, Any]) -> list[list[int]]:
    """Each pipeline's stage widths, from the plan event (each stage lists its workers)."""
    return [[len(s["workers"]) for s in p["stages"]] for p in plan["pipelines"]]


def assert_plan_events_name_every_worker(run: JobRun) -> None:
    """Every plan event's stages cover their pipeline's workers once, each stage on one node, its
    ranks consecutive from the stage's first."""
    for plan in run.kind("plan"):
        for p in plan["pipelines"]:
            ranks = [r for s in p["stages"] for r in s["ranks"]]
            assert len(ranks) == len(set(ranks)) == WORKERS * len(p["nodes"]), plan
            for s in p["stages"]:
                assert s["ranks"] == list(range(s["rank"], s["rank"] + len(s["workers"])))
                assert s["workers"] == list(range(s["worker"], s["worker"] + len(s["workers"])))
                assert not s["kept"] or len(s["workers"]) > 1  # only a sharded stage keeps its gathers


def test_kill_9_of_a_node_with_sharded_stages_keeps_the_trajectory(tmp_path, templates_cache):
    # 3 nodes: a 2-node pipeline of four 2-wide stages (node0, node1) and a 1-node pipeline of one
    # 4-wide stage (node2). node1's worker is killed -9 and its agent kills the node's other workers;
    # the survivors (half of the first pipeline, the whole second) regroup at other widths, copying
    # named slices between replicas of different widths
    recipe = sharded_recipe(3, steps=8)
    recipe["drills"] = [{"step": 3, "node": "node1", "how": "worker"}]
    run = run_job(tmp_path, recipe, templates_cache, timeout=JOB_TIMEOUT_S)
    first, last = run.kind("plan")[0], run.kind("plan")[-1]
    assert any(w > 1 for ws in widths(first) for w in ws), widths(first)
    assert run.kind("failure")[0]["nodes"] == ["node1"]
    assert "node1" not in {n for p in last["pipelines"] for n in p["nodes"]}
    assert widths(first) != widths(last)
    assert_plan_events_name_every_worker(run)
    assert run.kind("resumed") and not run.kind("checkpoint_fallback")
    assert not (run.job.checkpoints / "step3").exists()  # recovered from memory, not a checkpoint
    assert_matches_reference(run)
    # each pipeline's schedule time is reported once, not once per rank of its wide first stage
    # (the step's metrics are summed over the world): within its step's time, not 2 or 4 times it
    ratios = sorted(max(e["pipeline_seconds"]) / e["seconds"] for e in run.kind("step"))
    assert ratios[len(ratios) // 2] < 1.3, ratios


def test_a_checkpoint_at_the_resume_step_is_completed_by_wide_stages(tmp_path, templates_cache):
    # node1 (half of the first pipeline, whose 2-wide stages write their layers to the checkpoint)
    # dies in step 2's optimizer step, after the commit point: the others apply step 2 and write
    # their layers of the checkpoint of step 3, node1's are never written. The job resumes at step 3,
    # where the new plan's first holders (stages of other widths, which gather each layer together)
    # write what is missing.
    recipe = sharded_recipe(3, steps=5, checkpoint_interval=3)
    run = run_job(tmp_path, recipe, templates_cache, timeout=JOB_TIMEOUT_S,
                  faults=[{"node": "node1", "worker": 0, "step": 2, "at": "optimizer"}])
    assert run.kind("failure")[0]["nodes"] == ["node1"] and run.kind("replan")[0]["resume_step"] == 3
    assert any(w > 1 for ws in widths(run.kind("plan")[-1]) for w in ws)
    assert_matches_reference(run)
    spec = run.spec()
    _, ref = train_reference(spec, 3)
    for key in spec.model.keys():
        path = layer_file(run.job.checkpoints, 3, key)
        assert path.exists(), f"the checkpoint of step 3 lacks {key}"
        for name, p in read_layer_file(path, 3).items():
            if name.startswith("param."):
                want = ref[key][name[len("param."):]]
                err = float((p - want).abs().max() / want.abs().max().clamp_min(1e-12))
                assert err <= 1e-5, f"{key}.{name}: relative error {err:.2e} against the reference after 3 steps"


def test_a_replacement_joins_and_the_widths_change_between_plans(tmp_path, templates_cache):
    # node1 (half of the 2-node pipeline of 2-wide stages) is killed -9 at step 3 and a replacement
    # asked for; each plan change re-cuts the stages' shards from the replicas in memory
    recipe = sharded_recipe(3, steps=20, replacement="request")  # the join comes by step ~5
    recipe["drills"] = [{"step": 3, "node": "node1", "how": "worker"}]
    run = run_job(tmp_path, recipe, templates_cache, timeout=JOB_TIMEOUT_S)
    assert [e["node"] for e in run.kind("node_joined")] == ["r1"]
    plans = run.kind("plan")
    assert [p["reason"] for p in plans] == ["initial", "failure", "join"], [p["reason"] for p in plans]
    # the failure regroups node2 as one 4-wide stage, the join grows its pipeline with r1 (2-wide stages)
    assert "r1" in {n for p in plans[-1]["pipelines"] for n in p["nodes"]}
    assert widths(plans[0]) != widths(plans[1]) != widths(plans[2]), [widths(p) for p in plans]
    assert_plan_events_name_every_worker(run)
    assert not run.kind("checkpoint_fallback")
    assert_matches_reference(run)


def test_a_notice_checkpoints_a_plan_with_wide_stages_and_the_next_run_resumes_there(tmp_path, templates_cache):
    # The time-limit or preemption notice on a plan whose stages are 2 and 4 wide: the coordinator stops
    # the workers by failing their generation, and each wide stage gathers its layers to write them.
    # Through the failed generation's groups that gather raised GenerationAborted: no checkpoint, and
    # the run was labelled completed. Now the stop generation forms its own groups; the next run on the
    # folder (a requeue) resumes at the notice's step, on the reference's trajectory.
    import psutil
    import yaml
    from job_events import events_so_far

    from oobleck_slurm.protocol.events import events_path
    from oobleck_slurm.recipe import load_recipe
    from oobleck_slurm.submission import prepare_job, start_local

    steps = 30
    recipe = sharded_recipe(2, steps=steps, checkpoint_interval=0)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    job = prepare_job(load_recipe(path), cache_dir=templates_cache, estimate_gpu="A100-40", job_root=tmp_path / "jobs")
    events = events_path(job.path)
    process = start_local(job)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not any(e["kind"] == "step" and e["step"] >= 3 for e in events_so_far(events)):
            assert process.poll() is None and time.monotonic() < deadline, "the job did not reach step 3"
            time.sleep(0.1)
        agents = [p for p in psutil.Process(process.pid).children(recursive=True)
                  if "oobleck_slurm.agent.main" in " ".join(p.cmdline())]
        agents[0].send_signal(signal.SIGUSR2)  # Slurm's notice reaches every step: one agent relays it
        assert process.wait(JOB_TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    first = read_events(events)
    assert any(w > 1 for ws in widths([e for e in first if e["kind"] == "plan"][0]) for w in ws)
    (ckpt,) = [e for e in first if e["kind"] == "checkpoint" and e.get("on_demand")]
    assert ckpt["ok"], ckpt
    assert [e["status"] for e in first if e["kind"] == "job_finished"] == ["preempted"]
    run = start_and_wait(job, JOB_TIMEOUT_S)
    assert run.exit_code == 0, run.log_tails()
    again = [e for e in run.events if e["kind"] == "job_started"][-1]
    assert again["requeued"], "a folder with a complete checkpoint is a resume"
    resumed = [e["step"] for e in run.events if e["kind"] == "step" and e["t"] > again["t"]]
    assert resumed == list(range(ckpt["step"], steps))
    assert_matches_reference(run)


def test_document_masking_on_sharded_stages_keeps_the_reference(tmp_path, templates_cache):
    # every rank of every stage, the wide middle ones included, masks the documents of its own rows
    # (docs/data.md, "Document masking"): a prepared set of short documents, ended by the byte eos
    recipe = sharded_recipe(4, steps=4)
    recipe["cluster"]["memory_per_device"] = "6MB"  # two pipelines of four 2-wide stages, 2 nodes each
    recipe["data"] = {"sources": [{"path": documents_folder(tmp_path)}], "document_mask": True}
    run = run_job(tmp_path, recipe, templates_cache, timeout=JOB_TIMEOUT_S)
    assert widths(run.kind("plan")[0]) == [[2, 2, 2, 2]] * 2  # wide stages between the first and the last
    assert_matches_reference(run)
