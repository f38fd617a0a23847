"""Smoke tests of the local Slurm lab: the Slurm behaviour the project relies on, on real daemons.

Each test leaves cleanup to the ``slurm`` marker's reset (tests/conftest.py). Timings are printed
(run with -s to see them), never asserted.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import submitit

from oobleck_slurm.cluster.slurm import parse_scontrol_records

pytestmark = pytest.mark.slurm


def wait_until(what: str, check, timeout: float = 30.0, every: float = 0.2):
    """Poll ``check()`` until it returns something truthy; return that, or fail after timeout."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not true after {timeout}s")
        time.sleep(every)
    return value


def job_fields(lab, job_id: str) -> dict[str, str]:
    """The job's ``scontrol show job -o`` record."""
    return parse_scontrol_records(lab.run("scontrol", "show", "job", "-o", job_id))[0]


def test_submitit_two_nodes_two_tasks_per_node(slurm_cluster, tmp_path: Path) -> None:
    def whoami() -> tuple[int, int, str]:
        import os

        import submitit

        env = submitit.JobEnvironment()
        return env.global_rank, env.local_rank, os.environ["SLURMD_NODENAME"]

    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(nodes=2, tasks_per_node=2, cpus_per_task=1, timeout_min=5)
    start = time.monotonic()
    results = executor.submit(whoami).results()
    print(f"submitit 2x2 job returned in {time.monotonic() - start:.1f}s: {results}")

    assert sorted(rank for rank, _, _ in results) == [0, 1, 2, 3]
    nodes = {node for _, _, node in results}
    assert len(nodes) == 2 and nodes <= set(slurm_cluster.nodes)
    for node in nodes:
        assert sorted(local for _, local, n in results if n == node) == [0, 1]


def beat(path: Path) -> float:
    """The time in a heartbeat file (written whole: the job renames a finished temporary file)."""
    return float(path.read_text())


def beating(beats: Path) -> list[str]:
    """Names of the nodes that have written a heartbeat."""
    return sorted(p.name for p in beats.iterdir() if p.suffix != ".tmp")


@pytest.mark.parametrize(
    ("srun_flags", "step_survives"),
    [
        ("--no-kill --kill-on-bad-exit=0", True),
        # --kill-on-bad-exit=0 alone is not enough: srun reports "Node failure" and force-terminates
        # the step's surviving tasks. Kept as a test because the project's design leans on this.
        ("--kill-on-bad-exit=0", False),
    ],
)
def test_no_kill_job_survives_a_downed_node(
    slurm_cluster, tmp_path: Path, srun_flags: str, step_survives: bool
) -> None:
    lab = slurm_cluster
    beats = tmp_path / "beats"
    beats.mkdir()
    script = tmp_path / "job.sh"
    # One task per node writes a heartbeat file named after its node.
    script.write_text(
        "#!/bin/bash\n"
        f"srun {srun_flags} bash -c "
        f"'while true; do date +%s.%N > {beats}/$SLURMD_NODENAME.tmp; "
        f"mv {beats}/$SLURMD_NODENAME.tmp {beats}/$SLURMD_NODENAME; sleep 0.2; done'\n"
        "echo srun exited $?\n"
        "sleep 300\n"
    )
    job = lab.run(
        "sbatch", "--parsable", "--no-kill", "--time=2", "--nodes=2", "--ntasks-per-node=1",
        f"--output={tmp_path}/slurm-%j.out", str(script),
    ).strip()
    wait_until("both heartbeats written", lambda: len(beating(beats)) == 2)
    fields = job_fields(lab, job)
    assert fields["JobState"] == "RUNNING"
    # Down the node that does not run the batch script: losing that one would end the job.
    victim, survivor = sorted(beating(beats), key=lambda n: n == fields["BatchHost"])

    start = time.monotonic()
    lab.set_down(victim, reason="test_no_kill")
    fields = wait_until(
        "NodeList shrinks to the survivor",
        lambda: (f := job_fields(lab, job))["NodeList"] == survivor and f,
    )
    print(f"NodeList {fields['NodeList']} {time.monotonic() - start:.1f}s after downing {victim}")
    assert fields["JobState"] == "RUNNING"
    assert "DOWN" in lab.node_state(victim)

    if step_survives:
        first = beat(beats / survivor)
        wait_until("survivor's heartbeat advances", lambda: beat(beats / survivor) > first + 2, timeout=15)
    else:
        wait_until(
            "survivor's task ends with its step",
            lambda: time.time() - beat(beats / survivor) > 2,
            timeout=15,
        )
    output = next(tmp_path.glob("slurm-*.out")).read_text()
    print(f"srun {srun_flags}: survivor {survivor} beating: {step_survives}; output: {output!r}")
    assert job_fields(lab, job)["JobState"] == "RUNNING"  # the job lives on either way

    lab.resume(victim)
    took = lab.wait_node(victim, "up", timeout=10)
    print(f"{victim} back {took:.1f}s after resume")


