"""oobleck-slurm: fault-tolerant pipeline-parallel training on Slurm, Oobleck-style.

Subpackages, one concept each:
    recipe      typed, validated job recipes (YAML)
    models      model families as ordered layer lists the planner can cut anywhere
    planning    layer profiles, cost model, exact pipeline templates, instantiation
    engine      heterogeneous pipeline replicas on torch.distributed
    cluster     the local and Slurm backends (submitit)
"""

__version__ = "0.1.0"
