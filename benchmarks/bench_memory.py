"""Bytes per parameter a worker holds at a step's peak: the engine against a plain PyTorch loop, and the
planner's prediction for the same stage.

    python benchmarks/bench_memory.py [--preset 100m] [--quick] [--optimizers adamw came]
                                      [--precisions fp32 bf16] [--microbatch-size 2] [--microbatches 2]
                                      [--steps 2] [--device cpu|cuda]

One configuration = model x optimizer x precision x microbatches. For each, two measurements, each in
its own fresh process:
- engine: the production path. The planner plans "a whole replica per node" (a measured profile of
  the model, `generate_templates` for one node of one device, `instantiate`, then
  `engine.from_planner.exec_plan`: one stage with every layer); a `Worker` adopts that plan on a real
  gloo Generation (`engine.abort.build_generation`, as ElasticWorker does; nccl with --device cuda)
  with the fault-tolerance machinery ElasticWorker runs around its steps (`FaultTolerance` below: the
  one place that changes when the pre-step copy is replaced), and runs `train_step()`.
- plain: the same layers (`models.gpt.build_layers` in an nn.Sequential), the same microbatches and
  global-norm clip, in the loop anyone would write: zero_grad, per microbatch forward (bf16: under
  autocast) + backward, clip_grad_norm_, optimizer step; torch.optim.AdamW(foreach=True), or CAME
  from oobleck_slurm.optim.
Held bytes = the step's peak above a baseline taken before the layers exist
(`oobleck_slurm.peak_memory.PeakMemory`: peak RSS per step on CPU, with glibc set to return
freed memory to the OS so that RSS follows the live tensors; max_memory_allocated on CUDA), at the
last of `--steps` steps (the first creates gradients and optimizer state). Overhead = engine / plain
- 1. planner = `cost.stage_memory` of that stage (what `generate_templates` checks against the
device's memory), for the figures to be set side by side.

Writes benchmarks/results/bench_memory.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "bench_memory.json"
NODE = "node0"  # the one node of the measured job
MEASURE_TIMEOUT_S = 3600
QUICK = {"n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 128}  # --quick: ~3.3M parameters, seconds


def job_spec(c: dict[str, Any]) -> Any:
    """The JobSpec of a configuration: random tokens, so no file is read."""
    from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
    from oobleck_slurm.models import GPTConfig

    m, mbs = c["microbatches"], c["microbatch_size"]
    return JobSpec(
        model=ModelSpec(GPTConfig(**c["gpt"])),
        data=DataSpec("random", num_samples=max(64, 4 * m * mbs), seed=1),
        optim=OptimSpec(c["optimizer"], lr=1e-3, weight_decay=0.1),
        train=TrainSpec(steps=c["steps"], microbatch_size=mbs, num_microbatches=m, seed=0, grad_clip=1.0,
                        precision=c["precision"]),
        backend="nccl" if c["device"] == "cuda" else "gloo",
    )


# ---- the engine: Worker + Generation + the fault-tolerance machinery, as ElasticWorker runs them ------

class FaultTolerance:
    """What ElasticWorker.run_generation does around a generation's steps to make them recoverable.

    THE HOOKUP (one place): since the engine completes an interrupted step instead of undoing it
    (engine/recovery.py), that is `reach_step(worker, resume_step)` before the generation's groups are
    built, and nothing is copied. (Before, it was StepUndo: `rollback_to` here and `attach` after
    adopt, a pre-update copy of every layer's parameters and optimizer state kept until the next step:
    the "before" figures of the report.) A change of the engine's fault-tolerance calls goes here, as
    in elastic_process.py."""

    def __init__(self, worker: Any, hooks: Any) -> None:
        self.worker, self.hooks = worker, hooks

    def before_generation(self, resume_step: int) -> None:
        """Before the generation's groups are built (ElasticWorker: `reach_step(w, resume_step)`)."""
        from oobleck_slurm.engine.recovery import reach_step

        reach_step(self.worker, resume_step)

    def after_adopt(self) -> None:
        """After the worker adopted the generation's plan: nothing to attach any more."""


