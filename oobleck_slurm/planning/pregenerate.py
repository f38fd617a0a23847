"""From a recipe to a profile and templates, through templates_cache/ (what `submit` and `plan` call).

A template of n nodes is optimised for the microbatches its pipelines run: in a job planned on N nodes
with B global microbatches, about N / n pipelines of n nodes share the batch, max(1, ceil(B n / N))
each (`PlanRequest.template_microbatches`). Its memory is checked with N_b = ceil(B / (f + 1)) in
flight, B the global microbatches: the share of a pipeline in the smallest plan that survives f
failures (more than it runs at first: after failures pipelines take more). The node range is 1 .. the
allocation (nodes + spares); sizes that cannot hold the model are left out, so the smallest
template is n0 and, whenever the allocation allows f >= 1, every size n0 .. 2 n0 - 1 that fits is
generated (the coverage guarantee in `instantiate`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oobleck_slurm.models import FactoryModel, with_layers
from oobleck_slurm.planning.cache import TemplateCache
from oobleck_slurm.planning.estimate import estimate_profile
from oobleck_slurm.planning.gpus import GPUS
from oobleck_slurm.planning.instantiate import Plan, instantiate
from oobleck_slurm.planning.profile import Profile, load_profile, profile_from_dict, with_recompute
from oobleck_slurm.planning.templates import PipelineTemplate, PlanningError, explain_infeasible, generate_templates

# Bump when the template algorithm or the cost model changes: older cache entries become stale.
# 2: the memory model counts every term a worker holds (fp32 master weights under bf16, stage outputs
# per microbatch in flight, boundary gradients).
# 3: stages of g > 1 devices are sharded (ZeRO-3 inside the stage: state / g, gathers and scatters on the
# intra-node link), any divisor of the node's devices, placed anywhere inside one node.
# 4: each template optimised for its own microbatch count (B n / N), memory still for ceil(B / (f + 1)).
# 5: a sharded stage is kept (parameters gathered once per step) or resharded, whichever is faster and fits;
# gathers in the parameters' dtype.
PLANNER_VERSION = 5
# Bump when what a measured profile counts changes (planning/measure.py): cached profiles become stale.
# 2: layers in the parameter dtype under autocast for bf16; the loss counted with the last layer.
MEASURE_VERSION = 2

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class PlanRequest:
    """What templates are made for, from a recipe (and command-line overrides)."""

    max_nodes: int
    failures: int
    global_microbatches: int
    microbatch_size: int
    max_stage_devices: int = 1  # recipe cluster.max_stage_devices (sharded stages: engine/shard.py)
    use_all_nodes: bool = False  # no idle spare node (recipe cluster.use_all_nodes)

    @property
    def num_microbatches(self) -> int:
        """N_b the memory model counts in flight (module doc)."""
        return max(1, math.ceil(self.global_microbatches / (self.failures + 1)))

    def template_microbatches(self, num_nodes: int) -> int:
        """N_b a template of `num_nodes` nodes is optimised for: its pipelines' share of the batch when
        the max_nodes nodes run pipelines of that size."""
        return max(1, math.ceil(self.global_microbatches * num_nodes / self.max_nodes))

    @property
    def microbatches_by_nodes(self) -> dict[int, int]:
        return {n: self.template_microbatches(n) for n in range(1, self.max_nodes + 1)}


def plan_request(recipe: Any, *, nodes: int | None = None, failures: int | None = None) -> PlanRequest:
    training = recipe.training
    return PlanRequest(
        max_nodes=nodes if nodes is not None else recipe.cluster.nodes + recipe.cluster.spare_nodes,
        failures=failures if failures is not None else recipe.fault_tolerance.f,
        global_microbatches=training.global_microbatches,
        microbatch_size=training.microbatch_size,
        max_stage_devices=recipe.cluster.stage_devices(factory_model=recipe.model.factory is not None),
        use_all_nodes=recipe.cluster.use_all_nodes,
    )


def recipe_profile(
    recipe: Any,
    cache: TemplateCache,
    *,
    profile_file: str | os.PathLike[str] | None = None,
    estimate_gpu: str | None = None,
    progress: Progress | None = None,
) -> tuple[Profile, str]:
    """The profile to plan with, and where it came from ('file', 'estimate', 'cache hit', 'measured'),
    with the recipe's `cluster.memory_per_device` as the device memory when it is set."""
    profile, source = _source_profile(recipe, cache, profile_file=profile_file, estimate_gpu=estimate_gpu,
                                      progress=progress)
    if recipe.training.recompute:
        profile = with_recompute(profile)
    budget = recipe.cluster.memory_per_device
    if budget is not None:
        from dataclasses import replace

        from oobleck_slurm.recipe.schema import parse_bytes

        profile = replace(profile, device_memory_bytes=parse_bytes(budget))
    return profile, source


