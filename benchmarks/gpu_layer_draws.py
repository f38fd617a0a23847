"""Device checks of random layers and host waits (engine/layer_rng.py, abort.poll_work), one GPU:

1. seeded draws on the GPU's generator: the same dropout mask whatever ran before, another per layer,
   the generator's state restored, a draw detected (LayerDraws.check), a recomputed forward (checkpoint)
   giving the same gradient;
2. a factory model with dropout (tests/factory_model.py) through the Worker on a one-rank NCCL
   generation: step 0's loss equals the masks drawn by hand, training with and without recomputation
   gives the same losses, evaluation runs in eval mode (pinned copies) and leaves the layers training;
3. the latency of a polled wait on a small one-rank NCCL all-reduce: the back-off against the former
   fixed 0.5 ms pause.

    python benchmarks/gpu_layer_draws.py        # on a GPU machine: about a minute; $OUT/gpu_layer_draws.json
    python benchmarks/gpu_layer_draws.py cpu    # the same on the CPU (gloo), as a dry run

Written on a CPU-only machine, where its dry run passes; not run on a GPU yet."""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # factory_model
from oobleck_slurm.agent.main import NCCL_WORKER_ENV  # noqa: E402

os.environ.update(NCCL_WORKER_ENV)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from oobleck_slurm.engine.abort import FailureWatch, build_generation, poll_work  # noqa: E402
from oobleck_slurm.engine.comm import make_group  # noqa: E402
from oobleck_slurm.engine.layer_rng import LayerDrawError, LayerDraws  # noqa: E402
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec  # noqa: E402
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec  # noqa: E402
from oobleck_slurm.engine.worker import Worker  # noqa: E402
from oobleck_slurm.models import FactoryModel, inspect_factory  # noqa: E402
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS, JobTimeouts  # noqa: E402

CPU = len(sys.argv) > 1 and sys.argv[1] == "cpu"
DEV = torch.device("cpu") if CPU else torch.device("cuda", 0)
BACKEND = "gloo" if CPU else "nccl"
OUT = Path(os.environ.get("OUT", "/tmp"))
res: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
             "device": "cpu" if CPU else torch.cuda.get_device_name(DEV)}
if not CPU:
    torch.cuda.set_device(DEV)
    res["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))


def report(key: str, value: object) -> None:
    res[key] = value
    print(key, value, flush=True)


# ---- 1. seeded draws on the device ---------------------------------------------------------------
d = LayerDraws(0, 5, DEV)
x = torch.ones(512, 512, device=DEV, dtype=torch.float64)
drop = torch.nn.functional.dropout
with d.seeded(3, 7):
    a = drop(x, 0.5)
torch.rand(1000, device=DEV)  # the generators move between
if not CPU:
    torch.cuda.manual_seed(123)
torch.manual_seed(321)
with d.seeded(3, 7):
    b = drop(x, 0.5)
with d.seeded(3, 8):
    c = drop(x, 0.5)
report("draws_same_whatever_history", torch.equal(a, b))
report("draws_differ_per_layer", not torch.equal(a, c))
state = torch.cuda.get_rng_state(DEV) if not CPU else torch.get_rng_state()
with d.seeded(0, 0):
    drop(x, 0.5)
after = torch.cuda.get_rng_state(DEV) if not CPU else torch.get_rng_state()
report("generator_restored", torch.equal(state, after))
try:
    with d.seeded(1, 1, check="L"):
        drop(x, 0.5)
    report("draw_detected", False)
except LayerDrawError:
    report("draw_detected", True)
with d.seeded(1, 1, check="L"):
    x * 2
report("no_draw_not_detected", True)
# a recomputed forward (checkpoint) draws the seeded mask again: equal gradients
layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.3), torch.nn.Linear(64, 64)).to(DEV, torch.float64)
inp = torch.randn(8, 64, device=DEV, dtype=torch.float64, generator=None)
grads = []
for recompute in (False, True):
    layer.zero_grad()
    with d.seeded(2, 4):
        out = (torch.utils.checkpoint.checkpoint(layer, inp, use_reentrant=False) if recompute else layer(inp))
    out.pow(2).sum().backward()
    grads.append(torch.cat([p.grad.reshape(-1) for p in layer.parameters()]))
