"""Section (f) two_stage_pipeline: a 2-stage pipeline from the planner in two processes (NCCL, or gloo
plain and under NCCL's ordering rules on a CPU), bitwise against a one-stage run.

In full: the package's docstring (the command's --help).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import (
    PIPELINE_SECRET,
    Record,
    Settings,
    child_env,
    compare,
    free_device_memory,
    last_error_line,
    master_store,
    median,
    planned,
    ranks_on_gpus,
    reproducible,
    run_children,
    snapshot,
    start_worker,
    sync,
)
from acceptance.references import run_uninterrupted

if TYPE_CHECKING:
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec


def child_pipeline(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """One stage of the 2-stage pipeline: Worker + generation, `steps` steps, then its state."""
    from oobleck_slurm.engine.comm import connect_store
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec

    job = JobSpec.from_json(config["job"])
    plan = ExecPlan.from_json(config["plan"])
    rank = int(config["rank"])
    device = torch.device("cuda", int(config["cuda_index"])) if s.cuda else torch.device("cpu")
    # signed as a worker's (protocol/signed_store.py): NCCL's rendezvous goes through the Python store
    store = connect_store("127.0.0.1", int(config["port"]), s.timeouts(), PIPELINE_SECRET, None, f"rank {rank}")
    with reproducible(s) as nondeterministic:
        t0 = time.perf_counter()
        worker, gen = start_worker(s, job, plan, store, rank=rank, world=int(config.get("world", 2)), device=device)
        build_s = time.perf_counter() - t0
        steps = []
        for _ in range(job.train.steps):
            sync(device)
            t0 = time.perf_counter()
            r = worker.train_step()
            sync(device)
            steps.append({"step": r.step, "loss": r.loss, "seconds": time.perf_counter() - t0,
                          "compute_seconds": r.compute_seconds, "peak_memory": r.peak_memory})
        gen.wait(gen.world.barrier())
    torch.save(snapshot(worker), config["state"])
    return {"rank": rank, "device": str(device), "groups_and_layers_s": build_s, "steps": steps,
            "layers": sorted(worker.layers), "nondeterminism_warnings": nondeterministic}


def pipeline_variants(s: Settings) -> dict[str, tuple[list[int], dict[str, str]]]:
    """name -> (the CUDA device of each rank, extra environment). Raises Skipped where no second rank
    can run. On a CPU two runs: plain gloo (a CPU job's groups) and gloo under NCCL's ordering rules
    (engine/nccl_order.py: what deadlocks on NCCL deadlocks there too)."""
    if not s.cuda:
        return {"gloo": ([0, 0], {"OOBLECK_NCCL_ORDER": "0"}),
                "gloo_nccl_order": ([0, 0], {"OOBLECK_NCCL_ORDER": "1"})}
    devices, env, name = ranks_on_gpus(s, 2)
    return {name: (devices, env)}


def run_pipeline(s: Settings, job: JobSpec, plan: ExecPlan, devices: list[int], env_extra: dict[str, str],
                 rec: Record, name: str) -> dict[str, torch.Tensor] | None:
    """Every rank of `plan` (one per entry of `devices`) in child processes; checks recorded under
    `name`; the union of their trained states (None if a rank did not deliver it). A wide stage's ranks
    each hold a shard: `snapshot` gathers whole layers on every rank of the stage."""
    store = master_store()
    world = len(devices)
    with tempfile.TemporaryDirectory(prefix="gpu_acceptance_pipe_") as tmp:
        folder = Path(tmp)
        paths = [folder / f"state{r}.pt" for r in range(world)]
        configs: list[dict[str, Any]] = [
            {"settings": dataclasses.asdict(s), "job": job.to_json(), "plan": plan.to_json(), "rank": r,
             "world": world, "port": store.port, "cuda_index": devices[r], "state": str(paths[r])}
            for r in range(world)]
        free_device_memory()
        runs = run_children("pipeline", configs, child_env(s, env_extra), s.child_timeout_s, folder)
        states = [torch.load(path) if path.exists() else None for path in paths]
    out: dict[str, Any] = {"devices": devices, "env": env_extra, "ranks": [
        {"exit_code": r.returncode, "seconds": r.seconds, "result": r.result,
         **({"output_tail": r.stderr_tail[-4000:]} if r.returncode != 0 else {})} for r in runs]}
    rec.results.setdefault("runs", {})[name] = out
    hung = [i for i, r in enumerate(runs) if r.returncode is None]
    rec.check(f"{name}_no_hang", not hung, f"rank(s) {hung} still running after {s.child_timeout_s:g} s (killed; "
              f"their stacks are in results.runs.{name}.ranks[].output_tail)")
    if not hung:
        rec.check(f"{name}_exit_0", all(r.returncode == 0 for r in runs),
                  "; ".join(f"rank {i}: exit {r.returncode}: {last_error_line(r.stderr_tail)}"
                            for i, r in enumerate(runs) if r.returncode != 0))
    first, last = runs[0].result, runs[-1].result
    if first is None or last is None or any(x is None for x in states):
        return None
    losses = [x["loss"] for x in last["steps"]]  # every rank reports the step's loss (the metrics all-reduce)
    step_s = [x["seconds"] for x in first["steps"]]
    out.update(losses=losses, median_step_s=median(step_s[1:] or step_s))
    rec.check(f"{name}_losses_finite", all(math.isfinite(x) for x in losses), f"losses {losses}")
    return {k: v for st in states if st is not None for k, v in st.items()}


def section_two_stage_pipeline(s: Settings, rec: Record) -> None:
    variants = pipeline_variants(s)
    job = s.job(steps=s.pipe_steps, microbatch_size=s.pipe_microbatch_size, microbatches=s.pipe_microbatches,
                deterministic=True)
    plan, _profile, _plan = planned(s, job, 2)
    g = job.model.config
    element = torch.tensor([], dtype=job.train.param_dtype).element_size()
    boundary = job.train.microbatch_size * g.seq_len * g.d_model * element  # what crosses the stage boundary
    rec.results["config"] = {"model": dataclasses.asdict(g), "plan": plan.to_json(), "steps": job.train.steps,
                             "microbatch_size": job.train.microbatch_size,
                             "microbatches": job.train.num_microbatches,
                             "activation_bytes_per_microbatch": boundary, "backend": job.backend}
    states = {name: run_pipeline(s, job, plan, devices, env, rec, name) for name, (devices, env) in variants.items()}
    if any(st is not None for st in states.values()):
        # The engine detaches at every layer boundary: two stages compute what one stage computes.
        with reproducible(s) as nondeterministic:
            one_plan, _, _ = planned(s, job, 1)
            reference, ref_losses = run_uninterrupted(s, job, one_plan)
            free_device_memory()
        rec.results["one_stage_losses"] = [ref_losses[i] for i in sorted(ref_losses)]
        rec.results["reference_nondeterminism_warnings"] = nondeterministic
        for name, st in states.items():
            if st is None:
                continue
            cmp = compare(reference, st)
            rec.results["runs"][name]["vs_one_stage"] = cmp
            rec.check(f"{name}_state_bitwise_equal_to_one_stage", cmp["equal"],
                      f"{cmp['differing']} of {cmp['tensors']} tensors differ (max |diff| {cmp['max_abs_diff']:.3g})")
    runs = rec.results.get("runs", {})
    timing = ", ".join(f"{n} {r['median_step_s']:.3f} s/step" for n, r in runs.items() if "median_step_s" in r)
    rec.summary = (f"2 stages {list(plan.pipelines[0].bounds)}, {job.train.num_microbatches} microbatches of "
                   f"{boundary / 2**20:.2f} MiB activations: " + (timing or "no run completed"))
