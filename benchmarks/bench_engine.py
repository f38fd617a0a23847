"""Engine throughput against plain PyTorch DDP and torch.distributed.pipelining, predicted vs measured
step time and the loss of the embedded default, optimizer-state bytes per parameter.

    python benchmarks/bench_engine.py [--workers 4] [--preset mini] [--steps 12] [--loss-steps 300]
                                      [--device cpu|cuda]

Every figure of OUR engine comes from a job started the way `submit` starts one
(oobleck_slurm.submission: prepare_job + start_local: supervisor, agents, one worker process per
device) and read from its events.jsonl (rank 0's `step` events). The references are plain PyTorch
run by a small harness in this file (they are the baseline, not our runtime), on the same model,
the same token file, the same global batch and microbatches, and the same number of worker
processes (gloo, one thread each on CPU):
1. engine_dp: `--workers` nodes x 1 worker; the planner's 1-stage pipelines (data parallel), against
   DDP on `--workers` processes (same microbatches per rank, no_sync accumulation, AdamW, global-norm
   clip).
2. engine_span: 2 nodes x 2 workers with a `cluster.memory_per_device` found so that the pipeline
   spans both nodes (4 stages), against DDP on 4 processes and torch.distributed.pipelining's
   Schedule1F1B on the same 4-stage partition.
   Medians of per-step seconds, the first `--drop` steps left out; ratios engine / reference in
   samples/s (> 1: the engine is faster).
3. The embedded default recipe (measured profile): the planner's predicted step time vs the measured
   median; with `--loss-steps` steps, the loss at the start and at the end.
4. Optimizer-state bytes per parameter, AdamW vs CAME, on the real per-layer optimizers after one step.
5. engine_wide (issue 23): 2 nodes x 4 workers, `cluster.max_stage_devices: 4`, planned with the
   measured profile of this machine (the planner's own choice of stage widths), against DDP on the
   same 8 worker processes, run one after the other in this run (`--rounds N`: N times, the median of
   the rounds' ratios); `--only wide` runs just this.
Writes benchmarks/results/bench_engine.json.

`--device cuda` (NOT RUN ON A GPU YET: written and checked on a CPU-only machine, where it stops with
a clear error): the same jobs with `cluster.gpus_per_node` (one worker per GPU, nccl, bf16 by
default): engine_dp on 1 node x `--gpus` GPUs against DDP on `--gpus` GPUs and a plain single-GPU
loop of the same model and global batch (gradient accumulation over the same microbatches), with
samples/s and MFU = 6 * params * tokens/s / (GPUs * peak bf16 FLOP/s, oobleck_slurm/planning/gpus.py;
`--gpu NAME` when the device name does not say which). engine_span and pipelining are CPU-only here:
virtual nodes on one machine would pin the same GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _jobs import (
    budget_for_span,
    default_recipe_dict,
    drop_warmup,
    load,
    median,
    plan_summary,
    planned,
    recipe_dict,
    run_job,
)
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "bench_engine.json"
BASELINE_TIMEOUT_S = 1800


# ---- the references: plain PyTorch, one process per rank --------------------------------------------

def _batches(job: Any) -> Any:
    from oobleck_slurm.engine.batches import StepBatches, open_dataset

    t = job.train
    return StepBatches(open_dataset(job.data, job.model.seq_len, job.model.vocab_size),
                       t.global_batch_size, t.microbatch_size, t.seed)


def _autocast(device: torch.device, precision: str) -> Any:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _accumulation_steps(job: Any, model: torch.nn.Module, forward: Any, device: torch.device, steps: int,
                        microbatches: range, no_sync: Any = None, samples: slice = slice(None)) -> list[float]:
    """Time `steps` optimizer steps of `model`, each accumulating the gradients of `microbatches` of the
    step through `forward` (the model, or its DDP wrapper: then all but the last run under `no_sync()`,
    one all-reduce per step); `samples`: the part of each microbatch this rank computes."""
    from oobleck_slurm.models.loss import lm_loss

    t = job.train
    # the implementation the engine uses (optim/build.py): torch's fused kernel
    opt = torch.optim.AdamW(model.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay,
                            fused=True)
    batches = _batches(job)
    times = []
    for step in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        for m in microbatches:
            x, y = (v[samples].to(device) for v in batches.microbatch(step, m))
            sync = no_sync is None or m == microbatches[-1]
            with contextlib.nullcontext() if sync else no_sync(), _autocast(device, t.precision):
                loss = lm_loss(forward(x), y) / t.num_microbatches
            loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _ddp_steps(job: Any, rank: int, world: int, steps: int, device: torch.device) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oobleck_slurm.models.gpt.model import build_layers

    model = torch.nn.Sequential(*build_layers(job.model.config, job.train.seed)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    m = job.train.num_microbatches
    if m % world == 0:  # whole microbatches per rank, accumulated
        per_rank = m // world
        return _accumulation_steps(job, model, ddp, device, steps, range(rank * per_rank, (rank + 1) * per_rank),
                                   ddp.no_sync)
    # more ranks than microbatches: each rank computes its slice of one microbatch in one pass, as a wide
    # stage's rank does (the global batch split evenly over the ranks)
    q, b = world // m, job.train.microbatch_size
    k = rank % q
    return _accumulation_steps(job, model, ddp, device, steps, range(rank // q, rank // q + 1), ddp.no_sync,
                               slice(k * b // q, (k + 1) * b // q))


def _pipelining_steps(job: Any, rank: int, world: int, steps: int, bounds: list[int]) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from oobleck_slurm.models.gpt.model import build_layers
    from oobleck_slurm.models.loss import lm_loss

    t = job.train
    sub = torch.nn.Sequential(*build_layers(job.model.config, t.seed, bounds[rank], bounds[rank + 1]))
    stage = PipelineStage(sub, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=t.num_microbatches, loss_fn=lm_loss)
    opt = torch.optim.AdamW(sub.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay, fused=True)
    batches = _batches(job)
    times = []
    for step in range(steps):
        xs, ys = zip(*(batches.microbatch(step, m) for m in range(t.num_microbatches)))
        x, y = torch.cat(xs), torch.cat(ys)
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _single_gpu_steps(job: Any, steps: int) -> list[float]:
    """One GPU, no distribution: the same model, global batch and microbatches (accumulation)."""
    from oobleck_slurm.models.gpt.model import build_layers

    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(*build_layers(job.model.config, job.train.seed)).to(device)
    return _accumulation_steps(job, model, model, device, steps, range(job.train.num_microbatches))


def baseline_worker(kind: str, rank: int, world: int, port: int, config_path: str) -> None:
    import torch.distributed as dist

    from oobleck_slurm.engine.spec import JobSpec

    c = json.loads(Path(config_path).read_text())
    job = JobSpec.from_json(c["job"])
    cuda = c["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if kind == "single":
        times = _single_gpu_steps(job, c["steps"])
    else:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=300))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=300))
        if kind == "ddp":
            times = _ddp_steps(job, rank, world, c["steps"], device)
        else:
            times = _pipelining_steps(job, rank, world, c["steps"], c["bounds"])
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(c["out"]).write_text(json.dumps(times))


def run_baseline(kind: str, job: Any, world: int, steps: int, device: str, bounds: list[int] | None = None) -> list[float]:
    """`world` processes of the plain-PyTorch reference `kind` (ddp, pipelining, single); rank 0's step times."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=300))
    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = Path(tmp) / "config.json", Path(tmp) / "out.json"
        cfg.write_text(json.dumps({"job": job.to_json(), "steps": steps, "bounds": bounds, "out": str(out),
                                   "device": device}))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--baseline-worker", kind, str(r), str(world),
                                   str(store.port), str(cfg)], env=env) for r in range(world)]
        try:
            for p in procs:
                if p.wait(timeout=BASELINE_TIMEOUT_S) != 0:
                    raise SystemExit(f"{kind} reference: a worker exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return json.loads(out.read_text())


# ---- our engine: jobs through the production start path ----------------------------------------------

def engine_job(name: str, d: dict[str, Any], root: Path, cache: Path, estimate: str | None, drop: int,
               timeout: float) -> dict[str, Any]:
    from oobleck_slurm.engine.from_recipe import job_from_recipe, token_file_for

    run = run_job(d, root, cache, estimate=estimate, timeout=timeout)
    steps = run.kind("step")
    plans = run.kind("plan")
    if len(plans) != 1:
        raise SystemExit(f"{name}: expected one plan (no failure), got {len(plans)}: {run.job.path}")
    times = [e["seconds"] for e in steps]
    kept = drop_warmup(times, drop)
    recipe = load(d, root / "recipes")
    spec = job_from_recipe(recipe, token_file_for(recipe, root / "data"))
    return {
        "name": name, "recipe": d, "plan": plans[0], "partition": plan_summary(plans[0]),
        "ranks": plans[0]["ranks"], "step_times_s": times, "median_step_s": median(kept),
        "samples_per_s": recipe.training.global_batch_size / median(kept),
        "losses": [e["loss"] for e in steps], "job_wall_s": run.wall_s, "spec": spec, "job": str(run.job.path),
    }


def reference(name: str, times: list[float], global_batch: int, drop: int, partition: str, ranks: int) -> dict[str, Any]:
    kept = drop_warmup(times, drop)
    return {"name": name, "partition": partition, "ranks": ranks, "step_times_s": times,
            "median_step_s": median(kept), "samples_per_s": global_batch / median(kept)}


def stage_bounds(plan_event: dict[str, Any]) -> list[int]:
    stages = plan_event["pipelines"][0]["stages"]
    return [stages[0]["layers"][0]] + [s["layers"][1] for s in stages]


def state_bytes_per_param(name: str) -> float:
    from oobleck_slurm.engine.layer_optim import make_layer_optimizer
    from oobleck_slurm.engine.spec import OptimSpec
    from oobleck_slurm.models import gpt_config
    from oobleck_slurm.models.gpt.model import build_layers
    from oobleck_slurm.optim import optimizer_state_tensors

    total_bytes = total_params = 0
    for layer in build_layers(gpt_config("mini"), 0):
        opt = make_layer_optimizer(layer, OptimSpec(name, lr=1e-3))
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        total_bytes += sum(t.numel() * t.element_size() for t in optimizer_state_tensors(opt).values())
        total_params += sum(p.numel() for p in layer.parameters())
    return total_bytes / total_params


def wide_vs_ddp(common: dict[str, Any], root: Path, cache: Path, drop: int, timeout: float, steps: int,
                gbs: int, console: Console, rounds: int = 1) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """engine_wide (2 nodes x 4 workers, stages up to a node wide, the measured profile: what the
    planner picks for this machine) and DDP on the same 8 processes, one after the other, `rounds`
    times: the ratio is the median of the rounds' ratios (each round's two runs are close in time, so
    the machine's drift between rounds cancels)."""
    d = recipe_dict(nodes=2, workers=4, name="eng-wide", **common)
    d["cluster"]["max_stage_devices"] = 4
    rows: list[dict[str, Any]] = []
    per_round: list[float] = []
    for k in range(rounds):
        tag = f" (round {k + 1} of {rounds})" if rounds > 1 else ""
        console.print(f"  engine_wide: 2 nodes x 4 workers, max_stage_devices 4, measured profile{tag} ...")
        wide = engine_job("engine_wide", d, root, cache, None, drop, timeout)
        spec = wide.pop("spec")
        console.print(f"    plan: {wide['partition']}")
        console.print(f"  ddp_8: 8 processes{tag} ...")
        ddp8 = reference("ddp_8", run_baseline("ddp", spec, 8, steps, "cpu"), gbs, drop, "8 x 1 stage", 8)
        per_round.append(wide["samples_per_s"] / ddp8["samples_per_s"])
        if rounds > 1:
            console.print(f"    round {k + 1}: engine_wide / ddp_8 = {per_round[-1]:.3f}")
            wide["name"], ddp8["name"] = f"engine_wide #{k + 1}", f"ddp_8 #{k + 1}"
        rows += [wide, ddp8]
    ratios: dict[str, Any] = {"engine_wide_over_ddp_8": median(per_round)}
    if rounds > 1:
        ratios["engine_wide_over_ddp_8_rounds"] = per_round
    return rows, ratios


def predicted_vs_measured(steps: int, root: Path, cache: Path, drop: int, timeout: float) -> dict[str, Any]:
    """The embedded default recipe with `steps` steps, planned with the measured profile (as `submit`)."""
    d = default_recipe_dict(steps=steps)
    warmup = d["training"].get("lr_schedule", {}).get("warmup_steps", 0)
    if warmup >= steps:  # a short smoke run: the recipe refuses more warm-up steps than steps
        d["training"]["lr_schedule"] = {**d["training"]["lr_schedule"], "warmup_steps": max(0, steps // 4)}
    run = run_job(d, root, cache, estimate=None, timeout=timeout)
    plan = planned(load(d, root / "recipes"), cache, None)  # the cache now holds the measured profile
    steps_ev = run.kind("step")
    losses = [e["loss"] for e in steps_ev]
    measured = median(drop_warmup([e["seconds"] for e in steps_ev], drop))
    return {
        "recipe": "embedded default", "nodes": d["cluster"]["nodes"], "steps": steps,
        "pipelines": [len(p.nodes) for p in plan.pipelines], "partition": plan_summary(run.kind("plan")[0]),
        "predicted_step_s": plan.step_time_s, "measured_step_s": measured,
        "measured_over_predicted": measured / plan.step_time_s,
        "samples_per_s_median": median([e["samples_per_s"] for e in steps_ev]),
        "loss_first": losses[0], "loss_last10_mean": sum(losses[-10:]) / len(losses[-10:]),
        "job_wall_s": run.wall_s,
    }


def peak_flops(gpu: str | None) -> tuple[str, float]:
    from oobleck_slurm.planning.gpus import GPUS, gpu_spec

    if gpu is not None:
        spec = gpu_spec(gpu)
        return spec.name, spec.bf16_tflops * 1e12
    name = torch.cuda.get_device_name(0).upper().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):  # H200 before H100, A100-80 before A100-40
        base, _, mem = key.upper().partition("-")
        if base in name and (not mem or f"{mem}GB" in name):
            return key, GPUS[key].bf16_tflops * 1e12
    for key in GPUS:
        if key.upper().partition("-")[0] in name:
            return key, GPUS[key].bf16_tflops * 1e12
    raise SystemExit(f"no peak FLOP/s known for {torch.cuda.get_device_name(0)!r}: pass --gpu (one of {', '.join(GPUS)})")


# ---- main -----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--workers", type=int, default=4, help="engine_dp nodes = DDP processes (CPU)")
    ap.add_argument("--preset", default="mini", help="GPT size (tiny, mini, 100m, ...)")
    ap.add_argument("--steps", type=int, default=12, help="steps per throughput run")
    ap.add_argument("--drop", type=int, default=2, help="warm-up steps left out of the medians")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (global batch / microbatch size)")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--loss-steps", type=int, default=300, help="steps of the embedded default (0: skip)")
    ap.add_argument("--estimate", default="A100-40",
                    help="plan the throughput jobs with this GPU's estimated profile (the default recipe "
                         "always uses the measured one); 'none' for the measured profile")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gpus", type=int, default=None, help="--device cuda: GPUs (default: all visible)")
    ap.add_argument("--gpu", default=None, help="--device cuda: GPU name for the peak FLOP/s (default: detected)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job before it is killed")
    ap.add_argument("--keep-jobs", action="store_true")
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--only", choices=["all", "wide"], default="all",
                    help="wide: only engine_wide against DDP on 8 processes (CPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="engine_wide and DDP one after the other this many times; the ratio is the rounds' median")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is "
                         f"False; torch {torch.__version__}, CUDA build {torch.version.cuda}); run without "
                         "--device cuda for the CPU benchmark")
    precision = args.precision or ("bf16" if cuda else "fp32")
    if not cuda and precision == "bf16":
        ap.error("--precision bf16 needs --device cuda (bf16 autocast is a GPU setting)")
    estimate = None if args.estimate.lower() == "none" else args.estimate
    m, mbs = args.microbatches, args.microbatch_size
    gbs = m * mbs
    console = Console(width=None if sys.stdout.isatty() else 200)
    root = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    cache = root / "templates_cache"
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "torch": torch.__version__, "device": args.device}}
    common = {"size": args.preset, "steps": args.steps, "global_batch": gbs, "microbatch": mbs,
              "precision": precision, "f": 0, "warmup_steps": 1}
    try:
        rows: list[dict[str, Any]] = []
        ratios: dict[str, float] = {}
        if cuda:
            gpus = args.gpus or torch.cuda.device_count()
            if m % gpus:
                ap.error(f"--microbatches {m} must be a multiple of --gpus {gpus} (DDP splits them evenly)")
            console.print(f"[bold]engine vs DDP vs one GPU[/]: {gpus} GPU(s), {args.preset}, {m} x {mbs} samples/step, {precision}")
            dp = engine_job("engine_dp", recipe_dict(nodes=1, gpus_per_node=gpus, name="eng-dp", **common),
                            root, cache, estimate, args.drop, args.timeout)
            spec = dp.pop("spec")
            ddp = reference("ddp", run_baseline("ddp", spec, gpus, args.steps, "cuda"), gbs, args.drop,
                            f"{gpus} x 1 stage", gpus)
            single = reference("single_gpu", run_baseline("single", spec, 1, args.steps, "cuda"), gbs, args.drop,
                               "1 GPU, accumulation", 1)
            rows = [dp, ddp, single]
            gpu_name, peak = peak_flops(args.gpu)
            params = sum(p.numel() for p in torch.nn.Sequential(*__import__(
                "oobleck_slurm.models.gpt.model", fromlist=["build_layers"]).build_layers(spec.model.config, 0)).parameters())
            seq = spec.model.seq_len
            for r in rows:
                r["tokens_per_s"] = r["samples_per_s"] * seq
                r["mfu"] = 6 * params * r["tokens_per_s"] / (peak * r["ranks"])
            ratios = {"engine_dp_over_ddp": dp["samples_per_s"] / ddp["samples_per_s"],
                      "engine_dp_over_single_gpu": dp["samples_per_s"] / single["samples_per_s"]}
            out["mfu"] = {"gpu": gpu_name, "peak_flops_per_gpu": peak, "parameters": params, "seq_len": seq}
        elif args.only == "wide":
            if (m % 8 and 8 % m) or mbs % 4 or (m < 8 and mbs % (8 // m)):
                ap.error(f"--only wide: --microbatches {m} must be a multiple or a divisor of 8 (DDP on 8 "
                         f"processes takes whole microbatches or equal slices of them) and --microbatch-size "
                         f"{mbs} a multiple of 4 (a 4-wide stage splits each microbatch)")
            console.print(f"[bold]sharded stages vs DDP[/]: {args.preset}, {m} x {mbs} samples/step, {precision}")
            rows, ratios = wide_vs_ddp(common, root, cache, args.drop, args.timeout, args.steps, gbs, console,
                                       args.rounds)
        else:
            w = args.workers
            if m % w or m % 4:
                ap.error(f"--microbatches {m} must be a multiple of --workers {w} and of 4 (DDP splits them evenly)")
            console.print(f"[bold]engine vs DDP vs pipelining[/]: {args.preset}, {m} x {mbs} samples/step, {precision}")
            console.print(f"  engine_dp: {w} nodes x 1 worker ...")
            dp = engine_job("engine_dp", recipe_dict(nodes=w, workers=1, name="eng-dp", **common),
                            root, cache, estimate, args.drop, args.timeout)
            span_d = recipe_dict(nodes=2, workers=2, name="eng-span", **common)
            span_d["cluster"]["memory_per_device"] = budget_for_span(span_d, 2, cache, estimate, root / "recipes")
            console.print(f"  engine_span: 2 nodes x 2 workers, memory_per_device {span_d['cluster']['memory_per_device']} ...")
            span = engine_job("engine_span", span_d, root, cache, estimate, args.drop, args.timeout)
            spec = dp.pop("spec")
            span.pop("spec")
            ddp_runs = {}
            for world in sorted({w, 4}):
                console.print(f"  ddp: {world} processes ...")
                ddp_runs[world] = reference(f"ddp_{world}", run_baseline("ddp", spec, world, args.steps, "cpu"),
                                            gbs, args.drop, f"{world} x 1 stage", world)
            bounds = stage_bounds(span["plan"])
            console.print(f"  pipelining_1f1b: {len(bounds) - 1} stages {bounds} ...")
            pp = reference("pipelining_1f1b", run_baseline("pipelining", spec, len(bounds) - 1, args.steps, "cpu", bounds),
                           gbs, args.drop, f"1 x {len(bounds) - 1} stages {bounds}", len(bounds) - 1)
            rows = [dp, ddp_runs[w], span] + ([ddp_runs[4]] if w != 4 else []) + [pp]
            ratios = {f"engine_dp_over_ddp_{w}": dp["samples_per_s"] / ddp_runs[w]["samples_per_s"],
                      "engine_span_over_ddp_4": span["samples_per_s"] / ddp_runs[4]["samples_per_s"],
                      "engine_span_over_pipelining_1f1b": span["samples_per_s"] / pp["samples_per_s"]}
            if m % 8 == 0 and mbs % 4 == 0:
                wide_rows, wide_ratios = wide_vs_ddp(common, root, cache, args.drop, args.timeout, args.steps, gbs,
                                                     console, args.rounds)
                rows += wide_rows
                ratios.update(wide_ratios)
        table = Table(title=f"samples/s (median of rank 0's steps, first {args.drop} dropped)")
        for col in ("run", "ranks", "partition", "median step s", "samples/s") + (("MFU",) if cuda else ()):
            table.add_column(col)
        for r in rows:
            table.add_row(r["name"], str(r["ranks"]), r["partition"], f"{r['median_step_s']:.4f}",
                          f"{r['samples_per_s']:.2f}", *((f"{r['mfu']:.3f}",) if cuda else ()))
        console.print(table)
        t_ratio = Table(title="ratios (samples/s, engine / reference)")
        t_ratio.add_column("ratio")
        t_ratio.add_column("value")
        for k, v in ratios.items():
            t_ratio.add_row(k, ", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"{v:.3f}")
        console.print(t_ratio)
        out.update(config={"workers": args.workers, "preset": args.preset, "steps": args.steps, "drop": args.drop,
                           "microbatches": m, "microbatch_size": mbs, "precision": precision, "estimate": estimate},
                   throughput={r["name"]: {k: v for k, v in r.items() if k not in ("recipe",)} for r in rows},
                   ratios=ratios)

        if args.only == "all":
            state = {name: state_bytes_per_param(name) for name in ("adamw", "came")}
            t_state = Table(title="optimizer state bytes per parameter (mini, fp32, after one step)")
            for col in ("adamw", "came", "came / adamw"):
                t_state.add_column(col)
            t_state.add_row(f"{state['adamw']:.3f}", f"{state['came']:.3f}", f"{state['came'] / state['adamw']:.3f}")
            console.print(t_state)
            out["optimizer_state_bytes_per_param"] = state

        if args.loss_steps > 0 and not cuda and args.only == "all":
            console.print(f"[bold]embedded default[/] (measured profile), {args.loss_steps} steps ...")
            pvm = predicted_vs_measured(args.loss_steps, root, cache, args.drop, args.timeout)
            t2 = Table(title="predicted vs measured (default recipe)")
            for col in ("partition", "predicted step s", "measured step s", "measured/predicted", "samples/s",
                        "loss first", "loss last-10 mean"):
                t2.add_column(col)
            t2.add_row(pvm["partition"], f"{pvm['predicted_step_s']:.4f}", f"{pvm['measured_step_s']:.4f}",
                       f"{pvm['measured_over_predicted']:.2f}", f"{pvm['samples_per_s_median']:.1f}",
                       f"{pvm['loss_first']:.3f}", f"{pvm['loss_last10_mean']:.3f}")
            console.print(t2)
            out["default_recipe"] = pvm
    finally:
        if not args.keep_jobs:
            shutil.rmtree(root, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--baseline-worker":
        baseline_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
