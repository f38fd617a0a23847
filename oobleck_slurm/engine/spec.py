"""JobSpec: everything a worker process needs to train, as plain JSON (no pickles between processes).

The model, the data, the optimizer and the training settings. The plan is not here: it changes
with every generation and is passed to `Worker.adopt`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from oobleck_slurm.engine.loss_spike import SpikePolicy
from oobleck_slurm.models import ModelDef, model_from_dict

# fp64 is for exactness tests: there, summing the same gradients in another order moves Adam/CAME
# parameters by ~1e-13 instead of ~1e-5 (fp32), so a 1e-5 tolerance separates bugs from rounding.
PRECISIONS = ("fp32", "bf16", "fp64")


@dataclass(frozen=True)
class ModelSpec:
    """The model (a `models.ModelDef` of any family), and the Hugging Face folder whose weights it
    starts from instead of the seed's initialisation, if any."""

    config: ModelDef
    weights: str | None = None

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def keys(self) -> list[str]:
        return self.config.layer_keys()

    def build(self, seed: int, start: int, stop: int, device: torch.device | str | None = None,
              initialise: bool = True) -> list[nn.Module]:
        """Layers [start, stop) on `device`, from the seed or, with `weights`, from that folder."""
        layers = self.config.build_layers(seed, start, stop, device=device, initialise=initialise)
        if initialise and self.weights is not None:
            from oobleck_slurm.models.hf import load_layer_weights

            for index, layer in zip(range(start, stop), layers):
                load_layer_weights(self.weights, self.config, index, layer)
        return layers

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "weights": self.weights}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelSpec:
        return ModelSpec(model_from_dict(d["config"]), d.get("weights"))


@dataclass(frozen=True)
class DataSpec:
    """`tokens`: a prepared token file at `path` (see oobleck_slurm.data); `random`: `num_samples`
    uniformly random sequences generated from `seed` (tests and benchmarks without I/O)."""

    kind: str = "tokens"
    path: str | None = None
    num_samples: int = 0
    seed: int = 0
    # Validation: a token file of its own, else the last `holdout` samples of the training data (which
    # then trains on the others).
    validation: str | None = None
    holdout: int = 0
    # Several sources instead of `path`: [path, weight] each (a token file, a glob or a prepared set;
    # weight 0: in proportion to its samples). engine/batches.py opens them, data/mixture.py mixes them.
    sources: tuple[tuple[str, float], ...] = ()
    epochs: int = 0  # the most passes over any source the job's steps may make; 0: no limit
    origin: tuple[int, int] = (0, 0)  # (step, samples consumed) where the sample stream resumed
    identity: dict[str, Any] | None = None  # what checkpoints record of the data (batches.data_identity)
    # A worker reads the next step's samples while a step trains (engine/prefetch.py); off: each step
    # reads its own at its start (the same samples, on the training loop's time: `data_s`)
    prefetch: bool = True
    # Document masking (models/documents.py): attention within each document, positions restarting at
    # each; `eos_id` ends a document (given, or found in the data by engine.batches.prepare_data).
    document_mask: bool = False
    eos_id: int | None = None

    def __post_init__(self) -> None:
        # JSON gives lists back: tuples again, so that a spec equals its own round trip
        object.__setattr__(self, "sources", tuple((str(p), float(w)) for p, w in self.sources))
        object.__setattr__(self, "origin", (int(self.origin[0]), int(self.origin[1])))
        if self.kind not in ("tokens", "random"):
            raise ValueError(f"data: kind must be 'tokens' or 'random', got {self.kind!r}")
        if self.kind == "tokens" and not (self.path or self.sources):
            raise ValueError("data: kind 'tokens' needs a path to a prepared token file, or sources")
        if self.kind == "random" and self.num_samples < 1:
            raise ValueError(f"data: kind 'random' needs num_samples >= 1, got {self.num_samples}")
        if self.eos_id is not None and self.eos_id < 0:
            raise ValueError(f"data: eos_id must be >= 0, got {self.eos_id}")


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
    eval_interval: int = 0  # the validation loss every this many steps and at the end; 0: never
    recompute: bool = False  # activations recomputed in the backward (stage.py)
    eval_samples: int = 0
    deterministic: bool = False  # deterministic CUDA kernels (worker.use_deterministic_kernels)
    bucket_mb: float = 25.0  # kept sharded stages' collectives, consecutive layers up to this (shard.py)
    loss_spike: SpikePolicy | None = None  # skip loss spikes (engine/loss_spike.py); None: off
    integrity_interval: int = 1  # replicas' checksums compared every this many steps at most; 0: never (integrity.py)
    integrity_max_cost: float = 0.01  # checks spaced out further so that they take at most this share of a step

    def __post_init__(self) -> None:
        for name in ("steps", "microbatch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"training: {name} must be >= 1, got {getattr(self, name)}")
        if self.integrity_interval < 0:
            raise ValueError(f"training: integrity_interval must be >= 0, got {self.integrity_interval}")
        if not 0 <= self.integrity_max_cost < 1:
            raise ValueError(f"training: integrity_max_cost must be in [0, 1), got {self.integrity_max_cost}")
        if not self.bucket_mb > 0:
            raise ValueError(f"training: bucket_mb must be > 0, got {self.bucket_mb}")
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
    peak_tflops: float | None = None  # one device's peak for MFU (recipe logging.peak_tflops); None: its GPU's
    flight_recorder: int = 0  # collectives torch's flight recorder keeps (engine/requests.py); 0: off
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> JobSpec:
        d = json.loads(text)
        optim = d["optim"]
        for k in ("betas", "eps"):
            if isinstance(optim.get(k), list):
                optim[k] = tuple(optim[k])
        return JobSpec(
            model=ModelSpec.from_dict(d["model"]),
            data=DataSpec(**d["data"]),
            optim=OptimSpec(**optim),
            train=TrainSpec(**{**d["train"], "loss_spike": SpikePolicy(**spike)
                               if (spike := d["train"].get("loss_spike")) is not None else None}),
            backend=d.get("backend", "gloo"),
            peak_tflops=d.get("peak_tflops"),
            flight_recorder=int(d.get("flight_recorder", 0)),
            extra=d.get("extra", {}),
        )
