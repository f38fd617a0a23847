"""Run a job the way `submit` runs it (oobleck_slurm.submission: prepare_job + start_local: supervisor,
agents, workers as real processes) and read what it produced: its events and its final checkpoint.

A recipe is given as a dict (written to YAML and loaded like a user's file). Tests use `--estimate`-style
profiles (`estimate`) so that plans are the same on every machine, and one templates cache per session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from oobleck_slurm.cluster.jobdir import SUPERVISOR_ERROR, JobDir
from oobleck_slurm.engine.checkpoint import LAYER_SUFFIX, read_layer_file
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.protocol.events import events_path, read_events
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.submission import prepare_job, start_local

LOG_TAIL_CHARS = 3000


def tiny_recipe(*, nodes: int = 4, workers: int = 1, steps: int = 5, f: int = 1, optimizer: str = "adamw",
                precision: str = "fp64", memory: str | None = None, **fault_tolerance: Any) -> dict[str, Any]:
    """The tiny GPT (6 layers) on the shipped text: 8 microbatches of 2 per step."""
    cluster: dict[str, Any] = {"backend": "local", "nodes": nodes, "workers_per_node": workers, "cpus_per_node": workers}
    if memory is not None:
        cluster["memory_per_device"] = memory
    return {
        "name": "t", "cluster": cluster, "model": {"size": "tiny"},
        "training": {"global_batch_size": 16, "microbatch_size": 2, "steps": steps, "precision": precision,
                     "optimizer": {"name": optimizer, "lr": 3.0e-3, "weight_decay": 0.1},
                     "lr_schedule": {"warmup_steps": 2}},
        # Generous collective timeouts: the tests share 2 cores with other work, and a spurious collective
        # timeout re-forms the members (correct, but it shifts generation numbers); kills are detected
        # by their process exits, not by timeouts.
        "fault_tolerance": {"f": f, "checkpoint_interval": 0, "replacement": "none", "collective_timeout": 10.0,
                            "heartbeat_lease": 12.0, "step_timeout": 60.0, **fault_tolerance},
    }


@dataclass
class JobRun:
    job: JobDir
    exit_code: int  # -1: stopped after its timeout
    events: list[dict[str, Any]]
    wall_s: float  # from the start to the supervisor's exit

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["kind"] == kind), None)

    def losses(self) -> dict[int, float]:
        """The last reported loss of each step (a replayed step reports again)."""
        return {e["step"]: e["loss"] for e in self.kind("step")}

    def spec(self) -> JobSpec:
        return JobSpec.from_json(self.job.job_spec.read_text())

    def final_params(self, kind: str = "param") -> dict[str, dict[str, torch.Tensor]]:
        """The final checkpoint's parameters (`kind` "state": optimizer state), by layer key then name."""
        steps = self.spec().train.steps
        out = {}
        for path in sorted((self.job.checkpoints / f"step{steps}").glob(f"*{LAYER_SUFFIX}")):
            payload = read_layer_file(path, steps)  # tensors the job itself wrote
            out[path.name[: -len(LAYER_SUFFIX)]] = {k[len(kind) + 1:]: v for k, v in payload.items()
                                                    if k.startswith(f"{kind}.")}
        return out

    def log_tails(self) -> str:
        tails = []
        for path in [*sorted(self.job.logs.glob("*.log")), self.job.logs / SUPERVISOR_ERROR]:
            if path.is_file():
                tails.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-LOG_TAIL_CHARS:]}")
        return "\n".join(tails)


