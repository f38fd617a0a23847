"""Random layers (dropout) draw the same numbers whatever the plan.

Every layer's forward of one microbatch runs with torch's generators (the CPU's, and the worker's GPU's)
seeded from (training seed, step, microbatch of the step, layer index) alone (`draw_seed`), and the
generators' previous states are put back afterwards. So a dropout mask depends on which samples and
which layer it masks, not on which stage, pipeline or process computes them, nor on what ran before.
A recomputed forward (`training.recompute`) draws the same mask: torch's checkpoint keeps the state it
found (the seeded one) and restores it for the recomputation.

The unit is a whole microbatch: a stage wider than one rank gives each rank a slice of it (or a folded
stage several microbatches), and a slice drawn from the microbatch's seed is not the slice of the
microbatch's mask. Random layers are therefore refused on such stages: by name at recipe time when the
layers say so (`models.factory`'s `random_layers`: dropout modules), and at the first forward otherwise
(`LayerDraws.check`: the layer moved a generator).

One worker trains per process; the lock keeps the seeding right where tests run ranks as threads of one
process (the generators are the process's).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from oobleck_slurm.errors import BadInputError

_MASK = 2**63 - 1
_LOCK = threading.Lock()


def _mix(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def step_key(seed: int, step: int) -> int:
    """What every draw seed of `step` starts from (computed once a step: a layer's forward is short)."""
    return _mix(_mix(seed & 0xFFFFFFFFFFFFFFFF) ^ (step & 0xFFFFFFFFFFFFFFFF))


def draw_seed(key: int, microbatch: int, layer: int) -> int:
    """The generators' seed for `layer`'s forward of `microbatch` (of the whole step) in the step whose
    `step_key` is `key`: one value per (microbatch, layer) as long as layer < 2**24."""
    return _mix(key ^ ((microbatch << 24) | layer)) & _MASK


class LayerDrawError(BadInputError, NotImplementedError):
    """A layer drew random numbers on a stage that splits microbatches between ranks."""


@dataclass(frozen=True)
class LayerDraws:
    """How a worker seeds its layers' random draws: the training seed and the step; the device whose
    generator (besides the CPU's) the layers draw from."""

    seed: int
    step: int
    device: torch.device
    key: int = field(init=False, repr=False)  # step_key(seed, step)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", step_key(self.seed, self.step))

    @contextlib.contextmanager
    def seeded(self, microbatch: int, layer: int, check: str | None = None) -> Iterator[None]:
        """Run the body with the generators seeded for (microbatch, layer), then restore them. With
        `check` (the layer's name), raise LayerDrawError if the body drew a random number."""
        s = draw_seed(self.key, microbatch, layer)
        cpu = torch.default_generator
        gpu = None
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            gpu = torch.cuda.default_generators[index]
        with _LOCK:
            saved = cpu.get_state(), gpu.get_state() if gpu is not None else None
            cpu.manual_seed(s)
            if gpu is not None:
                gpu.manual_seed(s)
            fresh = cpu.get_state() if check is not None else None
            try:
                yield
                # the CPU generator has no offset: its whole state tells whether it moved; a GPU's
                # offset counts what its kernels drew (host-side: no sync)
                if fresh is not None and (not torch.equal(cpu.get_state(), fresh)
                                          or (gpu is not None and gpu.get_offset() != 0)):
                    raise LayerDrawError(
                        f"layer {check} draws random numbers in training (dropout?) on a stage wider than "
                        f"one worker: such a stage gives each worker a slice of a microbatch, and a slice's "
                        f"draws would depend on the plan. Set cluster.max_stage_devices: 1, or make the "
                        f"layer deterministic")
            finally:
                cpu.set_state(saved[0])
                if gpu is not None and saved[1] is not None:
                    gpu.set_state(saved[1])
