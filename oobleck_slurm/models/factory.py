"""A user's own model: `model.factory: "package.module:function"` in a recipe.

The factory is called as `f(seed, start, stop, **kwargs)` and returns layers [start, stop) of the
user's model, each initialised from (seed, its index) alone; with `stop=None` it returns all of them,
which is how the model declares its layers: their count, and their names when it returns a dict
{name: module} (a list gets the names layer.00, layer.01, ...). The first layer takes token ids
(B, seq_len); the last returns logits (B, seq_len, vocab_size), trained with next-token cross-entropy.
Buffers must be constants of the model: a layer whose forward updates a buffer in training (BatchNorm's
running statistics) is refused by name, since each replica would update its own from its own samples,
and copies between stage widths rebuild buffers from the seed. They travel with whole-layer recovery
copies, and persistent ones into checkpoints. Layers with dropout modules are listed (`random_layers`):
the engine seeds every layer's draws per (step, microbatch, layer) (engine/layer_rng.py), which a
stage wider than one worker cannot keep, so such a model needs `cluster.max_stage_devices: 1`.

`inspect_factory` builds the whole model on the meta device (no memory, no initialisation) and pushes
a (1, seq_len) batch through it: that gives the layer names and the tensor shapes between layers, and
finds what would break a job (an import error, a wrong return type, a layer whose output the next one
cannot take) before any node is allocated.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from oobleck_slurm.errors import BadInputError
from oobleck_slurm.models.base import ModelDef

if TYPE_CHECKING:
    import torch
    from torch import nn


class FactoryError(BadInputError, ValueError):
    """A user's model factory does not fit the job: `key` is the recipe key to fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class FactoryModel(ModelDef):
    family: ClassVar[str] = "factory"
    factory: str
    seq_len: int
    vocab_size: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Filled by `inspect_factory`: the declared layer names, and the per-sample shape entering each
    # layer after the first.
    layer_names: tuple[str, ...] = ()
    boundaries: tuple[tuple[int, ...], ...] = ()
    params: int = 0
    # The layers holding a dropout module (or attention with dropout) that is active in training.
    random_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # from JSON: lists back to tuples
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        object.__setattr__(self, "boundaries", tuple(tuple(b) for b in self.boundaries))
        object.__setattr__(self, "random_layers", tuple(self.random_layers))

    def layer_keys(self) -> list[str]:
        if not self.layer_names:
            raise RuntimeError(f"model factory {self.factory!r} was not inspected: call inspect_factory first")
        return list(self.layer_names)

    @property
    def num_params(self) -> int:
        return self.params

    def boundary_shape(self, index: int) -> tuple[int, ...]:
        return self.boundaries[index - 1]

    def describe(self) -> str:
        return f"{self.factory}: {self.num_layers} layers, {self.num_params / 1e6:,.1f} M parameters"

    def build_layers(self, seed: int, start: int, stop: int, device: torch.device | str | None = None,
                     initialise: bool = True) -> list[nn.Module]:
        import torch

        fn = load_factory(self.factory)
        if initialise:  # the user's own initialisation, on the CPU (the same values on every device)
            layers = _checked(self.factory, fn(seed, start, stop, **self.kwargs), start, stop)
            return [layer.to(device or "cpu") for layer in layers]
        with torch.device("meta"):
            layers = _checked(self.factory, fn(seed, start, stop, **self.kwargs), start, stop)
        return [layer.to_empty(device=device or "cpu") for layer in layers]


def inspect_factory(model: FactoryModel, seed: int = 0) -> FactoryModel:
    """`model` with its layer names, boundary shapes and parameter count, from a meta-device build;
    FactoryError naming the recipe key when the factory does not fit a job."""
    import torch

    try:
        fn = load_factory(model.factory)
    except FactoryError:
        raise
    except Exception as err:  # the module itself fails to import (a syntax error, a NameError, ...)
        raise FactoryError("model.factory", f"model factory {model.factory!r} cannot be loaded: importing it "
                           f"raised {type(err).__name__}: {err}") from err
    call = f"f(seed, 0, None{', **model.kwargs' if model.kwargs else ''})"
    try:
        with torch.device("meta"):
            built = fn(seed, 0, None, **model.kwargs)
    except Exception as err:  # the user's code: reported as bad input, not a traceback
        key = "model.kwargs" if model.kwargs and isinstance(err, TypeError) else "model.factory"
        raise FactoryError(key, f"model factory {model.factory!r}: calling {call} (all layers) raised "
                           f"{type(err).__name__}: {err}") from err
    names, layers = _named(model.factory, built, call)
    n = len(layers)
    if n < 1:
        raise FactoryError("model.factory", f"model factory {model.factory!r}: {call} returned no layers")
    x: Any = torch.zeros(1, model.seq_len, dtype=torch.long, device="meta")
    boundaries: list[tuple[int, ...]] = []
    for index, layer in enumerate(layers):
        if index > 0:
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
                raise FactoryError("model.factory", (
                    f"model factory {model.factory!r}: layer {index - 1} ({names[index - 1]}) must return one "
                    f"floating-point tensor for the next layer, got {got}"))
            boundaries.append(tuple(x.shape[1:]))
        layer.train()  # as the engine trains it: buffers that training updates are updated here too
        before = {name: (buf, buf._version) for name, buf in layer.named_buffers()}
        try:
            with torch.no_grad():
                x = layer(x)
        except Exception as err:
            what = "token ids of shape (1, model.seq_len)" if index == 0 else f"the output of layer {index - 1}"
            raise FactoryError("model.factory", (
                f"model factory {model.factory!r}: layer {index} ({names[index]}) cannot take {what} "
                f"on the meta device: {type(err).__name__}: {err}")) from err
        _refuse_updated_buffers(model.factory, index, names[index], layer, before)
    want = (1, model.seq_len, model.vocab_size)
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
    if shape != want:
        key = "model.vocab_size" if shape is not None and shape[:2] == want[:2] else "model.factory"
        got = f"shape {shape}" if shape is not None else type(x).__name__
        raise FactoryError(key, (
            f"model factory {model.factory!r}: the last layer ({names[-1]}) must return logits "
            f"(B, model.seq_len, model.vocab_size) = {want} for token ids of shape (1, {model.seq_len}), got {got}"))
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    random = tuple(i for i, layer in enumerate(layers) if _random_modules(layer))
    return replace(model, layer_names=tuple(names), boundaries=tuple(boundaries), params=params,
                   random_layers=random)


