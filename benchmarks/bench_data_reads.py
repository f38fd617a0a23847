"""Reads off the critical path (issue 36): how long each step's training loop waits for its samples,
with the next step read ahead by a thread (`data.prefetch: true`, the default) and without (false),
side by side, on the tiny and mini GPTs.

    python benchmarks/bench_data_reads.py [--presets tiny,mini] [--steps 40] [--drop 5] [--rounds 1]
                                          [--nodes 4] [--span 2] [--device cpu|cuda] [--json PATH]

Every figure comes from a job started the way `submit` starts one (benchmarks/_jobs.py: prepare_job +
start_local: supervisor, agents, one worker process per device) on the shipped text, read from its
events.jsonl: rank 0's `step` events carry `data_s` (the longest any rank's loop waited for its samples
in that step: with reading ahead, the hand-over of what the thread read during the previous step; without,
the read itself) and `seconds` (the step's wall time). On CPU, `--nodes` nodes of one worker with a
`cluster.memory_per_device` for which every pipeline spans `--span` nodes (first stages read inputs, last
stages targets; `--span 1`: data parallel, each rank both). For each preset the same recipe runs with
reading ahead on and off, alternately, `--rounds` times each; medians over each run's steps after the
first `--drop`, then over rounds. Target: median data_s / step seconds < 1% with reading ahead.

`--device cuda` (written and checked on a CPU-only machine, where it stops with a clear error; not run
on a GPU yet): one node with `--gpus` GPUs, one worker each (pinned buffers, non-blocking copies).

Writes benchmarks/results/bench_data_reads.json; exits 1 if the target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _jobs import budget_for_span, drop_warmup, median, plan_summary, recipe_dict, run_job
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "bench_data_reads.json"
TARGET = 0.01  # data_s / step seconds with reading ahead


def run(d: dict[str, Any], prefetch: bool, root: Path, cache: Path, estimate: str | None, drop: int,
        timeout: float) -> dict[str, Any]:
    """One job with `data.prefetch` set; its steps' data_s and seconds, medians over the kept steps."""
    job = run_job({**d, "data": {"prefetch": prefetch}}, root, cache, estimate=estimate, timeout=timeout)
    steps = job.kind("step")
    plans = job.kind("plan")
    if len(plans) != 1 or any("data_s" not in e for e in steps):
        raise SystemExit(f"expected one plan and data_s in every step event: {job.job.path}")
    kept = drop_warmup(steps, drop)
    return {"prefetch": prefetch, "partition": plan_summary(plans[0]),
            "data_s": [e["data_s"] for e in steps], "step_s": [e["seconds"] for e in steps],
            "median_data_s": median([e["data_s"] for e in kept]), "median_step_s": median([e["seconds"] for e in kept]),
            "median_ratio": median([e["data_s"] / e["seconds"] for e in kept]),
            "total_ratio": sum(e["data_s"] for e in kept) / sum(e["seconds"] for e in kept),
            "losses": [e["loss"] for e in steps], "job": str(job.job.path)}


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The rounds' medians of each run's medians."""
    return {k: median([r[k] for r in runs]) for k in ("median_data_s", "median_step_s", "median_ratio", "total_ratio")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--presets", default="tiny,mini", help="GPT sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--drop", type=int, default=5, help="first steps left out of the medians (warm-up)")
    ap.add_argument("--rounds", type=int, default=1, help="on/off pairs per preset; the rounds' median")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=4, help="CPU: nodes of one worker each")
    ap.add_argument("--span", type=int, default=2, help="CPU: nodes per pipeline (1: data parallel)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gpus", type=int, default=1, help="--device cuda: GPUs of the one node")
    ap.add_argument("--estimate", default="A100-40",
                    help="plan with this GPU's estimated profile ('none': measure this machine's)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job before it is killed")
    ap.add_argument("--keep-jobs", action="store_true")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is "
                         f"False; torch {torch.__version__}); run without --device cuda for the CPU benchmark")
    estimate = None if args.estimate.lower() == "none" else args.estimate
    console = Console(width=None if sys.stdout.isatty() else 200)
    root = Path(tempfile.mkdtemp(prefix="bench_data_reads_"))
    cache = root / "templates_cache"
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "torch": torch.__version__, "device": args.device},
                           "settings": {k: v for k, v in vars(args).items() if k != "json"}, "presets": {}}
    ok = True
    try:
        table = Table(title=f"data_s: each step's wait for its samples (medians of steps {args.drop}..{args.steps - 1})")
        for col in ("model", "partition", "reading ahead", "data_s (ms)", "step (ms)", "data_s / step",
                    "off / on data_s"):
            table.add_column(col)
        for preset in args.presets.split(","):
            common = {"size": preset, "steps": args.steps, "global_batch": args.global_batch,
                      "microbatch": args.microbatch_size, "f": 0, "warmup_steps": 1, "name": f"reads-{preset}"}
            if cuda:
                d = recipe_dict(nodes=1, gpus_per_node=args.gpus, precision="bf16", **common)
            else:
                d = recipe_dict(nodes=args.nodes, workers=1, **common)
                if args.span > 1:
                    d["cluster"]["memory_per_device"] = budget_for_span(d, args.span, cache, estimate, root / "recipes")
            console.print(f"[bold]{preset}[/]: {args.rounds} round(s) of reading ahead on, then off ...")
            runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            for _ in range(args.rounds):
                for mode in runs:
                    runs[mode].append(run(d, mode == "on", root, cache, estimate, args.drop, args.timeout))
            if runs["on"][0]["losses"] != runs["off"][0]["losses"]:
                raise SystemExit(f"{preset}: the losses differ with reading ahead on and off (same samples expected)")
            on, off = summary(runs["on"]), summary(runs["off"])
            met = on["median_ratio"] < TARGET
            ok &= met
            out["presets"][preset] = {"recipe": d, "on": on, "off": off, "runs": runs, "target_met": met,
                                      "off_over_on_data_s": off["median_data_s"] / on["median_data_s"]
                                      if on["median_data_s"] else None}
            for mode, s in (("on", on), ("off", off)):
                table.add_row(preset, runs[mode][0]["partition"], mode, f"{1e3 * s['median_data_s']:.3f}",
                              f"{1e3 * s['median_step_s']:.1f}", f"{s['median_ratio']:.3%}",
                              f"{off['median_data_s'] / on['median_data_s']:.1f}x" if mode == "on" and on["median_data_s"]
                              else "")
        console.print(table)
    finally:
        if not args.keep_jobs:
            shutil.rmtree(root, ignore_errors=True)
    out["target"] = TARGET
    out["targets_met"] = ok
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    console.print(f"target (reading ahead: median data_s / step < {TARGET:.0%}): {'met' if ok else 'MISSED'}; "
                  f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
