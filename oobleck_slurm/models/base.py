"""What every model family declares: `ModelDef`, a frozen dataclass of the model's shape.

A model is an ordered list of layers that a pipeline planner can cut anywhere. The definition is pure
data (importing this module does not import torch), so that a recipe is validated and planned on a
login node; the methods that build layers import torch when called.

Every consumer goes through this interface: the profiler and the estimate (`layer_estimates`), the
planner (the layer count and names), the worker (`build_layers`, `boundary_shape`, `loss`), recovery
and checkpoints (the layer keys name each layer's state), validation (`loss`) and export (`hf_adapter`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class LayerEstimate:
    """One layer's figures for one microbatch, from its shapes alone (`plan --estimate`): the parameter
    shapes (their count, and the optimizer's state through `optim.memory`), FLOPs and memory traffic of
    its forward and backward, and the bytes it sends on, keeps for its backward, and allocates for a
    moment. Byte figures take the element sizes of the compute dtype (`act_bytes`) and of the
    parameters (`param_bytes`) given to `ModelDef.layer_estimates`."""

    name: str
    param_shapes: tuple[tuple[int, ...], ...]
    forward_flops: float
    forward_bytes: float
    backward_flops: float
    backward_bytes: float
    output_bytes: int
    activation_bytes: int
    workspace_bytes: int

    @property
    def num_params(self) -> int:
        total = 0
        for shape in self.param_shapes:
            n = 1
            for x in shape:
                n *= x
            total += n
        return total


class ModelDef(ABC):
    """The definition of a model of one family (subclasses are frozen dataclasses).

    Layers take one tensor and return one: token ids (B, seq_len) into the first, `boundary_shape`
    between layers, and the last layer's output goes to `loss` with the targets (B, seq_len).
    """

    family: ClassVar[str]
    seq_len: int
    vocab_size: int

    # ---- pure data ---------------------------------------------------------------------------

    @abstractmethod
    def layer_keys(self) -> list[str]:
        """Stable names of the layers, in order: they address parameters and optimizer state across
        plans, in recovery copies and in checkpoints."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_keys())

    @property
    @abstractmethod
    def num_params(self) -> int:
        """Parameters of the whole model."""

    def boundary_shape(self, index: int) -> tuple[int, ...]:
        """The per-sample shape of the tensor entering layer `index` (1 <= index < num_layers); the
        batch dimension comes first in front of it. A floating-point tensor of the parameters' dtype."""
        raise NotImplementedError

    def layer_estimates(self, microbatch_size: int, act_bytes: int, param_bytes: int) -> list[LayerEstimate]:
        """Per-layer figures for `--estimate`; a family without them is profiled by measurement only."""
        raise NotImplementedError(f"model family {self.family!r} has no shape-based estimate: profile it on "
                                  f"a device instead of --estimate")

    def describe(self) -> str:
        """One line for people: the family, its size and layer count."""
        return f"{self.family}: {self.num_layers} layers, {self.num_params / 1e6:,.1f} M parameters"

    def to_dict(self) -> dict[str, Any]:
        """JSON: {"family": name, **fields}; `models.model_from_dict` reads it back."""
        return {"family": self.family, **_plain(asdict(self))}  # type: ignore[call-overload]

    # ---- torch -------------------------------------------------------------------------------

    @abstractmethod
    def build_layers(self, seed: int, start: int, stop: int, device: torch.device | str | None = None,
                     initialise: bool = True) -> list[nn.Module]:
        """Layers [start, stop), each initialised from (seed, its index) alone, so that any range builds
        the same layers as a full build. They are built on the meta device and materialised on `device`
        (default CPU); `initialise=False` leaves them uninitialised there, for a worker that is about to
        receive their state (no time spent on values a copy overwrites)."""

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The microbatch's mean loss from the last layer's output: next-token cross-entropy."""
        from oobleck_slurm.models.loss import lm_loss

        return lm_loss(output, targets)

    def hf_adapter(self) -> Any:
        """The state-dict adapter to and from Hugging Face names (`models.hf.HFAdapter`)."""
        raise NotImplementedError(f"model family {self.family!r} has no Hugging Face adapter")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