report("recompute_same_gradient", torch.equal(grads[0], grads[1]))
n = 2000
if not CPU:
    torch.cuda.synchronize()
t = time.perf_counter()
for i in range(n):
    with d.seeded(i % 8, i % 6):
        pass
report("seeded_context_us", (time.perf_counter() - t) / n * 1e6)

# ---- 2. a factory model with dropout through the Worker ------------------------------------------
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)
KWARGS = {"depth": 3, "width": 64, "vocab": 256, "seq": 32, "hidden": 128, "dropout": 0.3}
model = inspect_factory(FactoryModel("factory_model:make_layers", seq_len=32, vocab_size=256, kwargs=KWARGS))
PLAN = ExecPlan(5, 4, (PipelineSpec((0,), (0, 5), 0, 4),))


def job(recompute: bool) -> JobSpec:
    return JobSpec(ModelSpec(model), DataSpec("random", num_samples=256, seed=1, holdout=6),
                   OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
                   TrainSpec(steps=3, microbatch_size=2, num_microbatches=4, seed=0, grad_clip=0.5, warmup_steps=1,
                             precision="fp64", recompute=recompute, eval_interval=3, eval_samples=6),
                   backend=BACKEND)


trajectories = []
for g, recompute in enumerate((False, True)):
    w = Worker(job(recompute), 0, DEV)
    gen = build_generation(store, g, 0, 1, PLAN, TIMEOUTS, BACKEND, None, DEV)
    w.adopt(PLAN, gen, "seed")
    gen.align()
    if g == 0:  # step 0's loss by hand: the same layers, each microbatch's draws seeded as the engine seeds them
        layers = [w.layers[i] for i in range(5)]
        draws = LayerDraws(0, 0, DEV)
        total = 0.0
        with torch.no_grad():
            for m in range(4):
                h, y = (t.to(DEV) for t in w.batches.microbatch(0, m))
                for i, lay in enumerate(layers):
                    with draws.seeded(m, i):
                        h = lay(h)
                total += float(w.job.model.config.loss(h, y)) / 4
        by_hand = total
    losses = [w.train_step().loss for _ in range(3)]
    trajectories.append(losses)
    if g == 0:
        report("step0_loss_engine_vs_by_hand", [losses[0], by_hand])
        ev, _ = w.evaluate()
        layers = [w.layers[i] for i in range(5)]
        for lay in layers:
            lay.eval()
        with torch.no_grad():
            h, y = (t.to(DEV) for t in w.validation.batch(list(range(6))))
            for lay in layers:
                h = lay(h)
            manual = float(w.job.model.config.loss(h, y))
        for lay in layers:
            lay.train()
        report("eval_engine_vs_eval_mode_by_hand", [ev, manual])
        report("layers_back_in_train_mode", all(lay.training for lay in layers))
    w.stop_reads()
    gen.release()
report("losses_plain", trajectories[0])
report("losses_recompute", trajectories[1])
report("recompute_same_trajectory", max(abs(a - b) / abs(a) for a, b in zip(*trajectories)))

# ---- 3. the latency of a polled wait ----------------------------------------------------------------
pg = make_group(store, "lat", 0, 1, dt.timedelta(seconds=60), BACKEND, dt.timedelta(seconds=60), DEV)
watch = FailureWatch(store, 99)
t = torch.ones(256, device=DEV)


def fixed(work: dist.Work) -> None:  # the former loop: the fixed pause before every re-check
    while not work.is_completed():
        watch.failed()
        time.sleep(DEFAULT_TIMEOUTS.nccl_poll)
    work.wait()


def backoff(work: dist.Work) -> None:
    poll_work(work, watch, 60.0, DEFAULT_TIMEOUTS, lambda: None)


for name, wait in (("fixed_0.5ms", fixed), ("backoff", backoff)) * 2:
    samples = []
    for _ in range(300):
        if not CPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        wait(pg.allreduce([t]))
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    report(f"wait_us_{name}", {"median": statistics.median(samples), "p90": samples[int(0.9 * len(samples))]})
(OUT / "gpu_layer_draws.json").write_text(json.dumps(res, indent=1, default=str))
print("done", flush=True)
os._exit(0)
