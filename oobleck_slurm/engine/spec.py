"""JobSpec: everything a worker process needs to train, as plain JSON (no pickles between processes).

The model, the data, the optimizer and the training settings. The plan is not here: it changes
with every generation and is passed to `Worker.adopt`.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from oobleck_slurm.models.config import GPTConfig

# fp64 is for exactness tests: there, summing the same gradients in another order moves Adam/CAME
# parameters by ~1e-13 instead of ~1e-5 (fp32), so a 1e-5 tolerance separates bugs from rounding.
PRECISIONS = ("fp32", "bf16", "fp64")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT (`gpt`), or a user factory "package.module:function" called as
    f(seed, start, stop, **kwargs) returning layers [start, stop) of a model with the GPT interface:
    token ids (B, T) in, hidden states (B, T, gpt.d_model) between layers, logits
    (B, T, gpt.vocab_size) out. `gpt` then gives the shapes (n_layer + 2 layers) and the factory
    gives the layers; `kwargs` (JSON values, the recipe's model.kwargs) go to every call."""

    gpt: GPTConfig
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.gpt.n_layer + 2

    def keys(self) -> list[str]:
        from oobleck_slurm.models.gpt import layer_keys

        return layer_keys(self.gpt)

    def builder(self) -> Callable[[int, int, int], list[Any]]:
        """f(seed, start, stop) -> layers; a factory's answer is checked (a list of stop - start modules)."""
        if self.factory is None:
            from oobleck_slurm.models.gpt import build_layers

            return lambda seed, start, stop: build_layers(self.gpt, seed, start, stop)
        fn, kwargs = load_factory(self.factory), dict(self.kwargs)

        def build(seed: int, start: int, stop: int) -> list[Any]:
            return self._checked(fn(seed, start, stop, **kwargs), start, stop)

        return build

    def _checked(self, layers: Any, start: int, stop: int) -> list[Any]:
        from torch import nn

        where = f"model factory {self.factory!r}"
        if not isinstance(layers, (list, tuple)) or not all(isinstance(m, nn.Module) for m in layers):
            raise FactoryError("model.factory", f"{where} must return a list of torch.nn.Module, got "
                               f"{_describe_layers(layers)} for layers [{start}, {stop})")
        if len(layers) != stop - start:
            raise FactoryError("model.n_layer", (
                f"{where} returned {len(layers)} layer(s) for layers [{start}, {stop}); the recipe's shape "
                f"has {self.num_layers} layers (model.n_layer {self.gpt.n_layer} blocks + the embedding "
                f"and the head): set model.n_layer to the factory's layer count minus 2"))
        return list(layers)

    def check_factory(self, seed: int = 0) -> FactoryError | None:
        """Build the factory's whole model on the meta device (no memory, no initialisation cost) and
        push a (1, seq_len) batch of token ids through it: the problem that a job would hit (an import
        error, a wrong return type, a layer count that is not n_layer + 2, an activation of the wrong
        shape), or None. A forward that cannot run on the meta device is not judged here."""
        if self.factory is None:
            return None
        n, g = self.num_layers, self.gpt
        try:
            fn = load_factory(self.factory)
        except ValueError as err:
            return FactoryError("model.factory", str(err))
        except Exception as err:  # the module itself fails to import (a syntax error, a NameError, ...)
            return FactoryError("model.factory", f"model factory {self.factory!r} cannot be loaded: "
                                f"importing it raised {type(err).__name__}: {err}")
        try:
            with torch.device("meta"):
                layers = self._checked(fn(seed, 0, n, **self.kwargs), 0, n)
        except FactoryError as err:
            return err
        except Exception as err:  # the user's code: report it as bad input, not a traceback
            key = "model.kwargs" if self.kwargs and isinstance(err, TypeError) else "model.factory"
            return FactoryError(key, f"model factory {self.factory!r}: calling f(seed, 0, {n}"
                                f"{', **model.kwargs' if self.kwargs else ''}) raised {type(err).__name__}: {err}")
        try:  # a factory whose model is longer than n layers gives layers past the end
            with torch.device("meta"):
                extra = fn(seed, n, n + 1, **self.kwargs)
        except Exception:  # refusing a range past the end is right
            extra = []
        if isinstance(extra, (list, tuple)) and len(extra) > 0:
            return FactoryError("model.n_layer", (
                f"model factory {self.factory!r} gave {len(extra)} layer(s) for layers [{n}, {n + 1}), past the "
                f"recipe's {n} layers (model.n_layer {g.n_layer} blocks + the embedding and the head): set "
                f"model.n_layer to the factory's layer count minus 2 (and build only layers [start, stop))"))
        x = torch.zeros(1, g.seq_len, dtype=torch.long, device="meta")
        for index, layer in enumerate(layers):
            try:
                with torch.no_grad():
                    x = layer(x)
            except Exception:  # an operation the meta device lacks: the job will tell
                return None
            last = index == n - 1
            want = (1, g.seq_len, g.vocab_size if last else g.d_model)
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
            if shape != want:
                what = "logits (B, T, model.vocab_size)" if last else "hidden states (B, T, model.d_model)"
                got = f"shape {shape}" if shape is not None else type(x).__name__
                key = "model.vocab_size" if last else "model.d_model" if index == 0 else "model.factory"
                return FactoryError(key, (
                    f"model factory {self.factory!r}: layer {index} of {n} must output {what} = {want} for "
                    f"token ids of shape (1, {g.seq_len}), got {got}"))
        return None


