"""What is simulated: the model's profile and real templates, the batch, f, and the checkpoint cadence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from oobleck_slurm.planning import PipelineTemplate, Profile

# Device-to-host copy rate of an asynchronous snapshot (PCIe 4.0 x16 is 32 GB/s raw; ~25 GB/s
# achieved): an Oobleck checkpoint stalls training only for this copy, the write to storage overlaps.
SNAPSHOT_BPS = 25e9


@dataclass(frozen=True)
class Scenario:
    """One model on one kind of node: everything the systems plan with."""

    profile: Profile
    templates: tuple[PipelineTemplate, ...]
    f: int
    global_microbatches: int
    microbatch_size: int
    checkpoint_interval: int = 100  # Oobleck's steps between asynchronous checkpoints (the recipe's); 0 = never
    name: str = "run"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def batch_samples(self) -> int:
        return self.global_microbatches * self.microbatch_size

    @cached_property
    def layer_bytes(self) -> tuple[int, ...]:
        """What recovery copies per layer: parameters and optimizer state."""
        return tuple(int(layer.param_bytes + layer.optimizer_bytes) for layer in self.profile.layers)

    @property
    def link_Bps(self) -> float:
        return self.profile.link("inter_node").bandwidth_Bps

    def stage_state_bytes(self, template: PipelineTemplate) -> float:
        """The largest parameter + optimizer state one device of `template` holds."""
        lb = self.layer_bytes
        return max(sum(lb[s.start:s.stop]) / s.devices for s in template.stages)

    @cached_property
    def n0(self) -> int:
        return min(t.num_nodes for t in self.templates)


def scenario_from(profile: Profile, templates: Sequence[PipelineTemplate], *, f: int, global_microbatches: int,
                  microbatch_size: int, checkpoint_interval: int = 100, name: str = "run") -> Scenario:
    return Scenario(profile, tuple(templates), f, global_microbatches, microbatch_size, checkpoint_interval, name)