def test_killed_node_goes_down_and_comes_back(slurm_cluster, tmp_path: Path) -> None:
    lab = slurm_cluster
    node = lab.nodes[2]
    # A job on the node, so that there are stepds and tasks to kill with it.
    job = lab.run(
        "sbatch", "--parsable", f"--nodelist={node}", "--nodes=1", "--time=2",
        f"--output={tmp_path}/slurm-%j.out", "--wrap", "srun sleep 300",
    ).strip()
    wait_until(
        "the job's task runs",
        lambda: any(p.name() == "sleep" for p in lab.node_processes(node)),
    )
    procs = lab.node_processes(node)
    names = sorted(p.name() for p in procs)
    assert {"slurmd", "slurmstepd", "sleep"} <= set(names), names

    killed = lab.kill_node(node)
    assert killed == len(procs)
    assert lab.node_processes(node) == []
    silent = lab.wait_node(node, "not_responding", timeout=60)
    down = lab.wait_node(node, "down", timeout=60) + silent
    print(
        f"killed {killed} processes of {node} ({', '.join(names)}); Slurm: NOT_RESPONDING after "
        f"{silent:.1f}s, DOWN after {down:.1f}s; job {job} "
        f"{job_fields(lab, job).get('JobState')}"
    )

    back = lab.start_node(node)
    print(f"{node} idle {back:.1f}s after start_node")
    assert lab.node_state(node) == frozenset({"IDLE"})


def test_submitit_sees_a_cancelled_job_as_finished(slurm_cluster, tmp_path: Path) -> None:
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(nodes=1, tasks_per_node=1, timeout_min=5)
    job = executor.submit(time.sleep, 300)
    # squeue, not job.state: submitit asks sacct at 2, 4, 8, 16 s... after submission.
    wait_until(
        "job running",
        lambda: slurm_cluster.run("squeue", "-h", "-j", job.job_id, "-o", "%T").strip() == "RUNNING",
    )

    start = time.monotonic()
    job.cancel()
    wait_until("submitit sees the job done", job.done, timeout=60, every=0.5)
    print(f"submitit: {job.state} {time.monotonic() - start:.1f}s after cancel")
    # Not asserted: job.result() then raises UncompletedJobError, but only after waiting 15 s
    # (submitit's _results_timeout_s) for a result file that never comes.
    assert job.state.startswith("CANCELLED")


def test_spare_node_joins_and_takes_a_job(slurm_cluster, tmp_path: Path) -> None:
    lab = slurm_cluster
    assert "DOWN" in lab.node_state(lab.spare_nodes[0])
    start = time.monotonic()
    spare = lab.start_spare()
    print(f"spare {spare} idle {time.monotonic() - start:.1f}s after start_spare")
    assert spare == lab.spare_nodes[0]
    out = subprocess.run(
        ["srun", f"--nodelist={spare}", "--nodes=1", "--time=1", "printenv", "SLURMD_NODENAME"],
        env=lab.env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert out.strip() == spare
    lab.stop_spare(spare)
    assert "DOWN" in lab.node_state(spare)
    assert lab.node_processes(spare) == []


def test_the_time_limit_backstop_notifies_ahead_of_the_jobs_end(slurm_cluster, tmp_path: Path) -> None:
    """supervisor/main.py `TimeLimitNotice` reads the job's end from squeue and calls the notice
    `lead_s` before it, as Slurm's `--signal` would (and does not when it misses its window)."""
    import threading

    from oobleck_slurm.cluster.slurm import job_end_time
    from oobleck_slurm.supervisor.main import TimeLimitNotice

    lab = slurm_cluster
    job_id = lab.run("sbatch", "--parsable", "-N1", "--time=2", f"--output={tmp_path}/out", "--wrap", "sleep 300").strip()
    wait_until("the job runs", lambda: lab.run("squeue", "-h", "-j", job_id, "-o", "%T").strip() == "RUNNING")
    end = job_end_time(job_id)
    assert end is not None and 60 < end - time.time() <= 120
    got: list[str] = []
    notified = threading.Event()
    t0 = time.monotonic()
    watch = TimeLimitNotice(job_id, end - time.time() - 2.0, lambda name: (got.append(name), notified.set()))
    try:
        assert notified.wait(30), "no notice"
        assert got == ["SIGUSR2"] and time.monotonic() - t0 >= 1.0  # at the deadline, not at once
    finally:
        watch.stop()
        lab.run("scancel", job_id)
