"""Sharded stages in the planner (issue 23): the predicted step with stages as wide as a node, with
one-device stages (what the engine runs today), and the same cost model's data-parallel (FSDP) bound.

    python benchmarks/plan_widths.py      # table on stdout, JSON in benchmarks/results/plan_widths.json

GPT 1.3B, Llama 3.1 8B and 70B (recipes/h100/*.yaml: bf16, microbatch 4, f = 1), estimated on H100s,
8 GPUs per node, on 8 and 64 nodes; the global batch grows with the nodes (512 samples on 8 nodes,
4096 on 64), so each GPU's share of a step is the same. What `plan RECIPE --estimate H100
[--max-stage-devices 8] [--nodes 64]` prints, without the templates cache.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oobleck_slurm.planning import PlanningError, cost, generate_templates, instantiate  # noqa: E402
from oobleck_slurm.planning.cache import TemplateCache  # noqa: E402
from oobleck_slurm.planning.pregenerate import plan_request, recipe_profile  # noqa: E402
from oobleck_slurm.recipe import load_recipe  # noqa: E402

RECIPES = ("gpt-1.3b", "llama-3.1-8b", "llama-3.1-70b")
NODES = (8, 64)
GPU = "H100"


def plan_row(name: str, nodes: int) -> dict:
    recipe = load_recipe(ROOT / "recipes" / "h100" / f"{name}.yaml")
    scale = nodes // recipe.cluster.nodes
    profile, _ = recipe_profile(recipe, TemplateCache(ROOT / "templates_cache"), estimate_gpu=GPU)
    base = plan_request(recipe, nodes=nodes)
    request = replace(base, global_microbatches=base.global_microbatches * scale)
    samples = request.global_microbatches * request.microbatch_size
    row: dict = {"model": name, "nodes": nodes, "gpus": nodes * profile.devices_per_node, "global_batch": samples,
                 "microbatch": request.microbatch_size, "f": request.failures}
    for label, width in (("wide", profile.devices_per_node), ("one_device", 1)):
        t0 = time.perf_counter()
        templates = generate_templates(profile, nodes, num_microbatches=request.num_microbatches,
                                       microbatches_by_nodes=request.microbatches_by_nodes, max_stage_devices=width)
        try:
            plan = instantiate(templates, nodes, request.failures, request.global_microbatches,
                               microbatch_size=request.microbatch_size, profile=profile)
        except PlanningError as err:
            row[label] = {"error": str(err)}
            continue
        first = plan.pipelines[0]
        row[label] = {
            "step_s": plan.step_time_s, "samples_per_s": plan.samples_per_s, "pipelines": plan.num_pipelines,
            "pipeline_nodes": first.template.num_nodes, "stage_devices": [s.devices for s in first.template.stages],
            "sync_s": plan.sync_time_s, "planning_s": time.perf_counter() - t0,
        }
    bound = cost.data_parallel_step(profile, nodes * profile.devices_per_node, request.global_microbatches)
    row["dp_bound"] = {"step_s": bound, "samples_per_s": samples / bound}
    return row


def cell(entry: dict) -> str:
    if "error" in entry:
        return "no plan"
    return f"{entry['step_s']:.3f} s, {entry['samples_per_s']:,.0f}/s"


def main() -> int:
    console = Console()
    rows = []
    for name in RECIPES:
        for nodes in NODES:
            with console.status(f"{name} on {nodes} x 8 {GPU}..."):
                rows.append(plan_row(name, nodes))
    table = Table(title=f"predicted step on {GPU}s (estimate), bf16, microbatch 4, f=1")
    for col in ("model", "GPUs", "batch", "wide stages", "widths (1st pipeline)", "1-device stages",
                "DP/FSDP bound", "wide / 1-dev", "wide / bound"):
        table.add_column(col, justify="right")
    for r in rows:
        wide, one, bound = r["wide"], r["one_device"], r["dp_bound"]
        ratio = f"{wide['samples_per_s'] / one['samples_per_s']:.2f}x" if "error" not in wide and "error" not in one else "-"
        of_bound = f"{wide['samples_per_s'] / bound['samples_per_s']:.0%}" if "error" not in wide else "-"
        widths = " ".join(map(str, wide.get("stage_devices", []))) + (
            f" ({wide['pipelines']} x {wide['pipeline_nodes']} nodes)" if "error" not in wide else "")
        table.add_row(r["model"], f"{r['nodes']}x8", str(r["global_batch"]), cell(wide), widths, cell(one),
                      f"{bound['step_s']:.3f} s, {bound['samples_per_s']:,.0f}/s", ratio, of_bound)
    console.print(table)
    out = ROOT / "benchmarks" / "results" / "plan_widths.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": GPU, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
