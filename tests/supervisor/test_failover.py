"""The supervisor's loss survived (docs/failover.md), local backend: a kill -9 of the supervisor (a
recipe drill) is taken over by its standby, which resumes from the durable state and the workers'
reports in memory; the job completes with no checkpoint loaded and the reference's per-step losses."""

from __future__ import annotations

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

pytestmark = pytest.mark.slow


def start_job(tmp_path, recipe, templates_cache):
    """Start `recipe` as `submit` does on the local backend: (job folder, the primary supervisor's
    process, the events file, the start time)."""
    import time

    import yaml
    from jobrun import events_path, prepare_job, start_local

    from oobleck_slurm.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    job = prepare_job(load_recipe(path), cache_dir=templates_cache, estimate_gpu="A100-40", job_root=tmp_path / "jobs")
    t0 = time.time()
    return job, start_local(job), events_path(job.path), t0


def wait_until(what, condition, seconds=240.0):
    """`condition()`'s first truthy value, looked at every 10 ms; fails after `seconds`."""
    import time

    deadline = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what} not within {seconds:g} s"
        time.sleep(0.01)
    return found


class Events:
    """A running job's events of one kind, read incrementally (`events_so_far`): looking every 10 ms
    re-parsed the whole log each time (seconds of the test process's CPU over a job)."""

    def __init__(self, path):
        self.path = path

    def kind(self, kind):
        from job_events import events_so_far

        return [e for e in events_so_far(self.path) if e["kind"] == kind]


def test_a_killed_supervisor_is_taken_over_in_steady_training(tmp_path, templates_cache):
    recipe = tiny_recipe(steps=8)
    recipe["drills"] = [{"step": 3, "how": "supervisor"}]
    run = run_job(tmp_path, recipe, templates_cache)
    (takeover,) = run.kind("takeover")
    assert takeover["epoch"] == 2 and takeover["lost"] == []
    assert not run.kind("checkpoint_fallback") and not run.kind("failure")
    assert [e["reason"] for e in run.kind("plan")][-1] == "takeover"
    assert run.kind("resumed")
    assert_matches_reference(run)


def test_a_supervisor_killed_during_a_recovery_is_taken_over(tmp_path, templates_cache):
    # node2's worker is killed at step 3 and the supervisor right after it: the standby takes over a
    # job whose node2 failed while no supervisor listened, and recovers both at once
    recipe = tiny_recipe(steps=8)
    recipe["drills"] = [{"step": 3, "node": "node2", "how": "worker"}, {"step": 3, "how": "supervisor"}]
    run = run_job(tmp_path, recipe, templates_cache)
    assert [e["epoch"] for e in run.kind("takeover")] == [2]
    final = run.kind("plan")[-1]
    assert "node2" not in {n for p in final["pipelines"] for n in p["nodes"]}
    assert not run.kind("checkpoint_fallback")
    assert_matches_reference(run)


def test_a_supervisor_killed_during_a_replacement_join_is_taken_over(tmp_path, templates_cache):
    # node1's worker dies at step 3, a replacement is asked for; the supervisor dies while it starts: the
    # standby keeps asking for it (the pending join is in the durable state) and it joins
    recipe = tiny_recipe(steps=30, replacement="request", nodes=4, f=0, memory="14MB")  # r1 joins by step ~6
    recipe["drills"] = [{"step": 3, "node": "node1", "how": "worker"}, {"step": 5, "how": "supervisor"}]
    run = run_job(tmp_path, recipe, templates_cache)
    assert [e["epoch"] for e in run.kind("takeover")] == [2]
    assert [e["node"] for e in run.kind("node_joined")] == ["r1"]
    assert not run.kind("checkpoint_fallback")
    assert_matches_reference(run)


def test_a_supervisor_killed_while_a_checkpoint_is_written_is_taken_over(tmp_path, templates_cache):
    recipe = tiny_recipe(steps=10, checkpoint_interval=4)
    recipe["drills"] = [{"step": 4, "how": "supervisor"}]
    run = run_job(tmp_path, recipe, templates_cache)
    assert [e["epoch"] for e in run.kind("takeover")] == [2]
    assert 4 in {e["step"] for e in run.kind("checkpoint")} or (run.job.checkpoints / "step4").is_dir()
    assert not run.kind("checkpoint_fallback")
    assert_matches_reference(run)


