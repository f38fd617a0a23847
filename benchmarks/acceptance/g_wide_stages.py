"""Section (g) wide_stages: wide and folded stages on several NCCL ranks (gloo on a CPU), within
`WIDE_TOLERANCE` of one rank's run.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import (
    PIPELINE_SECRET,
    WIDE_TOLERANCE,
    Record,
    Settings,
    child_env,
    compare,
    free_device_memory,
    last_error_line,
    master_store,
    planned,
    ranks_on_gpus,
    release,
    reproducible,
    run_children,
    start_worker,
)

if TYPE_CHECKING:
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.worker import Worker


def whole_layers(worker: Worker) -> dict[str, torch.Tensor]:
    """Every layer whole (parameters, buffers, optimizer state), by layer key: gathered from a wide
    stage's shards (every rank of the stage must call it; its first rank gets the layers)."""
    out: dict[str, torch.Tensor] = {}
    for i in sorted(worker.layers):
        payload = worker.layer_payload(i)
        for name, t in (payload or {}).items():
            if isinstance(t, torch.Tensor):
                out[f"{worker.keys[i]}/{name}"] = t
    return out


def child_stage(s: Settings, config: dict[str, Any]) -> dict[str, Any]:
    """One rank of a hand-set plan (section g): `steps` steps, then its whole layers (a wide stage's
    first rank) to `state`."""
    from oobleck_slurm.engine.comm import connect_store
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.spec import JobSpec

    job = JobSpec.from_json(config["job"])
    plan = ExecPlan.from_json(config["plan"])
    rank, world = int(config["rank"]), int(config["world"])
    device = torch.device("cuda", int(config["cuda_index"])) if s.cuda else torch.device("cpu")
    store = connect_store("127.0.0.1", int(config["port"]), s.timeouts(), PIPELINE_SECRET, None, f"rank {rank}")
    with reproducible(s) as nondeterministic:
        worker, gen = start_worker(s, job, plan, store, rank=rank, world=world, device=device)
        losses = [worker.train_step().loss for _ in range(job.train.steps)]
        state = whole_layers(worker)
        gen.wait(gen.world.barrier())
    torch.save(state, config["state"])
    peak = torch.cuda.max_memory_allocated(device) if s.cuda else None
    return {"rank": rank, "losses": losses, "peak_memory_allocated": peak, "nondeterminism_warnings": nondeterministic}


def wide_plans(s: Settings, one: ExecPlan) -> dict[str, tuple[ExecPlan, int]]:
    """name -> (a one-pipeline plan whose only stage spans 4 ranks, its microbatch size): kept (gathered
    once a step), resharded (ZeRO-3: gathered around each use) and folded (microbatches of 2 on 4 ranks:
    2 microbatches a pass, planning.cost.stage_fold)."""
    from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec

    n, m = one.num_layers, one.num_microbatches
    def stage(keep: bool) -> ExecPlan:
        return ExecPlan(n, m, (PipelineSpec((0,), (0, n), 0, m, (4,), (keep,)),))
    return {"kept_4_wide": (stage(True), 4), "resharded_4_wide": (stage(False), 4), "folded_4_wide": (stage(True), 2)}


def section_wide_stages(s: Settings, rec: Record) -> None:
    devices, env, name = ranks_on_gpus(s, 4) if s.cuda else ([0] * 4, {"OOBLECK_NCCL_ORDER": "1"}, "gloo_nccl_order")
    rec.results["ranks"] = name
    runs: dict[str, Any] = {}
    for variant, (plan, mbs) in wide_plans(s, planned(s, s.job(steps=1), 1)[0]).items():
        job = s.job(steps=s.pipe_steps, microbatch_size=mbs, microbatches=4, deterministic=True)
        one_plan, _, _ = planned(s, job, 1)
        with reproducible(s):
            store = master_store()
            ref_worker, ref_gen = start_worker(s, job, one_plan, store)
            initial = whole_layers(ref_worker)
            ref_losses = [ref_worker.train_step().loss for _ in range(job.train.steps)]
            reference = whole_layers(ref_worker)
            release(ref_gen)
            del ref_worker
            free_device_memory()
        with tempfile.TemporaryDirectory(prefix="gpu_acceptance_wide_") as tmp:
            folder, store = Path(tmp), master_store()
            paths = [folder / f"state{r}.pt" for r in range(4)]
            configs = [{"settings": dataclasses.asdict(s), "job": job.to_json(), "plan": plan.to_json(), "rank": r,
                        "world": 4, "port": store.port, "cuda_index": devices[r], "state": str(paths[r])}
                       for r in range(4)]
            children = run_children("stage", configs, child_env(s, env), s.child_timeout_s, folder)
            state = torch.load(paths[0]) if paths[0].exists() else None
        out: dict[str, Any] = {"microbatch_size": mbs, "plan": plan.to_json(), "one_rank_losses": ref_losses,
                               "ranks": [{"exit_code": c.returncode, "seconds": c.seconds, "result": c.result,
                                          **({"output_tail": c.stderr_tail[-3000:]} if c.returncode != 0 else {})}
                                         for c in children]}
        runs[variant] = out
        rec.check(f"{variant}_exit_0", all(c.returncode == 0 for c in children),
                  "; ".join(f"rank {i}: exit {c.returncode}: {last_error_line(c.stderr_tail)}"
                            for i, c in enumerate(children) if c.returncode != 0))
        if state is None or children[0].result is None:
            continue
        cmp = compare(reference, state)
        # A stage of 4 ranks sums each gradient in another order than one rank (4 partial sums, then the
        # reduce-scatter): not bitwise, so the check is that the two runs moved the model the same way:
        # the difference between them is small against the update itself.
        moved = sum(float((reference[k].double() - initial[k].double()).norm() ** 2) for k in reference
                    if k in initial and reference[k].is_floating_point()) ** 0.5
        apart = sum(float((reference[k].double() - state[k].double()).norm() ** 2) for k in reference
                    if k in state and reference[k].is_floating_point()) ** 0.5
        losses = children[0].result["losses"]
        out.update(vs_one_rank=cmp, update_norm=moved, difference_norm=apart, losses=losses,
                   relative_difference=apart / moved if moved else None)
        rec.check(f"{variant}_same_layers", not cmp["missing_names"], f"missing {cmp['missing_names']}")
        rec.check(f"{variant}_close_to_one_rank", moved > 0 and apart / moved < WIDE_TOLERANCE[s.precision],
                  f"|wide - one rank| / |update| = {apart / moved if moved else float('nan'):.3g} "
                  f"(bitwise: {cmp['equal']}, max |diff| {cmp['max_abs_diff']:.3g})")
        rec.check(f"{variant}_losses_close", all(math.isclose(a, b, rel_tol=WIDE_TOLERANCE[s.precision])
                                                 for a, b in zip(losses, ref_losses, strict=True)),
                  f"{losses} vs one rank {ref_losses}")
    rec.results["runs"] = runs
    rec.summary = ", ".join(f"{v}: {r['relative_difference']:.2g} of the update apart from one rank"
                            for v, r in runs.items() if r.get("relative_difference") is not None) or "no run completed"
