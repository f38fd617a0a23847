"""Engine throughput against plain DDP and torch.distributed.pipelining, predicted vs measured step
time, optimizer-state bytes per parameter, and the loss curve of the embedded default.

    python benchmarks/bench_engine.py [--workers 4] [--preset mini] [--steps 12] [--loss-steps 300]

1. One set of `--workers` processes (gloo, one thread each) runs, in turn and on the same model and
   global batch: the engine with one 1-stage pipeline per worker (data parallel), the engine with a
   heterogeneous plan, plain PyTorch DDP (same microbatches per rank, no_sync accumulation, AdamW,
   global-norm clip), the engine with one `--workers`-stage pipeline, and torch.distributed.
   pipelining's Schedule1F1B on the same partition. Medians of per-step wall time (rank 0, first two
   steps dropped); ratios engine / reference in samples/s.
2. The default recipe through `train_local`: the planner's predicted step time vs the measured
   median; with `--loss-steps` steps, the loss at the start and at the end.
3. Optimizer-state bytes per parameter, AdamW vs CAME, measured on the real per-layer optimizers
   after one step.
Writes benchmarks/results/bench_engine.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from oobleck_slurm.engine.batches import StepBatches, open_dataset
from oobleck_slurm.engine.comm import Generation, Timeouts, connect_store
from oobleck_slurm.engine.layer_optim import make_layer_optimizer
from oobleck_slurm.engine.layout import ExecPlan, make_plan
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models.config import gpt_config
from oobleck_slurm.models.gpt import build_layers, lm_loss
from oobleck_slurm.optim import optimizer_state_tensors

RESULTS = Path(__file__).parent / "results" / "bench_engine.json"
TIMEOUTS = Timeouts(collective=300.0, connect=300.0)
DROP = 2  # warm-up steps left out of the medians


def even_bounds(num_layers: int, stages: int) -> list[int]:
    return [round(i * num_layers / stages) for i in range(stages + 1)]


def median_s(times: list[float]) -> float:
    return statistics.median(times[DROP:] if len(times) > DROP + 1 else times)


# ---- worker side --------------------------------------------------------------------------------

def _ddp_steps(job: JobSpec, rank: int, world: int, steps: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = job.train
    model = torch.nn.Sequential(*build_layers(job.model.gpt, t.seed))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay,
                            foreach=False)
    batches = StepBatches(open_dataset(job.data, job.model.gpt.seq_len, job.model.gpt.vocab_size),
                          t.global_batch_size, t.microbatch_size, t.seed)
    per_rank = t.num_microbatches // world
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        for m in range(per_rank):
            x, y = batches.microbatch(step, rank * per_rank + m)
            sync = m == per_rank - 1  # all-reduce once, on the last microbatch
            with contextlib.nullcontext() if sync else ddp.no_sync():
                (lm_loss(ddp(x), y) / t.num_microbatches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _pipelining_steps(job: JobSpec, rank: int, world: int, steps: int, bounds: list[int]) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    t = job.train
    sub = torch.nn.Sequential(*build_layers(job.model.gpt, t.seed, bounds[rank], bounds[rank + 1]))
    stage = PipelineStage(sub, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=t.num_microbatches, loss_fn=lm_loss)
    opt = torch.optim.AdamW(sub.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay,
                            foreach=False)
    batches = StepBatches(open_dataset(job.data, job.model.gpt.seq_len, job.model.gpt.vocab_size),
                          t.global_batch_size, t.microbatch_size, t.seed)
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


def worker_main(rank: int, port: int, config_path: str) -> None:
    torch.set_num_threads(1)
    c = json.loads(Path(config_path).read_text())
    world, steps = c["world"], c["steps"]
    job = JobSpec.from_json(c["job"])
    store = connect_store("127.0.0.1", port, TIMEOUTS)
    out: dict[str, list[float]] = {}
    for g, (name, plan_json) in enumerate(c["engine_plans"]):
        plan = ExecPlan.from_json(plan_json)
        worker = Worker(job, rank)
        gen = Generation(store, g, rank, world, plan, TIMEOUTS)
        worker.rebuild(plan, gen)
        out[name] = [worker.train_step().seconds for _ in range(steps)]
        gen.wait(gen.world.barrier())
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp", store), rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=TIMEOUTS.collective))
    out["ddp"] = _ddp_steps(job, rank, world, steps)
    dist.barrier()
    out["pipelining_1f1b"] = _pipelining_steps(job, rank, world, steps, c["pp_bounds"])
    dist.barrier()
    if rank == 0:
        Path(c["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


# ---- driver side --------------------------------------------------------------------------------

def run_workers(job: JobSpec, world: int, steps: int, plans: dict[str, ExecPlan], pp_bounds: list[int]) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=TIMEOUTS.store))
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "out.json"
        cfg_path.write_text(json.dumps({
            "world": world, "steps": steps, "job": job.to_json(), "out": str(out_path),
            "engine_plans": [[k, p.to_json()] for k, p in plans.items()], "pp_bounds": pp_bounds,
        }))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(store.port), str(cfg_path)],
                                  env=env) for r in range(world)]
        try:
            for p in procs:
                if p.wait(timeout=1800) != 0:
                    raise RuntimeError(f"benchmark worker exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return json.loads(out_path.read_text())


def state_bytes_per_param(name: str) -> float:
    cfg = gpt_config("mini")
    layers = build_layers(cfg, 0)
    total_bytes = total_params = 0
    for layer in layers:
        opt = make_layer_optimizer(layer, OptimSpec(name, lr=1e-3))
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        total_bytes += sum(t.numel() * t.element_size() for t in optimizer_state_tensors(opt).values())
        total_params += sum(p.numel() for p in layer.parameters())
    return total_bytes / total_params


def predicted_vs_measured(steps: int, cache_dir: Path) -> dict:
    from oobleck_slurm.engine.local import local_plan, train_local
    from oobleck_slurm.recipe import load_recipe

    recipe = load_recipe()
    recipe = dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, steps=steps))
    plan = local_plan(recipe, cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        run = train_local(recipe, Path(tmp) / "job", plan=plan, cache_dir=cache_dir)
    losses = [s["loss"] for s in run.steps]
    measured = median_s([s["seconds"] for s in run.steps])
    return {
        "recipe": "embedded default", "nodes": recipe.cluster.nodes, "steps": steps,
        "pipelines": [len(p.nodes) for p in plan.pipelines],
        "predicted_step_s": plan.step_time_s, "measured_step_s": measured,
        "measured_over_predicted": measured / plan.step_time_s,
        "samples_per_s_median": statistics.median(s["samples_per_s"] for s in run.steps),
        "loss_first": losses[0], "loss_last10_mean": statistics.fmean(losses[-10:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--loss-steps", type=int, default=300)
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "oobleck_bench_templates"))
    args = ap.parse_args()
    console = Console()
    w, cfg = args.workers, gpt_config(args.preset)
    num_layers = cfg.n_layer + 2
    job = JobSpec(ModelSpec(cfg), DataSpec("random", num_samples=4096, seed=1), OptimSpec("adamw", lr=1e-3),
                  TrainSpec(steps=args.steps, microbatch_size=args.microbatch_size,
                            num_microbatches=args.microbatches, seed=0))
    m = args.microbatches
    if m % w:
        raise SystemExit(f"--microbatches {m} must be a multiple of --workers {w} (DDP splits them evenly)")
    pp_bounds = even_bounds(num_layers, w)
    hetero_shapes = [[0, num_layers]] * (w - 2) + [even_bounds(num_layers, 2)]
    hetero_mbs = [m // w] * (w - 2) + [m - (m // w) * (w - 2)]
    plans = {
        "engine_dp": make_plan(num_layers, [[0, num_layers]] * w, [m // w] * w),
        "engine_hetero": make_plan(num_layers, hetero_shapes, hetero_mbs),
        "engine_pp": make_plan(num_layers, [pp_bounds], [m]),
    }
    console.print(f"[bold]engine vs DDP vs pipelining[/]: {w} workers, {args.preset}, {m} x {args.microbatch_size} samples/step")
    times = run_workers(job, w, args.steps, plans, pp_bounds)
    samples = m * args.microbatch_size
    rows = {k: {"median_step_s": median_s(v), "samples_per_s": samples / median_s(v)} for k, v in times.items()}
    ratios = {
        "engine_dp_over_ddp": rows["engine_dp"]["samples_per_s"] / rows["ddp"]["samples_per_s"],
        "engine_pp_over_pipelining_1f1b": rows["engine_pp"]["samples_per_s"] / rows["pipelining_1f1b"]["samples_per_s"],
    }
    table = Table(title="samples/s (median of steps, rank 0)")
    for col in ("run", "partition", "median step s", "samples/s"):
        table.add_column(col)
    parts = {"engine_dp": f"{w} x 1 stage", "ddp": f"{w} x 1 stage", "engine_hetero": "+".join(str(len(s) - 1) for s in hetero_shapes) + " stages",
             "engine_pp": f"1 x {w} stages {pp_bounds}", "pipelining_1f1b": f"1 x {w} stages {pp_bounds}"}
    for k in ("engine_dp", "ddp", "engine_hetero", "engine_pp", "pipelining_1f1b"):
        table.add_row(k, parts[k], f"{rows[k]['median_step_s']:.4f}", f"{rows[k]['samples_per_s']:.1f}")
    console.print(table)
    for k, v in ratios.items():
        console.print(f"{k}: [bold]{v:.3f}[/]")

    console.print("[bold]optimizer state bytes per parameter[/] (mini, fp32, after one step)")
    state = {name: state_bytes_per_param(name) for name in ("adamw", "came")}
    console.print(f"adamw {state['adamw']:.3f}  came {state['came']:.3f}  ratio {state['came'] / state['adamw']:.3f}")

    console.print(f"[bold]embedded default via train_local[/], {args.loss_steps} steps")
    pvm = predicted_vs_measured(args.loss_steps, Path(args.cache_dir))
    t2 = Table(title="predicted vs measured (default recipe)")
    for col in ("pipelines (nodes)", "predicted step s", "measured step s", "measured/predicted", "loss first", "loss last-10 mean"):
        t2.add_column(col)
    t2.add_row(str(pvm["pipelines"]), f"{pvm['predicted_step_s']:.4f}", f"{pvm['measured_step_s']:.4f}",
               f"{pvm['measured_over_predicted']:.2f}", f"{pvm['loss_first']:.3f}", f"{pvm['loss_last10_mean']:.3f}")
    console.print(t2)

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "config": {"workers": w, "preset": args.preset, "steps": args.steps, "microbatches": m,
                   "microbatch_size": args.microbatch_size, "pp_bounds": pp_bounds},
        "throughput": rows, "ratios": ratios, "step_times_s": times,
        "optimizer_state_bytes_per_param": state, "default_recipe": pvm,
    }, indent=2))
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