def _source_profile(
    recipe: Any,
    cache: TemplateCache,
    *,
    profile_file: str | os.PathLike[str] | None = None,
    estimate_gpu: str | None = None,
    progress: Progress | None = None,
) -> tuple[Profile, str]:
    training = recipe.training
    per_node = recipe.cluster.devices_per_node
    if profile_file is not None:
        return load_profile(profile_file), "file"
    cfg = with_layers(recipe.model.resolve(), training.seed)
    if estimate_gpu is not None:
        if isinstance(cfg, FactoryModel):
            raise PlanningError(f"--estimate {estimate_gpu}: a model.factory model has no shape-based estimate; "
                                f"profile it (on a compute node: `python -m oobleck_slurm profile RECIPE --json > "
                                f"FILE`, then --profile FILE)")
        return estimate_profile(
            cfg, estimate_gpu, microbatch_size=training.microbatch_size, dtype=training.precision,
            optimizer=training.optimizer.name,
            # the job's devices per node (the plan must map onto its workers), not the GPU's usual node
            devices_per_node=recipe.cluster.devices_per_node,
        ), "estimate"
    import torch

    if recipe.cluster.gpus_per_node > 0 and not torch.cuda.is_available():
        raise PlanningError(
            f"the recipe runs on GPUs ({recipe.cluster.gpus_per_node} per node) but this machine has none "
            f"to profile on: pass --estimate GPU (known: {', '.join(GPUS)}) or --profile FILE made on a "
            f"compute node with `python -m oobleck_slurm profile RECIPE --json > FILE`"
        )
    from oobleck_slurm.planning.measure import device_description, profile_model

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    inputs = {
        "model": cfg.to_dict(), "microbatch_size": training.microbatch_size,
        "dtype": training.precision, "optimizer": training.optimizer.name, "devices_per_node": per_node,
        "device_name": device_description(device)[0], "torch_version": torch.__version__, "source": "measured",
        "measure_version": MEASURE_VERSION,
    }

    def measure() -> dict[str, Any]:
        report = (lambda done, total: progress("profiling layers", done, total)) if progress else None
        return profile_model(
            cfg, microbatch_size=training.microbatch_size, dtype=training.precision,
            optimizer=training.optimizer.name, devices_per_node=per_node, progress=report,
        ).to_dict()

    data, status = cache.get_or_create("profile", inputs, measure)
    return profile_from_dict(data, where=str(cache.path("profile", cache.key(inputs)))), (
        "cache hit" if status == "hit" else "measured"
    )


def cached_templates(
    profile: Profile, request: PlanRequest, cache: TemplateCache, progress: Progress | None = None
) -> tuple[list[PipelineTemplate], str]:
    """All feasible templates for 1 .. request.max_nodes, from the cache or generated and stored."""
    inputs = {
        "planner_version": PLANNER_VERSION, "profile_key": profile.key, "profile_content": profile.content_hash(),
        "min_nodes": 1, "max_nodes": request.max_nodes, "num_microbatches": request.num_microbatches,
        "template_microbatches": [request.template_microbatches(n) for n in range(1, request.max_nodes + 1)],
        "max_stage_devices": request.max_stage_devices,
    }

    def create() -> dict[str, Any]:
        report = (lambda done, total: progress("generating templates", done, total)) if progress else None
        templates = generate_templates(
            profile, request.max_nodes, 1, num_microbatches=request.num_microbatches,
            microbatches_by_nodes=request.microbatches_by_nodes, max_stage_devices=request.max_stage_devices, progress=report,
        )
        return {"templates": [t.to_dict() for t in templates]}

    data, status = cache.get_or_create("templates", inputs, create)
    return [PipelineTemplate.from_dict(t) for t in data["templates"]], status


def pregenerate(
    recipe: Any,
    cache_dir: str | os.PathLike[str] = "templates_cache",
    *,
    profile_file: str | os.PathLike[str] | None = None,
    estimate_gpu: str | None = None,
    progress: Progress | None = None,
) -> tuple[Profile, list[PipelineTemplate]]:
    """Profile the recipe's model (or reuse the cached profile) and make its templates, before the job."""
    cache = TemplateCache(cache_dir)
    profile, _ = recipe_profile(recipe, cache, profile_file=profile_file, estimate_gpu=estimate_gpu, progress=progress)
    templates, _ = cached_templates(profile, plan_request(recipe), cache, progress)
    return profile, templates


def require_templates(profile: Profile, templates: list[PipelineTemplate], request: PlanRequest) -> None:
    """PlanningError saying why, with the figures, when no node count up to the request's holds the model."""
    if not templates:
        raise PlanningError(f"the model fits on no node count up to {request.max_nodes}: "
                            f"{explain_infeasible(profile, request.num_microbatches, request.max_stage_devices)}")


def instantiate_for(profile: Profile, templates: list[PipelineTemplate], request: PlanRequest,
                    nodes: int | None = None) -> Plan:
    """The plan for `nodes` (default: the request's) with the request's f and batch, as `plan` shows it
    and `submit` checks it before launch; PlanningError with the figures when none fits."""
    require_templates(profile, templates, request)
    try:
        return instantiate(templates, request.max_nodes if nodes is None else nodes, request.failures,
                           request.global_microbatches, microbatch_size=request.microbatch_size, profile=profile,
                           use_all_nodes=request.use_all_nodes)
    except PlanningError as err:
        raise PlanningError(f"{err} (the smallest pipeline that fits has {templates[0].num_nodes} nodes)") from None
