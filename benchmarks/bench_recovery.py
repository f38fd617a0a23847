"""Recovery time: checkpoint-free recovery against checkpoint-restart, on the same failure.

    python benchmarks/bench_recovery.py [--models tiny,100m] [--json benchmarks/results/bench_recovery.json]

For each model: 4 local virtual nodes (one worker process each, gloo, one thread), 2 pipelines of
2 nodes, f=1, fp32, AdamW. Node 1 is killed with SIGKILL in the middle of step KILL_STEP (at its
third wait on a collective). Two runs, same seed and failure:
- memory:     checkpoint-free recovery (abort, re-form groups, copy layers from replicas, replay
              the step); a replacement node is then started and joins.
- checkpoint: every worker is stopped and restarted, loads the last checkpoint (every
              CHECKPOINT_INTERVAL steps, written asynchronously) and redoes the steps since.
Recovery time = from the kill to the completion of the interrupted step (both modes). For memory
mode, its split (detection, replan, group rebuild, state copy, replay) comes from the event log.
Throughput (samples/s, median of rank 0's step times) before the failure, degraded, after the join.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from oobleck_slurm.engine.comm import Timeouts
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models.config import gpt_config
from oobleck_slurm.planning import estimate_profile, generate_templates, instantiate
from oobleck_slurm.supervisor.local import run_elastic_local

KILL_STEP = 3
CHECKPOINT_INTERVAL = 2
SETTINGS = {  # steps, microbatch size, microbatches per step
    "tiny": (40, 2, 8),
    "100m": (7, 1, 4),
}
TIMEOUTS = Timeouts(store=120, connect=300, collective=120, step=600, run=1800)


def job_for(model: str) -> JobSpec:
    steps, mbs, nmb = SETTINGS[model]
    return JobSpec(
        model=ModelSpec(gpt_config(model)), data=DataSpec("random", num_samples=4096, seed=1),
        optim=OptimSpec("adamw", lr=1e-3), train=TrainSpec(steps=steps, microbatch_size=mbs, num_microbatches=nmb,
                                                          seed=0, warmup_steps=1),
        extra={"faults": [{"node": 1, "step": KILL_STEP, "at": "wait:3"}]})


def phases(events: list[dict]) -> dict:
    """Recovery figures of the first failure, from the event log."""
    first = lambda kind: next(e for e in events if e["kind"] == kind)  # noqa: E731
    failure, detection = first("failure"), first("detection")
    t_kill = failure["t"] - detection["seconds"]
    step = failure["step"]
    done = next(e for e in events if e["kind"] == "step" and e["t"] > failure["t"] and e["step"] >= step)
    before = [e["seconds"] for e in events if e["kind"] == "step" and e["generation"] == 0][1:]
    step_s = statistics.median(before) if before else 0.0
    # overhead: the recovery minus one normal step (the interrupted step must be computed anyway)
    out = {"failed_step": step, "recovery_s": done["t"] - t_kill, "step_s_before": step_s,
           "overhead_s": done["t"] - t_kill - step_s, "detection_s": detection["seconds"]}
    for kind in ("replan", "group_rebuild", "state_copy", "replay"):
        e = [x for x in events if x["kind"] == kind]
        if e:
            out[f"{kind}_s"] = e[0]["seconds"]
    copies = [x for x in events if x["kind"] == "state_copy"]
    if copies:
        out["state_copy_bytes"] = copies[0]["bytes"]
    return out


def throughput(events: list[dict]) -> dict:
    steps = [e for e in events if e["kind"] == "step"]
    plans = [e for e in events if e["kind"] == "plan"]
    by_gen: dict[int, list[float]] = {}
    for e in steps[1:]:  # the first step warms up
        by_gen.setdefault(e["generation"], []).append(e["samples_per_s"])
    reasons = {p["generation"]: p["reason"] for p in plans}
    out = {}
    for g, values in by_gen.items():
        label = {"initial": "before", "failure": "degraded", "join": "after_join"}.get(reasons.get(g), f"gen{g}")
        rest = values[1:] if len(values) > 2 and label != "before" else values  # first step after a change warms up
        out[label] = statistics.median(rest)
    return out


def bench(model: str) -> dict:
    job = job_for(model)
    profile = estimate_profile(job.model.gpt, "A100-40", microbatch_size=job.train.microbatch_size,
                               devices_per_node=1)
    templates = generate_templates(profile, 4, num_microbatches=job.train.num_microbatches // 2)
    two = [t for t in templates if t.num_nodes == 2]
    plan = instantiate(two, 4, 1, job.train.num_microbatches, microbatch_size=job.train.microbatch_size)
    layer_bytes = [int(x.param_bytes + x.optimizer_bytes) for x in profile.layers]
    params = sum(p.numel() for layer in __import__("oobleck_slurm.models.gpt", fromlist=["x"]).build_layers(
        job.model.gpt, 0, 0, job.model.num_layers) for p in layer.parameters())
    result = {"model": model, "parameters": params, "steps": job.train.steps, "kill_step": KILL_STEP,
              "checkpoint_interval": CHECKPOINT_INTERVAL}
    for mode in ("memory", "checkpoint"):
        with tempfile.TemporaryDirectory(prefix=f"bench_recovery_{model}_{mode}_") as d:
            t0 = time.time()
            run = run_elastic_local(job, plan, templates, d, f=1, timeouts=TIMEOUTS, mode=mode,
                                    replacement=mode == "memory", layer_bytes=layer_bytes,
                                    checkpoint_interval=CHECKPOINT_INTERVAL if mode == "checkpoint" else 0)
            result[mode] = {**phases(run.events), "throughput": throughput(run.events),
                            "wall_s": time.time() - t0}
            if mode == "checkpoint":
                cks = [e for e in run.events if e["kind"] == "checkpoint"]
                result[mode]["checkpoint_write_s"] = max((e["seconds"] for e in cks), default=None)
        print(f"  {model} {mode}: recovery {result[mode]['recovery_s']:.2f} s", file=sys.stderr)
    result["speedup"] = result["checkpoint"]["recovery_s"] / result["memory"]["recovery_s"]
    return result


def table(results: list[dict]) -> str:
    rows = ["| model | params | mode | recovery s (minus one step) | detection | replan | group rebuild | state copy (MB) | replay "
            "| samples/s before / degraded / after join |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in results:
        for mode in ("memory", "checkpoint"):
            m = r[mode]
            tp = m["throughput"]
            copy = f"{fmt(m.get('state_copy_s'))} ({m.get('state_copy_bytes', 0) / 1e6:.1f})" if mode == "memory" else "-"
            rows.append(
                f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {mode} | {m['recovery_s']:.2f} ({m['overhead_s']:.2f}) | {fmt(m.get('detection_s'))} "
                f"| {fmt(m.get('replan_s'))} | {fmt(m.get('group_rebuild_s'))} | {copy} | {fmt(m.get('replay_s'))} "
                f"| {' / '.join(fmt(tp.get(k)) for k in ('before', 'degraded', 'after_join'))} |")
        rows.append(f"| {r['model']} | | ratio | checkpoint-restart / memory = {r['speedup']:.1f}x | | | | | | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--json", default="benchmarks/results/bench_recovery.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = [bench(m) for m in args.models.split(",")]
    print(table(results))
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                       "cpus": __import__("os").cpu_count()}, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
