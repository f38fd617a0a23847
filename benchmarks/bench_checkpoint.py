"""What a periodic checkpoint costs the training path, and what it costs in the background.

    python benchmarks/bench_checkpoint.py [--params 1e6,16e6,64e6] [--repeats 5] [--out DIR]

For one layer of each size (fp32 parameters, AdamW state after one step: 3 tensors of the layer's
size), the training path's cost is `layer_payload` (engine/checkpoint.py: a CPU copy of parameters,
buffers and optimizer state; on a GPU a device-to-host copy), made between two steps by the layer's
writer (the first pipeline's holder); the background thread's is `save_layer` (safetensors, fsync,
rename), which overlaps the next steps. Medians of `--repeats`, in seconds and GB/s.
Writes benchmarks/results/bench_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from oobleck_slurm.engine.checkpoint import layer_payload, save_layer

RESULTS = Path(__file__).resolve().parent / "results"


def _layer(params: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    side = max(1, int(params ** 0.5))
    layer = nn.Linear(side, side, bias=False)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, side)).sum().backward()
    opt.step()  # the state a trained layer has: exp_avg, exp_avg_sq, step
    return layer, opt


def measure(params: int, repeats: int, root: Path) -> dict[str, float]:
    layer, opt = _layer(params)
    clone, write = [], []
    nbytes = 0
    for r in range(repeats):
        t0 = time.perf_counter()
        payload = layer_payload(layer, opt)
        clone.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in payload.values())
        t0 = time.perf_counter()
        save_layer(root, r, "layer", payload)
        write.append(time.perf_counter() - t0)
    c, w = statistics.median(clone), statistics.median(write)
    return {"params": sum(p.numel() for p in layer.parameters()), "bytes": nbytes, "clone_s": c, "write_s": w,
            "clone_gb_s": nbytes / c / 1e9, "write_gb_s": nbytes / w / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1e6,16e6,64e6", help="parameters per layer, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="where the layer files go (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for params in (int(float(p)) for p in args.params.split(",")):
            row = measure(params, args.repeats, Path(tmp))
            rows.append(row)
            print(f"{row['params'] / 1e6:8.1f} M params, {row['bytes'] / 2**20:8.1f} MiB: training path (clone) "
                  f"{row['clone_s'] * 1e3:8.2f} ms ({row['clone_gb_s']:.1f} GB/s), background write "
                  f"{row['write_s'] * 1e3:8.1f} ms ({row['write_gb_s']:.2f} GB/s)", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_checkpoint.json").write_text(json.dumps({"layers": rows}, indent=1))


if __name__ == "__main__":
    main()
