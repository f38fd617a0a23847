"""Optimizer state bytes per parameter (AdamW vs CAME) on the GPT presets, and step time on CPU.

    python benchmarks/bench_optim.py [--presets tiny 125m 175b] [--step-presets mini 100m] [--reps 20]

State bytes are computed from the parameter shapes (oobleck_slurm.optim.optimizer_state_bytes,
which tests/optim checks against real optimizer state), fp32 parameters. Step time is the median
of `--reps` optimizer steps on one real transformer block (oobleck_slurm.models.gpt.Block) with
random gradients, after two warm-up steps. Writes benchmarks/results/bench_optim.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from oobleck_slurm.models import GPT_PRESETS, GPTConfig
from oobleck_slurm.optim import build_optimizer, optimizer_state_bytes

RESULTS = Path(__file__).parent / "results" / "bench_optim.json"


def gpt_param_shapes(cfg: GPTConfig) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes per layer kind, as oobleck_slurm.models.gpt builds them (nn.Linear is
    (out, in)): embedding, one block, head."""
    d, v = cfg.d_model, cfg.vocab_size
    block = [
        (d,), (d,),  # ln1
        (3 * d, d), (3 * d,),  # attention qkv
        (d, d), (d,),  # attention projection
        (d,), (d,),  # ln2
        (4 * d, d), (4 * d,),  # fc1
        (d, 4 * d), (d,),  # fc2
    ]
    head = [(d,), (d,)] + ([] if cfg.tie_embeddings else [(v, d)])
    return {"embedding": [(v, d), (cfg.seq_len, d)], "block": block, "head": head}


def numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def state_rows(presets: list[str]) -> list[dict]:
    rows = []
    for name in presets:
        cfg = GPT_PRESETS[name]
        shapes = gpt_param_shapes(cfg)
        all_shapes = shapes["embedding"] + cfg.n_layer * shapes["block"] + shapes["head"]
        n = numel(all_shapes)
        # The shapes must add up to the config's own count, or the figures describe another model.
        assert n == cfg.num_params, (name, n, cfg.num_params)
        row = {"preset": name, "params": n}
        for opt in ("adamw", "came"):
            row[f"{opt}_bytes"] = optimizer_state_bytes(opt, all_shapes)
            row[f"{opt}_bytes_per_param"] = row[f"{opt}_bytes"] / n
            row[f"{opt}_block_bytes_per_param"] = optimizer_state_bytes(opt, shapes["block"]) / numel(
                shapes["block"]
            )
        row["came_over_adamw"] = row["came_bytes"] / row["adamw_bytes"]
        rows.append(row)
    return rows


def step_rows(presets: list[str], reps: int) -> list[dict]:
    from oobleck_slurm.models.gpt.model import Block

    rows = []
    for name in presets:
        cfg = GPT_PRESETS[name]
        row = {"preset": name, "block_params": cfg.block_params, "reps": reps}
        for opt_name in ("adamw", "came"):
            torch.manual_seed(0)
            block = Block(cfg)
            gen = torch.Generator().manual_seed(1)
            for p in block.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            opt = build_optimizer(opt_name, block.parameters(), lr=1e-4, weight_decay=0.1)
            times = []
            for k in range(reps + 2):
                t0 = time.perf_counter()
                opt.step()
                if k >= 2:
                    times.append(time.perf_counter() - t0)
            row[f"{opt_name}_step_ms_median"] = 1e3 * statistics.median(times)
            row[f"{opt_name}_step_ms_min"] = 1e3 * min(times)
        row["came_over_adamw"] = row["came_step_ms_median"] / row["adamw_step_ms_median"]
        rows.append(row)
    return rows


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n < 1e9 else f"{n / 1e9:.1f}B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(GPT_PRESETS), choices=list(GPT_PRESETS))
    ap.add_argument("--step-presets", nargs="+", default=["mini", "100m"], choices=list(GPT_PRESETS))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    states = state_rows(args.presets)
    steps = step_rows(args.step_presets, args.reps)

    console = Console()
    t = Table(title="Optimizer state per parameter (B/p), fp32 parameters; ratio = CAME/AdamW")
    columns = ("preset", "params", "AdamW B/p", "CAME B/p", "ratio", "CAME blk B/p", "AdamW GiB", "CAME GiB")
    for col in columns:
        t.add_column(col, justify="right")
    for r in states:
        t.add_row(
            r["preset"], _millions(r["params"]), f"{r['adamw_bytes_per_param']:.3f}",
            f"{r['came_bytes_per_param']:.3f}", f"{r['came_over_adamw']:.3f}",
            f"{r['came_block_bytes_per_param']:.4f}", f"{r['adamw_bytes'] / 2**30:,.1f}",
            f"{r['came_bytes'] / 2**30:,.1f}",
        )
    console.print(t)
    t2 = Table(title=f"Optimizer step on one CPU transformer block ({torch.get_num_threads()} threads)")
    for col in ("preset", "block params", "AdamW ms (median)", "CAME ms (median)", "CAME/AdamW"):
        t2.add_column(col, justify="right")
    for r in steps:
        t2.add_row(
            r["preset"], f"{r['block_params'] / 1e6:,.2f} M", f"{r['adamw_step_ms_median']:.2f}",
            f"{r['came_step_ms_median']:.2f}", f"{r['came_over_adamw']:.2f}",
        )
    console.print(t2)

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "bench_optim",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "param_dtype": "float32",
        "state": states,
        "step": steps,
    }, indent=2) + "\n")
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
