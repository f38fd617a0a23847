"""`submit` on the local backend: a real job in its own processes, its folder, its exit codes."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from oobleck_slurm.protocol.events import read_events

REPO = Path(__file__).resolve().parents[2]


def submit(cwd: Path, *args: str, timeout: float = 300, terminal: bool = False) -> subprocess.CompletedProcess[str]:
    """`submit ARGS` in `cwd`; terminal=True makes rich draw as on a terminal (FORCE_COLOR) into the pipe."""
    env = {**os.environ, "FORCE_COLOR": "1"} if terminal else None
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", "submit", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_submit_on_a_terminal_draws_the_planning_progress_and_follows(tmp_path: Path) -> None:
    """On a terminal the planner reports to a progress bar (it was once handed the bar itself, which
    is not callable: a TypeError on every first submit); --no-dashboard then prints the steps, and
    --no-drills leaves the recipe's scripted failure out."""
    recipe = tmp_path / "short.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'local-tiny.yaml'}\ntraining:\n  steps: 6\n"
                      "drills:\n  - {step: 3, node: node2, how: worker}\n")
    result = submit(tmp_path, str(recipe), "--no-dashboard", "--no-drills", terminal=True)
    out = plain(result.stdout)
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"profiling layers .* 6/6", out) and re.search(r"generating templates .* (\d+)/\1", out), out
    assert "step 5/6: loss" in out and "job completed after" in out
    (job_dir,) = (tmp_path / "jobs").iterdir()
    assert f"folder: {job_dir}" in out.replace("\n", "")
    assert not read_events(job_dir / "events.jsonl", "drill") and not read_events(job_dir / "events.jsonl", "failure")
    assert re.search(r"summary: completed in [\d.]+ s; 6 of 6 steps; no failure", " ".join(out.split())), out
    assert any((tmp_path / "templates_cache").rglob("*.json")), "templates were not pregenerated"


def test_submit_detach_returns_while_the_job_runs(tmp_path: Path) -> None:
    recipe = tmp_path / "short.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes' / 'local-tiny.yaml'}\ntraining:\n  steps: 3\n")
    result = submit(tmp_path, str(recipe), "--detach")
    assert result.returncode == 0, result.stderr
    (job_dir,) = (tmp_path / "jobs").iterdir()
    pid = json.loads((job_dir / "meta.json").read_text())["pid"]
    subprocess.run(["python3", "-c", f"import os,time\nwhile os.path.exists('/proc/{pid}') and "
                    f"open('/proc/{pid}/stat').read().split()[2] != 'Z': time.sleep(0.2)"], timeout=300)
    assert [e["status"] for e in read_events(job_dir / "events.jsonl", "job_finished")] == ["completed"]
    assert stat.S_IMODE((job_dir / "secret").stat().st_mode) == 0o600
    assert json.loads((job_dir / "meta.json").read_text())["backend"] == "local"
    assert [e["step"] for e in read_events(job_dir / "events.jsonl", "step")] == list(range(3))


