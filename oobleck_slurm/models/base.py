"""What every model family declares: `ModelDef`, a frozen dataclass of the model's shape.

A model is an ordered list of layers that a pipeline planner can cut anywhere. The definition is pure
data (importing this module does not import torch), so that a recipe is validated and planned on a
login node; the methods that build layers import torch when called.

Every consumer goes through this interface: the profiler and the estimate (`layer_estimates`), the
planner (the layer count and names), the worker (`build_layers`, `boundary_shape`, `loss`), recovery
and checkpoints (the layer keys name each layer's state), validation (`loss`). Hugging Face
names are a family's adapter's business (`models.hf.hf_adapter`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
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
    # Whether the layers take a `models.documents.Documents` as an optional second argument
    # (`data.document_mask`); a user's factory layers take one tensor.
    supports_document_mask: ClassVar[bool] = False

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
        return {"family": self.family, **plain_json(asdict(self))}  # type: ignore[call-overload]

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


def plain_json(value: Any) -> Any:
    """`value` as plain JSON types: mappings (read-only views too) as dicts, tuples as lists."""
    if isinstance(value, Mapping):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    return value


def layer_seed(seed: int, index: int) -> int:
    """Generator seed of layer `index`: distinct per layer, independent of which layers are built."""
    return (seed * 1_000_003 + index * 7919 + 12345) % (2**63 - 1)


def build_range(num_layers: int, seed: int, start: int, stop: int | None, device: torch.device | str | None,
                initialise: bool, new_layer: Callable[[int], nn.Module],
                init_buffers: Callable[[nn.Module], None],
                init_layer: Callable[[nn.Module, torch.Generator], None]) -> list[nn.Module]:
    """Layers [start, stop) of a built-in family (`ModelDef.build_layers`): made on the meta device by
    `new_layer(index)`, materialised on `device`, their non-persistent buffers filled, and (unless
    `initialise` is False) each layer's parameters drawn from its own generator (`layer_seed`)."""
    import torch

    stop = num_layers if stop is None else stop
    if not 0 <= start < stop <= num_layers:
        raise ValueError(f"build_layers: range [{start}, {stop}) is not a non-empty range within [0, {num_layers})")
    with torch.device("meta"):
        layers = [new_layer(index) for index in range(start, stop)]
    layers = [layer.to_empty(device=device or "cpu") for layer in layers]
    for index, layer in zip(range(start, stop), layers):
        init_buffers(layer)  # not state: remade by every build, initialised or not
        if initialise:
            init_layer(layer, torch.Generator().manual_seed(layer_seed(seed, index)))
    return layers


def embedding_estimate(est: LayerEstimate, tokens: int, d_model: int, vocab: int, act_bytes: int,
                       param_bytes: int) -> LayerEstimate:
    """A token embedding's figures: memory bound, t * d * e bytes written forward, twice that (and its
    table read) backward; it keeps the token ids; its workspace is the dense gradient of its table and
    of its output."""
    t, d, v, e, p = tokens, d_model, vocab, act_bytes, param_bytes
    written = t * d * e
    return replace(est, forward_bytes=written + t * 8, backward_bytes=2 * written + est.num_params * e,
                   output_bytes=t * d * p, activation_bytes=t * 8, workspace_bytes=v * d * p + t * d * p)


def lm_head_estimate(est: LayerEstimate, tokens: int, d_model: int, vocab: int, act_bytes: int, param_bytes: int,
                     casts: int) -> LayerEstimate:
    """A final norm + LM head's figures: 2 t d V FLOPs forward; it keeps its input and the loss's fp32
    log-probabilities (t * V * 4), and `casts` bytes of autocast's weight copies; its workspace is the
    gradients of the log-probabilities and logits, and of its input."""
    t, d, v, e, p = tokens, d_model, vocab, act_bytes, param_bytes
    flops, traffic = 2 * t * d * v, est.num_params * e
    return replace(est, forward_flops=flops, forward_bytes=traffic, backward_flops=2 * flops,
                   backward_bytes=2 * traffic, output_bytes=t * v * e, activation_bytes=t * d * e + t * v * 4 + casts,
                   workspace_bytes=2 * t * v * 4 + 2 * t * d * p)