def measure_engine(c: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from oobleck_slurm.engine.abort import build_generation
    from oobleck_slurm.engine.faults import FaultHooks
    from oobleck_slurm.engine.layout import ExecPlan
    from oobleck_slurm.engine.worker import Worker
    from oobleck_slurm.peak_memory import PeakMemory, warm_up
    from oobleck_slurm.timeouts import JobTimeouts

    job = job_spec(c)
    device = _device(c)
    plan = ExecPlan.from_json(c["plan"])
    timeouts = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeouts.td("store_timeout"))
    worker = Worker(job, 0, device)
    ft = FaultTolerance(worker, FaultHooks([], store, NODE, 0))
    ft.before_generation(0)
    gen = build_generation(store, 0, 0, 1, plan, timeouts, job.backend, None, device)
    warm_up(device)
    probe = PeakMemory(device)  # the baseline: process, dataset and groups, no layer yet
    worker.adopt(plan, gen, "seed")
    ft.after_adopt()
    peaks, after, seconds = [], [], []
    for _ in range(job.train.steps):
        probe.start()
        t0 = time.perf_counter()
        result = worker.train_step()
        seconds.append(time.perf_counter() - t0)
        peaks.append(probe.peak())
        after.append(probe.now())
    params = sum(p.numel() for layer in worker.layers.values() for p in layer.parameters())
    return {"params": params, "peaks": peaks, "after_step": after, "seconds": seconds, "loss": result.loss,
            "probe": probe.method, "baseline_bytes": probe.baseline}


# ---- the reference: plain PyTorch, one process ---------------------------------------------------------

def measure_plain(c: dict[str, Any]) -> dict[str, Any]:
    import contextlib

    from oobleck_slurm.engine.batches import StepBatches, open_dataset
    from oobleck_slurm.models.gpt.model import build_layers
    from oobleck_slurm.models.loss import lm_loss
    from oobleck_slurm.optim import build_optimizer
    from oobleck_slurm.peak_memory import PeakMemory, warm_up

    job = job_spec(c)
    device = _device(c)
    t = job.train
    batches = StepBatches(open_dataset(job.data, job.model.seq_len, job.model.vocab_size),
                          t.global_batch_size, t.microbatch_size, t.seed)
    warm_up(device)
    probe = PeakMemory(device)
    model = torch.nn.Sequential(*build_layers(job.model.config, t.seed)).to(device, t.param_dtype)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": job.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt: torch.optim.Optimizer
    if job.optim.name == "adamw":
        opt = torch.optim.AdamW(groups, lr=job.optim.lr, foreach=True)
    else:
        opt = build_optimizer(job.optim.name, groups, lr=job.optim.lr, weight_decay=job.optim.weight_decay)
    peaks, after, seconds = [], [], []
    loss_sum = 0.0
    for step in range(t.steps):
        probe.start()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_sum = 0.0
        for m in range(t.num_microbatches):
            x, y = (v.to(device) for v in batches.microbatch(step, m))
            cast = torch.autocast(device.type, dtype=torch.bfloat16) if t.precision == "bf16" else contextlib.nullcontext()
            with cast:
                loss = lm_loss(model(x), y) / t.num_microbatches
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        peaks.append(probe.peak())
        after.append(probe.now())
    return {"params": sum(p.numel() for p in params), "peaks": peaks, "after_step": after, "seconds": seconds,
            "loss": loss_sum, "probe": probe.method, "baseline_bytes": probe.baseline}


def _device(c: dict[str, Any]) -> torch.device:
    if c["device"] == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def measure_main(side: str, config_path: str, out_path: str) -> None:
    """A measuring process: one side of one configuration, written to `out_path`."""
    c = json.loads(Path(config_path).read_text())
    torch.set_num_threads(int(c["threads"]))
    result = measure_engine(c) if side == "engine" else measure_plain(c)
    Path(out_path).write_text(json.dumps(result))