def test_default_submit_drills_a_failure_recovers_joins_and_summarises(tmp_path: Path) -> None:
    """The first run a user makes: the embedded default's scripted drill kills node2's worker at step
    40; the survivors recover from their replicas, a replacement joins, and the summary says so."""
    result = submit(tmp_path, "--no-dashboard", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (job_dir,) = (tmp_path / "jobs").iterdir()
    events = job_dir / "events.jsonl"
    (drill,) = read_events(events, "drill")
    assert (drill["node"], drill["how"], drill["ok"]) == ("node2", "worker", True) and drill["step"] >= 40
    assert [e["nodes"] for e in read_events(events, "failure")] == [["node2"]]
    assert [e["node"] for e in read_events(events, "node_joined")] == ["r1"]
    losses = {e["step"]: e["loss"] for e in read_events(events, "step")}  # it learns the shipped text
    assert losses[0] > 5.0 and sum(losses[s] for s in range(95, 100)) / 5 < losses[0] - 1.0, losses  # ~ln(256) at init
    sizes = [len(p["nodes"]) for p in read_events(events, "plan")[0]["pipelines"]]
    assert len(set(sizes)) > 1 and max(sizes) > 1, f"the default's first plan is not heterogeneous: {sizes}"
    from oobleck_slurm.dashboard.state import DashboardState

    board = DashboardState().apply_all(read_events(events))  # the dashboard knows every event the run wrote
    assert board.unknown_events == 0 and any(line.kind == "drill" for line in board.log)
    out = " ".join(plain(result.stdout).split())  # sentences, one per event that matters
    assert re.search(r"node2 lost at step \d+: its worker process exited, detected in [\d.]+ s", out), out
    assert re.search(r"training resumed at step \d+, [\d.]+ s after the fault", out), out
    # the default's replacement joins as a spare when the replan keeps the pipelines it has (issue: the
    # narration said "training goes on with it" for a node that trained nothing)
    spare = "r1" in (read_events(events, "plan")[-1].get("spares") or [])
    joined = ("joined as a spare \\(the plan keeps its pipelines\\), the change took" if spare
              else "joined: training goes on with it, the change took")
    assert re.search(rf"replacement r1 {joined} [\d.]+ s", out), out
    assert re.search(r"summary: completed in [\d.]+ s; 100 of 100 steps; 1 failure node2 lost at step \d+, "
                     r"detected in [\d.]+ s; training resumed [\d.]+ s after the fault replacement r1 joined", out), out
    assert "the trajectory went on unchanged: every step trained" in out and "no checkpoint loaded" in out
    assert f"report: python -m oobleck_slurm report {job_dir}" in out
    assert "=" not in plain(result.stdout).replace("==", "")  # no field dumps


def test_a_plan_that_cannot_fit_is_refused_before_launch_with_the_figures(tmp_path: Path) -> None:
    recipe = tmp_path / "small.yaml"
    recipe.write_text("cluster: {nodes: 4, memory_per_device: 1MB}\nmodel: {size: tiny}\n")
    result = submit(tmp_path, str(recipe), "--estimate", "A100-40")
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(r"fits on no node count up to 4: layer 1 \(block.00\) alone needs [\d.]+ MiB per device .* "
                     r"more than the usable 0.86 MiB", " ".join(result.stderr.split())), result.stderr
    assert not (tmp_path / "jobs").exists()


def test_submit_bad_recipe_exits_2_without_a_job(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("training:\n  microbatch_size: 0\n")
    result = submit(tmp_path, str(recipe))
    assert result.returncode == 2
    assert "training.microbatch_size: must be > 0" in result.stderr
    assert not (tmp_path / "jobs").exists()


def test_submitted_4x2_job_survives_kill_9_of_one_worker(tmp_path: Path) -> None:
    """The CLI drill: `submit` of 4 nodes x 2 workers (8 ranks, pipelines of 4 stages spanning two
    nodes; CAME, factored second moments), kill -9 of one worker process: its node (both its workers)
    is taken out, the survivors keep their processes, no checkpoint is involved, and every step's loss
    and the final parameters equal the failure-free single-process run (fp64, 1e-5 relative:
    tests/engine/test_exact.py)."""
    import signal
    import time

    import psutil
    from jobrun import JobRun, assert_matches_reference

    from oobleck_slurm.cluster.jobdir import JobDir

    recipe = tmp_path / "drill.yaml"
    recipe.write_text("name: drill\ncluster: {backend: local, nodes: 4, workers_per_node: 2, cpus_per_node: 2, "
                      "memory_per_device: 8MB}\nmodel: {size: tiny}\n"
                      "training: {global_batch_size: 16, microbatch_size: 2, steps: 24, precision: fp64, optimizer: {name: came}}\n"
                      "fault_tolerance: {f: 0, checkpoint_interval: 0, replacement: none}\n")
    result = submit(tmp_path, str(recipe), "--detach", "--estimate", "A100-40")
    assert result.returncode == 0, result.stderr
    (job_dir,) = (tmp_path / "jobs").iterdir()
    events = job_dir / "events.jsonl"
    deadline = time.monotonic() + 180
    while not [e for e in read_events(events, "step") if e["step"] >= 3]:
        assert time.monotonic() < deadline, "the job never reached step 3"
        time.sleep(0.1)

    def workers() -> dict[tuple[str, str], int]:
        found = {}
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "oobleck_slurm.engine.elastic_process" in cmd and str(job_dir) in cmd:
                found[(cmd[-2], cmd[-1])] = p.pid
        return found

    before = workers()
    assert sorted(before) == [(f"node{n}", str(w)) for n in range(1, 5) for w in (0, 1)]
    psutil.Process(before[("node2", "1")]).send_signal(signal.SIGKILL)
    first_plan = read_events(events, "plan")[0]
    assert first_plan["ranks"] == 8 and first_plan["workers_per_node"] == 2
    assert [len(p["nodes"]) for p in first_plan["pipelines"]] == [2, 2]
    for p in first_plan["pipelines"]:  # 4 stages over the 2 workers of each of 2 nodes
        assert [(s["node"], s["worker"]) for s in p["stages"]] == [(n, w) for n in p["nodes"] for w in (0, 1)]
    assert sorted(s["rank"] for p in first_plan["pipelines"] for s in p["stages"]) == list(range(8))
    # `submit --estimate` plans the job exactly as `plan --estimate` shows it
    shown = subprocess.run([sys.executable, "-m", "oobleck_slurm", "plan", str(recipe), "--estimate", "A100-40",
                            "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    layers = lambda p: [[s["start"], s["stop"]] for s in p["template"]["stages"]]  # noqa: E731
    assert [layers(p) for p in json.loads(shown.stdout)["plan"]["pipelines"]] == [
        [s["layers"] for s in p["stages"]] for p in first_plan["pipelines"]]

    while not read_events(events, "job_finished"):
        assert time.monotonic() < deadline + 180, "the job did not finish after the kill"
        time.sleep(0.2)
    (finished,) = read_events(events, "job_finished")
    assert finished["status"] == "completed", finished
    run = JobRun(JobDir.at(job_dir), finished["exit_code"], read_events(events), 0.0)
    (failure,) = run.kind("failure")
    assert failure["nodes"] == ["node2"] and failure["generation"] == 0
    assert [(e["node"], e["cause"]) for e in run.kind("node_lost")] == [("node2", "process_exit")]
    final = run.kind("plan")[-1]
    assert "node2" not in {n for p in final["pipelines"] for n in p["nodes"]} | set(final["spares"])
    assert not run.kind("checkpoint_fallback")
    # every survivor kept its process: one log per worker, and none of them restarted
    assert sorted(p.name for p in (job_dir / "logs").glob("worker-*.log")) == [
        f"worker-node{n}-{w}.log" for n in range(1, 5) for w in (0, 1)]
    assert_matches_reference(run)  # every step once, its loss and the final parameters
