"""A tiny job, templates for it, and the plans the recovery tests start from."""

from __future__ import annotations

from oobleck_slurm.engine.comm import Timeouts
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models.config import gpt_config
from oobleck_slurm.planning import Plan, PipelinePlan, distribute_batch, estimate_profile, generate_templates

STEPS = 5
# Generous: other engineers share the 2 cores. Ordered: collective < reconfiguration < run.
TIMEOUTS = Timeouts(store=60, connect=120, collective=60, step=300, run=300)


def tiny_job(optimizer: str = "adamw", steps: int = STEPS, faults: list | None = None,
             precision: str = "fp64") -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 4 blocks, d=64, seq 64: 6 layers
        data=DataSpec("random", num_samples=512, seed=1),
        optim=OptimSpec(optimizer, lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=steps, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=1.0,
                        warmup_steps=2, precision=precision),
        extra={"save_params": True, "faults": faults or []},
    )


def tiny_templates(job: JobSpec, max_nodes: int = 6):
    profile = estimate_profile(job.model.gpt, "A100-40", microbatch_size=job.train.microbatch_size,
                               devices_per_node=1)
    return generate_templates(profile, max_nodes, num_microbatches=4)


def plan_of(templates, sizes: list[int], batch: int = 8, spares: int = 0) -> Plan:
    """Pipelines of the given node counts on nodes 0, 1, ... (then spares)."""
    by = {t.num_nodes: t for t in templates}
    chosen = [by[s] for s in sizes]
    shares = distribute_batch(chosen, batch)
    pipes, node, first = [], 0, 0
    for t, nb in zip(chosen, shares):
        pipes.append(PipelinePlan(t, tuple(range(node, node + t.num_nodes)), nb, first))
        node += t.num_nodes
        first += nb
    return Plan(tuple(pipes), tuple(range(node, node + spares)), batch, 2, 0.0)