def measure(side: str, c: dict[str, Any]) -> dict[str, Any]:
    """One fresh process measuring `side` of configuration `c`, with glibc returning freed memory to the
    OS (MALLOC_ENV) so that its RSS follows the live tensors."""
    from oobleck_slurm.peak_memory import MALLOC_ENV

    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.json", Path(tmp) / "out.json"
        cfg.write_text(json.dumps(c))
        env = dict(os.environ, OMP_NUM_THREADS=str(c["threads"]), **MALLOC_ENV)
        done = subprocess.run([sys.executable, __file__, "--measure", side, str(cfg), str(out)], env=env,
                              timeout=MEASURE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{side} measurement of {c['optimizer']} {c['precision']} exited {done.returncode}")
        return json.loads(out.read_text())


# ---- the planner's side ---------------------------------------------------------------------------------

def planned(c: dict[str, Any], device: str) -> tuple[dict[str, Any], float, dict[str, float]]:
    """The planner's one-node plan for configuration `c` on a measured profile: the engine's ExecPlan (as
    JSON), the stage's predicted bytes and the prediction's terms."""
    from oobleck_slurm.engine.from_planner import exec_plan
    from oobleck_slurm.models import GPTConfig
    from oobleck_slurm.planning import generate_templates, instantiate
    from oobleck_slurm.planning.cost import stage_memory_terms
    from oobleck_slurm.planning.measure import profile_model
    from oobleck_slurm.planning.profile import Link

    link = Link(1e-5, 1e9)  # no link matters to a plan of one device; not measured
    profile = profile_model(GPTConfig(**c["gpt"]), microbatch_size=c["microbatch_size"], dtype=c["precision"],
                            optimizer=c["optimizer"], devices_per_node=1, repeats=1,
                            links={name: link for name in ("intra_node", "inter_node", "allreduce_intra",
                                                           "allreduce_inter")})
    templates = generate_templates(profile, max_nodes=1, num_microbatches=c["microbatches"])
    if not templates:
        raise SystemExit(f"the planner finds no one-node plan for {c['gpt']} on this {device}")
    plan = instantiate(templates, [NODE], 0, c["microbatches"], microbatch_size=c["microbatch_size"], profile=profile)
    stage = plan.pipelines[0].template.stages[0]
    k = min(c["microbatches"], plan.pipelines[0].template.num_devices - stage.first_device)
    terms = stage_memory_terms(profile, stage.start, stage.stop, stage.devices, k)
    return exec_plan(plan, [NODE], 1).to_json(), stage.memory_bytes, terms


# ---- main -------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--preset", default="100m", help="GPT size (models/config.py), default ~100M parameters")
    ap.add_argument("--quick", action="store_true", help=f"a ~3M-parameter GPT {QUICK} (tests, smoke runs)")
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "came"], choices=["adamw", "came"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp64"])
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2, help="per step (one stage: one in flight)")
    ap.add_argument("--steps", type=int, default=2, help="steps per measurement; the last one is reported")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each measuring process")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine; run without --device cuda")
    if args.steps < 2:
        ap.error("--steps must be >= 2: the first step creates the gradients and the optimizer state")
    from oobleck_slurm.models import gpt_config

    gpt = asdict(gpt_config("tiny", **QUICK)) if args.quick else asdict(gpt_config(args.preset))
    console = Console(width=None if sys.stdout.isatty() else 200)
    rows = []
    for optimizer in args.optimizers:
        for precision in args.precisions:
            c = {"gpt": gpt, "optimizer": optimizer, "precision": precision, "microbatch_size": args.microbatch_size,
                 "microbatches": args.microbatches, "steps": args.steps, "threads": args.threads,
                 "device": args.device}
            console.print(f"{optimizer} {precision}: planning ...")
            c["plan"], predicted, terms = planned(c, args.device)
            console.print(f"{optimizer} {precision}: engine ...")
            engine = measure("engine", c)
            console.print(f"{optimizer} {precision}: plain ...")
            plain = measure("plain", c)
            n = engine["params"]
            e_peak, p_peak = engine["peaks"][-1], plain["peaks"][-1]
            rows.append({
                "optimizer": optimizer, "precision": precision, "params": n,
                "engine_bytes": e_peak, "plain_bytes": p_peak, "planner_bytes": predicted,
                "engine_bytes_per_param": e_peak / n, "plain_bytes_per_param": p_peak / n,
                "planner_bytes_per_param": predicted / n,
                "overhead": e_peak / p_peak - 1, "planner_over_engine": predicted / e_peak,
                "planner_terms": terms, "engine": engine, "plain": plain,
            })
    table = Table(title=f"bytes per parameter held at the step's peak ({args.device}; "
                        f"{'quick' if args.quick else args.preset}, {rows[0]['params'] / 1e6:.1f}M params, "
                        f"{args.microbatches} x {args.microbatch_size} samples, step {args.steps} of {args.steps})")
    for col in ("optimizer", "precision", "engine B/param", "plain B/param", "overhead", "planner B/param",
                "planner / engine", "engine step s", "plain step s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["optimizer"], r["precision"], f"{r['engine_bytes_per_param']:.2f}",
                      f"{r['plain_bytes_per_param']:.2f}", f"{r['overhead']:+.1%}",
                      f"{r['planner_bytes_per_param']:.2f}", f"{r['planner_over_engine']:.3f}",
                      f"{r['engine']['seconds'][-1]:.2f}", f"{r['plain']['seconds'][-1]:.2f}")
    console.print(table)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "device": args.device,
                    "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None},
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "config": {"gpt": gpt, "preset": None if args.quick else args.preset, "quick": args.quick,
                   "microbatch_size": args.microbatch_size, "microbatches": args.microbatches,
                   "steps": args.steps, "threads": args.threads},
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--measure":
        measure_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
