"""The planner's Plan as the engine's ExecPlan: one worker rank per device; a stage of `devices` > 1 runs
on that many consecutive workers of one node, sharded (layout.py, shard.py)."""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec, PlanError
from oobleck_slurm.planning import Plan


def exec_plan(plan: Plan, nodes: Sequence[int | str], devices_per_node: int = 1) -> ExecPlan:
    """`plan` over `nodes` (the node ids in worker order): node k's devices are worker ranks
    k * devices_per_node ... (k + 1) * devices_per_node - 1; spare nodes' workers get no stage."""
    index = {node: k for k, node in enumerate(nodes)}
    pipelines = []
    num_layers = None
    for p in plan.pipelines:
        t = p.template
        if t.devices_per_node != devices_per_node:
            raise PlanError(f"template for {t.num_nodes} node(s) has {t.devices_per_node} devices per node, "
                            f"the job has {devices_per_node}")
        ranks, bounds, widths, keep = [], [0], [], []
        for s in t.stages:
            local = s.first_device % devices_per_node
            if s.devices < 1 or local + s.devices > devices_per_node:
                raise PlanError(f"a stage of {s.devices} devices from device {local} (layers [{s.start}, {s.stop})) "
                                f"does not fit a node of {devices_per_node} devices")
            widths.append(s.devices)
            keep.append(s.keep and s.devices > 1)
            node = p.nodes[s.first_device // devices_per_node]
            if node not in index:
                raise PlanError(f"plan uses node {node!r}, which is not among the job's nodes {list(nodes)}")
            ranks.append(index[node] * devices_per_node + s.first_device % devices_per_node)
            bounds.append(s.stop)
        num_layers = bounds[-1]
        pipelines.append(PipelineSpec(tuple(ranks), tuple(bounds), p.first_microbatch, p.microbatches, tuple(widths),
                                      tuple(keep)))
    if num_layers is None:
        raise PlanError("the plan has no pipelines")
    return ExecPlan(num_layers, plan.global_microbatches, tuple(pipelines))