class FactoryError(ValueError):
    """A user's model factory does not fit the job: `key` is the recipe key to fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def load_factory(path: str) -> Callable[..., Any]:
    """The callable named "package.module:function", with a clear error if it cannot be found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model factory {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        hint = "; is its folder on PYTHONPATH (the workers inherit it)?" if isinstance(e, ModuleNotFoundError) else ""
        raise ValueError(f"model factory {path!r} cannot be loaded: {e}{hint}") from e
    if not callable(fn):
        raise ValueError(f"model factory {path!r} is not callable")
    return fn


def _describe_layers(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__


@dataclass(frozen=True)
class DataSpec:
    """`tokens`: a prepared token file at `path` (see oobleck_slurm.data); `random`: `num_samples`
    uniformly random sequences generated from `seed` (tests and benchmarks without I/O)."""

    kind: str = "tokens"
    path: str | None = None
    num_samples: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("tokens", "random"):
            raise ValueError(f"data: kind must be 'tokens' or 'random', got {self.kind!r}")
        if self.kind == "tokens" and not self.path:
            raise ValueError("data: kind 'tokens' needs a path to a prepared token file")
        if self.kind == "random" and self.num_samples < 1:
            raise ValueError(f"data: kind 'random' needs num_samples >= 1, got {self.num_samples}")


@dataclass(frozen=True)
class OptimSpec:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, ...] | None = None
    eps: float | tuple[float, ...] | None = None


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    microbatch_size: int
    num_microbatches: int  # global batch = num_microbatches * microbatch_size samples
    seed: int = 0  # model init and sampler
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    warmup_steps: int = 0
    decay: str = "cosine"
    min_lr: float = 0.0
    precision: str = "fp32"  # bf16: autocast on CUDA only (fp32 on CPU); fp64: parameters in float64

    def __post_init__(self) -> None:
        for name in ("steps", "microbatch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"training: {name} must be >= 1, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"training: precision must be one of {PRECISIONS}, got {self.precision!r}")

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float64 if self.precision == "fp64" else torch.float32

    @property
    def global_batch_size(self) -> int:
        return self.num_microbatches * self.microbatch_size


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec
    data: DataSpec
    optim: OptimSpec
    train: TrainSpec
    backend: str = "gloo"  # "nccl": one CUDA device per worker
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> JobSpec:
        d = json.loads(text)
        optim = d["optim"]
        for k in ("betas", "eps"):
            if isinstance(optim.get(k), list):
                optim[k] = tuple(optim[k])
        return JobSpec(
            model=ModelSpec(GPTConfig(**d["model"]["gpt"]), d["model"].get("factory"), d["model"].get("kwargs") or {}),
            data=DataSpec(**d["data"]),
            optim=OptimSpec(**optim),
            train=TrainSpec(**d["train"]),
            backend=d.get("backend", "gloo"),
            extra=d.get("extra", {}),
        )
