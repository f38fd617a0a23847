"""What a periodic checkpoint costs the training path, synchronous copy against asynchronous, and what
it costs in the background.

    python benchmarks/bench_checkpoint.py [--params 1e6,16e6,64e6] [--tokens 64] [--rounds 5]
                                          [--replicas 1,2,4] [--out DIR]

For one layer of each size (an fp32 `nn.Linear`, AdamW state after one step: 3 tensors of the layer's
size), in this one process:

- `clone_s`, `write_s`: `layer_payload` (engine/checkpoint.py: a CPU copy of parameters, buffers and
  optimizer state) and `save_layer` (safetensors, fsync, rename, in the writer's thread), timed alone;
- the training path of a checkpoint step, in alternating rounds: the checkpoint, then the next step's
  forward and backward over `--tokens` rows and its AdamW update. `sync`: the copy made first
  (today's `layer_payload`); `async`: the tensors handed to a `LayerCopier`, whose thread copies them
  while the step computes, the update fenced (`LayerCopier.fence`); `none`: the step alone. The cost
  of a checkpoint (`sync_cost_s`, `async_cost_s`) is the checkpoint step's time less the plain step's
  (medians of `--rounds`), so that what the copying thread takes from the step's compute counts too;
  `fence_s` is how long the update waited for the copy (median); `sync_cpu_s`, `async_cpu_s`: the
  same difference in the training thread's own CPU time (`time.thread_time`): the work the checkpoint
  puts on that thread, whatever other processes take from the cores;
- replicas: with P pipelines layer i is written by pipeline i mod P, so each of P ranks writes 1/P of
  the layers; `--layers-for-replicas` layers of the first size, P writers in this process (threads,
  one disk), the time until every writer has flushed its share.

CPU, one torch thread for the step (the copier's thread copies on another core). Medians, seconds.
Prints a table and writes benchmarks/results/bench_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oobleck_slurm.engine.checkpoint import CheckpointWriter, LayerCopier, layer_payload, live_tensors, save_layer

RESULTS = Path(__file__).resolve().parent / "results"


def _layer(params: int) -> tuple[nn.Linear, torch.optim.Optimizer]:
    side = max(1, int(params ** 0.5))
    layer = nn.Linear(side, side, bias=False)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, side)).sum().backward()
    opt.step()  # the state a trained layer has: exp_avg, exp_avg_sq, step
    return layer, opt


def _payload_bytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def measure_copy_and_write(layer: nn.Module, opt: torch.optim.Optimizer, rounds: int, root: Path) -> dict[str, float]:
    clone, write = [], []
    nbytes = 0
    for r in range(rounds):
        t0 = time.perf_counter()
        payload = layer_payload(layer, opt)
        clone.append(time.perf_counter() - t0)
        nbytes = _payload_bytes(payload)
        t0 = time.perf_counter()
        save_layer(root, r, "layer", payload)
        write.append(time.perf_counter() - t0)
    c, w = statistics.median(clone), statistics.median(write)
    return {"bytes": nbytes, "clone_s": c, "write_s": w, "clone_gb_s": nbytes / c / 1e9, "write_gb_s": nbytes / w / 1e9}


def measure_training_path(layer: nn.Linear, opt: torch.optim.Optimizer, tokens: int, rounds: int) -> dict[str, float]:
    """Medians over `rounds` of a step after no checkpoint, a synchronous one and an asynchronous one."""
    x = torch.randn(tokens, layer.in_features)
    copier = LayerCopier(torch.device("cpu"))

    def compute() -> None:  # the next step's forward and backward: they only read the parameters
        opt.zero_grad(set_to_none=False)
        layer(x).square().mean().backward()

    def none() -> float:
        compute()
        opt.step()
        return 0.0

    def sync() -> float:
        layer_payload(layer, opt)
        compute()
        opt.step()
        return 0.0

    def asynchronous() -> float:
        copier.copy("layer", live_tensors(layer, opt))
        compute()
        fence = copier.fence(["layer"])
        opt.step()
        return fence

    modes = {"none": none, "sync": sync, "async": asynchronous}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # the training thread's own CPU time
    fences: list[float] = []
    none()  # warm-up: first-touch allocations of the gradients and the kernels' workspaces
    for _ in range(rounds):
        for mode, run in modes.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fence = run()
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.thread_time() - c0)
            if mode == "async":
                fences.append(fence)
    step, sync_s, async_s = (statistics.median(wall[m]) for m in modes)
    step_cpu, sync_cpu, async_cpu = (statistics.median(cpu[m]) for m in modes)
    return {"tokens": tokens, "step_s": step, "sync_step_s": sync_s, "async_step_s": async_s,
            "sync_cost_s": sync_s - step, "async_cost_s": async_s - step, "fence_s": statistics.median(fences),
            "sync_cpu_s": sync_cpu - step_cpu, "async_cpu_s": async_cpu - step_cpu}


def measure_replicas(params: int, layers: int, replicas: list[int], root: Path) -> list[dict[str, Any]]:
    """The time until P concurrent writers (threads, one disk) have written their shares (layer i by
    writer i mod P) of a checkpoint of `layers` layers, for each P."""
    payloads = [layer_payload(*_layer(params)) for _ in range(layers)]
    rows = []
    for p in replicas:
        writers = [CheckpointWriter(root / f"p{p}") for _ in range(p)]
        t0 = time.perf_counter()
        for i, payload in enumerate(payloads):
            writers[i % p].submit(0, f"layer{i}", payload)
        for writer in writers:
            writer.flush([0])
        rows.append({"replicas": p, "layers": layers, "layers_per_rank": -(-layers // p),
                     "bytes": sum(_payload_bytes(q) for q in payloads), "write_s": time.perf_counter() - t0})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1e6,16e6,64e6", help="parameters per layer, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="rows of the next step's forward and backward")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replicas", default="1,2,4", help="pipelines for the write-time comparison ('' skips it)")
    parser.add_argument("--layers-for-replicas", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="where the layer files go (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, replica_rows = [], []
    sizes = [int(float(p)) for p in args.params.split(",")]
    print(f"{'params':>8} {'MiB':>7} | {'copy':>7} {'write':>7} | {'step':>7} {'sync +':>7} {'async +':>7} "
          f"{'fence':>7} | {'cpu sync':>8} {'async':>7}   (seconds; '+': the checkpoint's cost on the training "
          f"path; cpu: the training thread's)", flush=True)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for params in sizes:
            layer, opt = _layer(params)
            row: dict[str, Any] = {"params": sum(p.numel() for p in layer.parameters())}
            row.update(measure_copy_and_write(layer, opt, args.rounds, Path(tmp)))
            row.update(measure_training_path(layer, opt, args.tokens, args.rounds))
            rows.append(row)
            print(f"{row['params'] / 1e6:7.1f}M {row['bytes'] / 2**20:7.1f} | {row['clone_s']:7.3f} "
                  f"{row['write_s']:7.3f} | {row['step_s']:7.3f} {row['sync_cost_s']:7.3f} "
                  f"{row['async_cost_s']:7.3f} {row['fence_s']:7.3f} | {row['sync_cpu_s']:8.3f} "
                  f"{row['async_cpu_s']:7.3f}", flush=True)
        if args.replicas:
            replica_rows = measure_replicas(sizes[0], args.layers_for_replicas,
                                            [int(p) for p in args.replicas.split(",")], Path(tmp))
            for r in replica_rows:
                print(f"{r['replicas']} replica(s): {r['layers_per_rank']} of {r['layers']} layers per rank, "
                      f"{r['bytes'] / 2**20:.0f} MiB in all: written in {r['write_s']:.3f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_checkpoint.json").write_text(json.dumps(
        {"tokens": args.tokens, "rounds": args.rounds, "layers": rows, "replicas": replica_rows}, indent=1))


if __name__ == "__main__":
    main()