def test_kill_node_supervisor_from_the_command_line(tmp_path):
    """`kill-node JOB supervisor --how process`, as a user drills it on a running job."""
    import subprocess
    import sys
    import time

    from oobleck_slurm.protocol.events import read_events

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: t\ncluster: {backend: local, nodes: 4}\nmodel: {size: tiny}\n"
                      "training: {global_batch_size: 16, microbatch_size: 2, steps: 40}\n"
                      "fault_tolerance: {f: 1, checkpoint_interval: 0, replacement: none}\n")
    cli = [sys.executable, "-m", "oobleck_slurm"]
    done = subprocess.run([*cli, "submit", str(recipe), "--detach", "--estimate", "A100-40"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    deadline = time.monotonic() + 120
    while not [e for e in read_events(job / "events.jsonl", "step") if e["step"] >= 3]:
        assert time.monotonic() < deadline, "no step 3"
        time.sleep(0.1)
    killed = subprocess.run([*cli, "kill-node", str(job), "supervisor", "--how", "process"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == 0, killed.stderr
    while not read_events(job / "events.jsonl", "job_finished"):
        assert time.monotonic() < deadline + 120, "the job did not finish after the takeover"
        time.sleep(0.2)
    (finished,) = read_events(job / "events.jsonl", "job_finished")
    assert finished["status"] == "completed"
    assert [e["epoch"] for e in read_events(job / "events.jsonl", "takeover")] == [2]
    steps = [e["step"] for e in read_events(job / "events.jsonl", "step")]
    assert sorted(set(steps)) == list(range(40))


def test_a_supervisor_stopped_with_sigterm_is_not_taken_over(tmp_path, templates_cache):
    """A stop on purpose (`cancel`, a test's teardown) ends the job: the lease is marked done, the
    standby leaves, the agents shut their workers down; nothing of the job is left running."""
    import time

    import psutil
    import yaml
    from jobrun import events_path, prepare_job, read_events, start_local

    from oobleck_slurm.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(steps=100000), sort_keys=False))
    job = prepare_job(load_recipe(path), cache_dir=templates_cache, estimate_gpu="A100-40", job_root=tmp_path / "jobs")
    sup = start_local(job)
    deadline = time.monotonic() + 120
    while not [e for e in read_events(events_path(job.path), "step") if e["step"] >= 2]:
        assert time.monotonic() < deadline, "no step 2"
        time.sleep(0.1)
    family = [sup, *psutil.Process(sup.pid).children(recursive=True)]
    sup.terminate()
    sup.wait(60)
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    assert not read_events(events_path(job.path), "takeover")
    (finished,) = read_events(events_path(job.path), "job_finished")
    assert finished["status"] in ("failed", "cancelled") and "SIGTERM" in (finished["error"] or "")


def test_a_frozen_supervisor_is_taken_over_and_fenced_when_it_thaws(tmp_path, templates_cache):
    """SIGSTOP of the primary (what `kill-node JOB supervisor --how freeze` does): its connections stay
    open, so agents and workers learn of the takeover only from the higher epoch in the job folder.
    The standby was forked warm from the job's server.
    The standby takes over once the lease lapses; the thawed primary finds the higher epoch and leaves
    without acting; the job completes on the reference's trajectory with no checkpoint."""
    import os
    import signal
    import sys
    import time

    import psutil
    from jobrun import JobRun, read_events

    from oobleck_slurm.cluster.lease import read_lease

    # A short lease, so that the takeover comes while training goes on: the workers train through the
    # freeze, ~0.1 s a step on a quiet machine, so the takeover comes near step 45 there (step 26 under
    # the whole suite's load); 90 steps leave it twice that.
    recipe = tiny_recipe(steps=90, heartbeat_lease=4.0, collective_timeout=3.0)
    job, primary, events, t0 = start_job(tmp_path, recipe, templates_cache)
    try:
        log = Events(events)
        wait_until("step 3", lambda: [e for e in log.kind("step") if e["step"] >= 3])
        lease = read_lease(job)
        assert lease is not None and lease.pid == primary.pid
        # The standby is forked from the job's warm server, so it imported nothing itself: a fresh
        # interpreter spends seconds of CPU on torch at the job's start, when the workers need the cores.
        (standby,) = [p for p in psutil.Process(primary.pid).children(recursive=True) if "--standby" in p.cmdline()]
        server = standby.parent()
        assert server.cmdline()[:3] == [sys.executable, "-m", "oobleck_slurm.agent.warm"]
        assert sum(standby.cpu_times()[:2]) < 0.5
        # That server is a fork of the primary, which had imported torch: it imported only the rest
        # (~1 s of CPU, 2.2 s seen under the whole suite's load, which slows every instruction; a fresh
        # interpreter's preload takes ~3 s on a quiet machine).
        assert server.ppid() == primary.pid and sum(server.cpu_times()[:2]) < 2.6
        # the primary's own command line, its argv room (--title-room) hidden
        assert psutil.Process(primary.pid).cmdline() == [sys.executable, "-m", "oobleck_slurm.supervisor.main",
                                                         str(job.path), "--backend", "local"]
        os.kill(primary.pid, signal.SIGSTOP)
        frozen_at = time.time()
        (takeover,) = wait_until("the takeover", lambda: log.kind("takeover"))
        assert takeover["epoch"] == 2 and takeover["lost"] == []
        steps_before_thaw = len(read_events(events, "step"))
        os.kill(primary.pid, signal.SIGCONT)
        assert primary.wait(30) != 0  # fenced: it left
        finished = wait_until("the end", lambda: log.kind("job_finished"))
    finally:
        if primary.poll() is None:
            os.killpg(primary.pid, signal.SIGKILL)
    assert len(finished) == 1 and finished[0]["status"] == "completed", finished
    run = JobRun(job, 0, read_events(events), time.time() - t0)
    resumed = [e for e in run.kind("resumed") if e["t"] > frozen_at]
    assert resumed and len(run.kind("step")) > steps_before_thaw
    assert not run.kind("checkpoint_fallback") and not run.kind("node_lost")
    assert [e["reason"] for e in run.kind("plan")][-1] == "takeover"
    assert_matches_reference(run)


def test_a_supervisor_killed_during_a_straggler_rebalance_is_taken_over(tmp_path, templates_cache):
    """node2 is slowed (the `slow` drill); the primary is killed -9 the moment it publishes the rebalanced
    plan (its recovery under way: members leaving the old generation, groups forming): the standby takes
    over from the durable state, and the job completes on the reference's trajectory with no checkpoint."""
    import os
    import signal
    import time

    from jobrun import JobRun, read_events

    from oobleck_slurm.cluster.lease import read_lease

    recipe = tiny_recipe(steps=70)  # the rebalance comes near step 20
    recipe["drills"] = [{"step": 10, "node": "node2", "how": "slow"}]
    job, primary, events, t0 = start_job(tmp_path, recipe, templates_cache)
    try:
        log = Events(events)
        wait_until("a rebalance", lambda: [e for e in log.kind("plan") if e["reason"] == "rebalance"])
        lease = read_lease(job)
        assert lease is not None and lease.pid == primary.pid
        os.kill(primary.pid, signal.SIGKILL)
        killed_at = time.time()
        primary.wait(30)
        (finished,) = wait_until("the end", lambda: log.kind("job_finished"))
    finally:
        if primary.poll() is None:
            os.killpg(primary.pid, signal.SIGKILL)
    assert finished["status"] == "completed", finished
    run = JobRun(job, 0, read_events(events), time.time() - t0)
    assert [e["epoch"] for e in run.kind("takeover")] == [2]
    assert [e for e in run.kind("resumed") if e["t"] > killed_at]
    # no member is declared lost: one that was cloning the dead primary's store when it was killed
    # follows the standby too (it was stuck in torch's connect retries past the reconfiguration timeout)
    assert not run.kind("checkpoint_fallback") and not run.kind("node_lost") and not run.kind("failure")
    assert_matches_reference(run)
