"""Planner benchmark: template and instantiation speed, plan quality vs brute force, cost-model accuracy.

    python benchmarks/bench_planner.py            # table on stdout, JSON in benchmarks/results/planner.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "planning"))

from bruteforce import best_counts_brute, best_template_brute  # noqa: E402 - tests/planning/bruteforce.py

from oobleck_slurm.models import gpt_config  # noqa: E402
from oobleck_slurm.planning import estimate_profile, generate_templates, instantiate  # noqa: E402
from oobleck_slurm.planning.instantiate import choose_counts, fluid_time  # noqa: E402

REPEATS = 3


def timed(fn, repeats: int = REPEATS) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def template_speed(n_layer: int, max_nodes: int, max_stage_devices: int, nb: int) -> dict:
    profile = estimate_profile(gpt_config("175b", n_layer=n_layer), "H100", microbatch_size=1, optimizer="came")
    seconds, templates = timed(lambda: generate_templates(
        profile, max_nodes, num_microbatches=nb, max_stage_devices=max_stage_devices))
    sizes = [t.num_nodes for t in templates]
    return {
        "case": f"templates: {n_layer} blocks (+embed, head), 8 GPU/node, 1..{max_nodes} nodes, "
                f"stage <= {max_stage_devices} GPU, N_b={nb}",
        "median_s": seconds, "goal_s": 2.0,
        "detail": f"{len(sizes)} sizes fit ({sizes[0]}..{sizes[-1]})" if sizes else "none fit",
    }, profile, templates


def instantiation_speed(templates, profile) -> dict:
    seconds, plan = timed(lambda: instantiate(templates, 1024, 8, 4096, profile=profile), repeats=5)
    return {
        "case": "instantiate + distribute batch: N=1024, f=8, 4096 microbatches (32-block templates)",
        "median_s": seconds, "goal_s": 0.5,
        "detail": f"{plan.num_pipelines} pipelines, {plan.nodes_used} nodes used, {plan.samples_per_s:,.0f} samples/s",
    }


def quality(cases: int = 200) -> dict:
    from planning_helpers import random_profile

    rng = random.Random(1)
    worst_t, worst_i, compared = 0.0, 0.0, 0
    for _ in range(cases):
        d = rng.choice([1, 2])
        profile = random_profile(rng, rng.randint(2, 6), d, rng.random() < 0.5)
        nb = rng.randint(1, 8)
        g = rng.choice([1, 2])
        max_nodes = 6 // d
        templates = generate_templates(profile, max_nodes, num_microbatches=nb, max_stage_devices=g)
        for t in templates:
            brute = best_template_brute(profile, t.num_nodes, nb, g)
            worst_t = max(worst_t, t.iteration_time_s / brute.iteration_time_s - 1)
            compared += 1
        if templates:
            nodes, f, batch = rng.randint(1, 10), rng.randint(0, 2), rng.randint(3, 12)
            brute = best_counts_brute(templates, nodes, f + 1, batch)
            if brute is not None:
                counts = choose_counts(templates, nodes, f + 1, batch)
                chosen = [t for c, t in zip(counts, templates) for _ in range(c)]
                worst_i = max(worst_i, fluid_time(chosen, batch) / brute[0] - 1)
    return {"template_cases": compared, "template_max_gap_pct": 100 * worst_t, "instantiation_max_gap_pct": 100 * worst_i}


def cost_model_accuracy(microbatches: int = 8) -> dict:
    """One worker running the whole tiny GPT (one stage): predicted vs measured iteration time."""
    import torch

    from oobleck_slurm.models.gpt.model import build_layers
    from oobleck_slurm.models.loss import lm_loss
    from oobleck_slurm.planning.measure import profile_model
    from oobleck_slurm.planning.profile import Link

    torch.set_num_threads(1)
    cfg = gpt_config("tiny")
    mb = 2
    local = Link(0.0, 1e12)  # one stage: no transfers
    profile = profile_model(cfg, microbatch_size=mb, links={k: local for k in
                            ("intra_node", "inter_node", "allreduce_intra", "allreduce_inter")}, repeats=7)
    (template,) = generate_templates(profile, 1, 1, num_microbatches=microbatches)
    predicted = template.iteration_time_s
    layers = build_layers(cfg, seed=0)
    model = torch.nn.Sequential(*layers)
    x = torch.randint(cfg.vocab_size, (mb, cfg.seq_len))

    def step() -> None:
        for _ in range(microbatches):
            lm_loss(model(x), x).backward()
        model.zero_grad(set_to_none=True)

    step()
    measured, _ = timed(step, repeats=7)
    return {"model": "tiny GPT, 1 worker, 1 thread", "microbatches": microbatches,
            "predicted_s": predicted, "measured_s": measured, "measured_over_predicted": measured / predicted}


def main() -> int:
    console = Console()
    rows = []
    with console.status("templates, 96 blocks..."):
        rows.append(template_speed(96, 64, 8, 16)[0])
        rows.append(template_speed(96, 64, 1, 16)[0])
    with console.status("templates, 32 blocks..."):
        row, profile32, templates32 = template_speed(32, 512, 8, 16)
        rows.append(row)
    with console.status("instantiation..."):
        rows.append(instantiation_speed(templates32, profile32))
    with console.status("plan quality vs brute force..."):
        q = quality()
    with console.status("cost model vs a measured run..."):
        acc = cost_model_accuracy()
    table = Table(title="planner benchmark (median of repeats)")
    for col in ("case", "median s", "goal s", "detail"):
        table.add_column(col)
    for r in rows:
        ok = "green" if r["median_s"] < r["goal_s"] else "red"
        table.add_row(r["case"], f"[{ok}]{r['median_s']:.3f}[/]", f"{r['goal_s']}", r["detail"])
    console.print(table)
    console.print(f"plan quality vs brute force: {q['template_cases']} template cases, max gap "
                  f"{q['template_max_gap_pct']:.6f}%; instantiation max gap {q['instantiation_max_gap_pct']:.6f}%")
    console.print(f"cost model: predicted {acc['predicted_s'] * 1e3:.2f} ms, measured {acc['measured_s'] * 1e3:.2f} ms, "
                  f"measured/predicted = {acc['measured_over_predicted']:.3f} ({acc['model']}, {acc['microbatches']} microbatches)")
    out = ROOT / "benchmarks" / "results" / "planner.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"speed": rows, "quality": q, "cost_model": acc}, indent=2) + "\n")
    console.print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
