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
    """A GPT (`gpt`), or a user factory "package.module:function" called as f(seed, start, stop)
    returning layers [start, stop) of a model with the GPT interface: token ids (B, T) in, hidden
    states (B, T, gpt.d_model) between layers, logits (B, T, gpt.vocab_size) out. `gpt` then gives
    the shapes (n_layer + 2 layers) and the factory gives the layers."""

    gpt: GPTConfig
    factory: str | None = None

    @property
    def num_layers(self) -> int:
        return self.gpt.n_layer + 2

    def keys(self) -> list[str]:
        from oobleck_slurm.models.gpt import layer_keys

        return layer_keys(self.gpt)

    def builder(self) -> Callable[[int, int, int], list[Any]]:
        """f(seed, start, stop) -> layers."""
        if self.factory is None:
            from oobleck_slurm.models.gpt import build_layers

            return lambda seed, start, stop: build_layers(self.gpt, seed, start, stop)
        return load_factory(self.factory)


def load_factory(path: str) -> Callable[..., Any]:
    """The callable named "package.module:function", with a clear error if it cannot be found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model factory {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model factory {path!r} cannot be loaded: {e}") from e
    if not callable(fn):
        raise ValueError(f"model factory {path!r} is not callable")
    return fn


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
            model=ModelSpec(GPTConfig(**d["model"]["gpt"]), d["model"].get("factory")),
            data=DataSpec(**d["data"]),
            optim=OptimSpec(**optim),
            train=TrainSpec(**d["train"]),
            backend=d.get("backend", "gloo"),
            extra=d.get("extra", {}),
        )
