"""Optimizers: AdamW and CAME by name, their state as named tensors, and their memory.

    came    the CAME optimizer (factored second moment + factored confidence term)
    layout  per-parameter state layouts (names, shapes, dtypes) from shapes alone
    build   build_optimizer(name, ...) and the optimizer-name registry
    state   optimizer state <-> flat named tensors (recovery copies them between processes)
    memory  state bytes for the planner
"""

from oobleck_slurm.optim.build import OPTIMIZER_NAMES, build_optimizer, optimizer_name, state_layout
from oobleck_slurm.optim.came import CAME
from oobleck_slurm.optim.layout import TensorLayout
from oobleck_slurm.optim.memory import optimizer_state_bytes, state_bytes_per_param
from oobleck_slurm.optim.state import (
    empty_state_tensors,
    load_optimizer_state_tensors,
    optimizer_state_spec,
    optimizer_state_tensors,
)

__all__ = [
    "CAME",
    "OPTIMIZER_NAMES",
    "TensorLayout",
    "build_optimizer",
    "empty_state_tensors",
    "load_optimizer_state_tensors",
    "optimizer_name",
    "optimizer_state_bytes",
    "optimizer_state_spec",
    "optimizer_state_tensors",
    "state_bytes_per_param",
    "state_layout",
]