def _refuse_updated_buffers(factory: str, index: int, name: str, layer: nn.Module,
                            before: dict[str, tuple[torch.Tensor, int]]) -> None:
    """FactoryError naming the buffers that one forward of `layer` in training mode updated in place or
    replaced (`before`: each buffer and its version counter before it), and the modules that keep
    running statistics (BatchNorm, InstanceNorm with track_running_stats) even if the meta device's
    kernels left their counters alone."""
    from torch.nn.modules.batchnorm import _NormBase

    after = dict(layer.named_buffers())
    changed = [key for key, (buf, version) in before.items()
               if after.get(key) is not buf or buf._version != version]
    changed += [f"{path}.{key}".lstrip(".") for path, module in layer.named_modules()
                if isinstance(module, _NormBase) and module.track_running_stats
                for key in ("running_mean", "running_var") if getattr(module, key, None) is not None]
    if not changed:
        return
    raise FactoryError("model.factory", (
        f"model factory {factory!r}: layer {index} ({name}) updates its buffer(s) "
        f"{', '.join(sorted(set(changed)))} in training (running statistics, as BatchNorm keeps): each pipeline "
        f"would update its own copy from its own samples, so the result would depend on the plan; use a "
        f"normalisation without running statistics and within each sample (LayerNorm, GroupNorm, RMSNorm)"))


def _random_modules(layer: nn.Module) -> list[str]:
    """The submodules of `layer` that draw random numbers in training: dropout with p > 0, and
    attention modules with dropout."""
    from torch import nn

    found = []
    for path, module in layer.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(path)
        elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            found.append(path)
    return found


def check_stage_widths(model: ModelDef, max_stage_devices: int) -> None:
    """FactoryError (key cluster.max_stage_devices) when the model has random layers and the planner may
    give a stage more than one worker: the engine's per-microbatch draws (engine/layer_rng.py) cannot be
    split between a stage's workers."""
    random = getattr(model, "random_layers", ())
    if random and max_stage_devices > 1:
        names = model.layer_keys()
        raise FactoryError("cluster.max_stage_devices", (
            f"the model's layer(s) {', '.join(names[i] for i in random)} use dropout: a stage of several "
            f"workers gives each a slice of a microbatch, whose random draws would depend on the plan; set "
            f"cluster.max_stage_devices to 1 (got {max_stage_devices}), or dropout to 0"))


def load_factory(path: str) -> Callable[..., Any]:
    """The callable named "package.module:function", or FactoryError saying why not."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError("model.factory", f"model factory {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        hint = "; is its folder on PYTHONPATH (the workers inherit it)?" if isinstance(e, ModuleNotFoundError) else ""
        raise FactoryError("model.factory", f"model factory {path!r} cannot be loaded: {e}{hint}") from e
    if not callable(fn):
        raise FactoryError("model.factory", f"model factory {path!r} is not callable")
    return fn


def _named(factory: str, built: Any, call: str) -> tuple[list[str], list[Any]]:
    from torch import nn

    if isinstance(built, dict):
        names, layers = [str(k) for k in built], list(built.values())
    elif isinstance(built, (list, tuple)):
        width = max(2, len(str(len(built) - 1)))
        names, layers = [f"layer.{i:0{width}d}" for i in range(len(built))], list(built)
    else:
        layers = None
    if layers is None or not all(isinstance(m, nn.Module) for m in layers):
        raise FactoryError("model.factory", f"model factory {factory!r} must return a list (or a dict by name) "
                           f"of torch.nn.Module, got {_describe(built)} from {call}")
    return names, layers


def _checked(factory: str, built: Any, start: int, stop: int) -> list[nn.Module]:
    names, layers = _named(factory, built, f"f(seed, {start}, {stop})")
    if len(layers) != stop - start:
        raise FactoryError("model.factory", (
            f"model factory {factory!r} returned {len(layers)} layer(s) for layers [{start}, {stop}): a factory "
            f"returns exactly layers [start, stop) of its model"))
    return layers


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        kinds = sorted({type(v).__name__ for v in items})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__