def start_and_wait(job: JobDir, timeout: float) -> JobRun:
    """Start a prepared job on the local backend (`start_local`, as `submit` does) and wait for its
    supervisor to exit; a job still running after `timeout` s is killed (its whole process session)
    and comes back with exit code -1."""
    t0 = time.time()
    process = start_local(job)
    try:
        code = process.wait(timeout)
        if code < 0:  # killed: a standby supervisor takes over (docs/failover.md); the job ends when it says so
            code = _taken_over_end(job, code, t0 + timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = -1
    return JobRun(job, code, read_events(events_path(job.path)), time.time() - t0)


def _taken_over_end(job: JobDir, code: int, deadline: float) -> int:
    """The exit code of the job that a standby took over from the killed supervisor (`code` if none did
    within the lease)."""
    from oobleck_slurm.cluster.lease import current_epoch

    claim_by = time.time() + 2 * job.recipe().fault_tolerance.heartbeat_lease
    while current_epoch(job) <= 1 and time.time() < claim_by:
        time.sleep(0.05)
    if current_epoch(job) <= 1:
        return code
    while not (finished := read_events(events_path(job.path), "job_finished")):
        if time.time() > deadline:
            raise subprocess.TimeoutExpired("the job after a takeover", deadline)
        time.sleep(0.1)
    return int(finished[-1]["exit_code"])


def run_job(tmp_path: Path, recipe: dict[str, Any], cache_dir: Path, *, faults: list[dict[str, Any]] | None = None,
            estimate: str | None = "A100-40", timeout: float = 300.0, expect_exit: int | None = 0,
            alongside: Callable[[JobDir], None] | None = None) -> JobRun:
    """Submit `recipe` on the local backend and wait for the job to end (or `timeout`: it is stopped
    and the test fails with the logs). `alongside(job)` runs in a thread from the job's start (a
    process that meddles with the running job)."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    job = prepare_job(load_recipe(path), cache_dir=cache_dir, estimate_gpu=estimate, job_root=tmp_path / "jobs",
                      faults=faults)
    if alongside is not None:
        threading.Thread(target=alongside, args=(job,), name="alongside", daemon=True).start()
    run = start_and_wait(job, timeout)
    if run.exit_code == -1:
        raise AssertionError(f"job did not finish within {timeout:g} s\n{run.log_tails()}")
    if expect_exit is not None:
        assert run.exit_code == expect_exit, f"job exited {run.exit_code}, expected {expect_exit}\n{run.log_tails()}"
    return run


def assert_matches_reference(run: JobRun, rtol: float = 1e-5, optimizer_state: bool = False) -> None:
    """Every step's loss and the final checkpoint's parameters (with `optimizer_state`, its optimizer
    state too, step counters included) equal the single-process reference (tests/reference.py) within
    `rtol` relative (max element-wise error over the tensor's max); fp64 jobs: see
    tests/engine/test_exact.py for why 1e-5 separates errors from rounding."""
    from reference import reference_evals, reference_optimizer_state, train_reference

    spec = run.spec()
    ref_losses, ref_params = train_reference(spec)
    losses = run.losses()
    assert sorted(losses) == list(range(spec.train.steps))
    for step, ref in enumerate(ref_losses):
        assert abs(losses[step] - ref) <= rtol * abs(ref), (step, losses[step], ref)
    if spec.train.eval_interval:  # every evaluation, repeated ones after a recovery included
        ref_evals = reference_evals(spec)
        evals = [(e["step"], e["loss"]) for e in run.kind("eval")]
        assert {step for step, _ in evals} == set(ref_evals), (evals, ref_evals)
        for step, loss in evals:
            assert abs(loss - ref_evals[step]) <= rtol * abs(ref_evals[step]), (step, loss, ref_evals[step])
    params = run.final_params()
    assert sorted(params) == sorted(ref_params)  # every layer is in the final checkpoint
    assert_tensors_match(params, ref_params, rtol)
    if optimizer_state:
        assert_tensors_match(run.final_params("state"), reference_optimizer_state(spec), rtol)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-6  # training moved: the comparison can fail


def assert_tensors_match(got: dict[str, dict[str, torch.Tensor]], ref: dict[str, dict[str, torch.Tensor]],
                         rtol: float) -> None:
    """The same layers and tensor names, each tensor within `rtol` relative (max element-wise error over
    the reference's max: a step counter one off is an error of 1/steps)."""
    assert sorted(got) == sorted(ref)
    for key, tensors in ref.items():
        assert sorted(got[key]) == sorted(tensors), key
        for name, r in tensors.items():
            g = got[key][name].to(r.device)
            assert g.shape == r.shape and g.dtype == r.dtype, (key, name, g.shape, r.shape, g.dtype, r.dtype)
            err = float((g.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-12)) if r.numel() else 0.0
            assert err <= rtol, f"{key}.{name}: relative error {err:.2e}"
