"""Planning: layer profiles, the cost model, exact pipeline templates, instantiation for f failures.

    profile = estimate_profile(gpt_config("1.3b"), "A100-40", microbatch_size=4)   # or load_profile(FILE)
    templates = generate_templates(profile, max_nodes=16, num_microbatches=32)
    plan = instantiate(templates, nodes=16, f=2, global_microbatches=128, profile=profile)

Pure logic (profile, cost, templates, instantiate, estimate) does no I/O; `measure` runs torch,
`cache` writes `templates_cache/`. See docs/planning.md for the formulas.
"""

from oobleck_slurm.planning.estimate import estimate_profile
from oobleck_slurm.planning.gpus import GPUS, UnknownGPU, gpu_spec
from oobleck_slurm.planning.instantiate import PipelinePlan, Plan, choose_counts, distribute_batch, instantiate
from oobleck_slurm.planning.profile import (
    LayerProfile,
    Link,
    Profile,
    ProfileError,
    load_profile,
    profile_from_dict,
    save_profile,
)
from oobleck_slurm.planning.templates import (
    PipelineTemplate,
    PlanningError,
    StageTemplate,
    explain_infeasible,
    generate_templates,
)

__all__ = [
    "GPUS", "LayerProfile", "Link", "PipelinePlan", "PipelineTemplate", "Plan", "PlanningError", "Profile",
    "ProfileError", "StageTemplate", "UnknownGPU", "choose_counts", "distribute_batch", "estimate_profile",
    "explain_infeasible", "generate_templates", "gpu_spec", "instantiate", "load_profile",
    "profile_from_dict", "save_profile",
]
