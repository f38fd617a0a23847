"""The recipe schema: typed, immutable sections with defaults for everything optional.

Each field may carry `metadata={"check": fn}`; `fn(value)` returns an error message or None. Checks
that involve several fields live in `validate.cross_checks`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from oobleck_slurm.models import PRESETS, FactoryModel, ModelDef, preset
from oobleck_slurm.models.base import plain_json

_FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_SLURM_TIME = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2})$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")
# A job's name starts its folder name and its Slurm job name: no path separators, spaces or markup.
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
MAX_NAME_CHARS = 100  # job folder names stay well under NAME_MAX (255) with the timestamp added
MAX_NODES = 100_000  # above the largest machines (Frontier: 9,408 nodes); lists of node names are built
# Options the submitter sets itself from other keys; setting them twice would silently conflict.
RESERVED_SBATCH = {
    "nodes": "cluster.nodes", "time": "cluster.time", "partition": "cluster.partition",
    "account": "cluster.account", "qos": "cluster.qos", "constraint": "cluster.constraint",
    "gpus-per-node": "cluster.gpus_per_node", "cpus-per-task": "cluster.cpus_per_node",
    "no-kill": "(always set)", "ntasks-per-node": "(always 1: one agent per node)",
    "network": "cluster.network", "signal": "cluster.signal_delay_s",
    "requeue": "(always set on the allocation)", "no-requeue": "cluster.requeues (0: never requeued)",
}
# Slurm's --network word for a VNI that every step of the job shares (switch/hpe_slingshot).
JOB_VNI = "job_vni"
# sbatch(1) --signal: "sig_time must be an integer between 0 and 65535".
MAX_SIGNAL_DELAY_S = 65535
# Slurm's --network value: comma-separated words or key=value pairs (job_vni, single_node_vni, tcs=A:B).
_NETWORK = re.compile(r"^[A-Za-z0-9_]+(=[A-Za-z0-9_:]+)?(,[A-Za-z0-9_]+(=[A-Za-z0-9_:]+)?)*$")


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be > 0, got {value}"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value}"


def cost_share(value: float) -> str | None:
    return None if 0 <= value < 1 else f"must be a share of a step's time in [0, 1) (0: no bound), got {value}"


def factory_string(value: str | None) -> str | None:
    if value is None or _FACTORY.match(value):
        return None
    return f"expected 'package.module:function', got {value!r}"


def slurm_seconds(text: str) -> int:
    """Seconds in a Slurm time limit ('90' minutes, 'M:S', 'H:M:S', 'D-H', 'D-H:M', 'D-H:M:S'), as
    sbatch(1) --time reads them; `text` passed `slurm_time`."""
    days, _, clock = text.partition("-") if "-" in text else ("0", "", text)
    parts = [int(p) for p in clock.split(":")]
    if "-" in text:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # M or M:S
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def slurm_time(value: str) -> str | None:
    if _SLURM_TIME.match(value):
        return None
    return f"expected a Slurm time limit such as '90', '04:00:00' or '1-12:00:00', got {value!r}"


def sbatch_options(value: Mapping[str, str]) -> str | None:
    for key, option in value.items():
        if not _SBATCH_KEY.match(key):
            return f"option {key!r} is not an sbatch long option name (e.g. 'mail-type', without '--')"
        reserved = key.replace("_", "-")  # submitit writes `no_kill` as --no-kill
        if reserved in RESERVED_SBATCH:
            return f"option {key!r} is set by oobleck-slurm; use {RESERVED_SBATCH[reserved]} instead"
        if isinstance(option, str) and ("\n" in option or "\r" in option):  # one #SBATCH line each
            return f"option {key!r}: the value must be one line, got {option!r}"
    return None


def network_option(value: str) -> str | None:
    if _NETWORK.match(value):
        return None
    return f"expected Slurm's --network value, e.g. 'single_node_vni,job_vni', got {value!r}"


def signal_delay(value: int) -> str | None:
    if 0 < value <= MAX_SIGNAL_DELAY_S:
        return None
    return f"must be between 1 and {MAX_SIGNAL_DELAY_S} seconds (sbatch --signal), got {value}"


def job_name(value: str) -> str | None:
    if len(value) > MAX_NAME_CHARS:
        return f"at most {MAX_NAME_CHARS} characters, got {len(value)}"
    if _JOB_NAME.match(value):
        return None
    return f"expected letters, digits, '.', '_', '+' or '-' (it names the job folder), got {value!r}"


def node_count(value: int) -> str | None:
    return positive(value) or (None if value <= MAX_NODES else f"must be at most {MAX_NODES}, got {value}")


def json_values(value: Mapping[str, Any]) -> str | None:
    """Factory kwargs travel to every worker as JSON: only JSON's own types (no dates, bytes, sets)."""
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in value.items()]
    while stack:
        key, item = stack.pop()
        if isinstance(item, dict):
            stack += [(f"{key}.{k}", v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            stack += [(f"{key}[{i}]", v) for i, v in enumerate(item)]
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{key}: JSON has no {item!r}"
        elif item is not None and not isinstance(item, (str, int, float, bool)):
            return f"{key}: expected a JSON value (text, number, true/false, list, mapping), got {type(item).__name__}"
    return None


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
_UNIT = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: str) -> int:
    """'40GB', '80GiB', '512MiB', '2MB' -> bytes (ValueError otherwise)."""
    match = _BYTES.match(value)
    if not match:
        raise ValueError(f"expected a size such as '40GB', '80GiB' or '512MiB', got {value!r}")
    return int(float(match.group(1)) * _UNIT[match.group(2).upper()])


def byte_size(value: str) -> str | None:
    try:
        return None if parse_bytes(value) > 0 else f"must be > 0, got {value!r}"
    except ValueError as err:
        return str(err)


def optional(fn: Any) -> Any:
    """A check that lets None through (None means 'use the default')."""
    return lambda value: None if value is None else fn(value)


def check(fn: Any) -> dict[str, Any]:
    return {"check": fn}


@dataclass(frozen=True)
class SupervisorConfig:
    """The supervisors under Slurm (docs/failover.md, "Under Slurm"). `standby` (the default): a standby
    supervisor runs inside the allocation, as an `srun --overlap` step on a node other than the batch
    host, and takes over from the replicas in memory if the batch host is lost. With `failover`, the
    primary and a standby each run as the batch step of their own small one-node job (not exclusive:
    they may share a node), and every training node is its own one-node job whose batch step is its
    agent. The local backend always runs a standby."""

    standby: bool = True
    failover: bool = False
    partition: str | None = None  # default: cluster.partition
    cpus: int = field(default=1, metadata=check(positive))
    mem: str | None = None  # default: Slurm's


@dataclass(frozen=True)
class ClusterConfig:
    """Where the job runs: a real Slurm allocation or virtual nodes as local processes."""

    backend: Literal["local", "slurm"] = "local"
    nodes: int = field(default=4, metadata=check(node_count))
    gpus_per_node: int = field(default=0, metadata=check(non_negative))
    cpus_per_node: int = field(default=1, metadata=check(positive))
    # Worker processes per node: one per GPU; on CPU-only nodes as many as given (default 1), each
    # with cpus_per_node // workers_per_node threads.
    workers_per_node: int | None = field(default=None, metadata=check(optional(positive)))
    # The planner's memory budget per device (worker), instead of the profiled device's: headroom on
    # GPUs, or a GPU's constraint reproduced on CPU virtual nodes (pipelines then span nodes).
    memory_per_device: str | None = field(default=None, metadata=check(optional(byte_size)))
    spare_nodes: int = field(default=0, metadata=check(lambda v: non_negative(v) or (
        None if v <= MAX_NODES else f"must be at most {MAX_NODES}, got {v}")))
    # Plan pipelines on every node (none left idle as a spare, even where the planner predicts that a
    # spare costs nothing): the embedded default's heterogeneous pipelines.
    use_all_nodes: bool = False
    # Devices one pipeline stage may span inside a node, its layers' state sharded across them
    # (planning/cost.py, engine/shard.py); a divisor of the devices per node and of the microbatch size.
    # Unset: every GPU of the node, the planner choosing each stage's width (a power of two that divides
    # the microbatch size); 1 on CPU workers, and for a model factory's layers, which may draw random
    # numbers that a wide stage would split (`stage_devices`).
    max_stage_devices: int | None = field(default=None, metadata=check(optional(positive)))
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str = field(default="01:00:00", metadata=check(slurm_time))
    mem: str | None = None
    sbatch: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), metadata=check(sbatch_options))
    # Slurm's --network for the allocation and every agent step (srun): on HPE Slingshot
    # "single_node_vni,job_vni", so that agents started as separate one-node steps share the job's VNI
    # (docs/slurm.md, "One network domain per job").
    network: str | None = field(default=None, metadata=check(optional(network_option)))
    # Requeues after a time limit (submitit's max_num_timeout; a preemption does not count one): each
    # resumes from the on-demand checkpoint, so a run longer than `time` is a chain of allocations.
    requeues: int = field(default=1000, metadata=check(non_negative))
    # Seconds before the time limit that Slurm's USR2 notice comes (sbatch --signal=USR2@N): the
    # on-demand checkpoint and the teardown must fit in them.
    signal_delay_s: int = field(default=120, metadata=check(signal_delay))
    # The longest time limit the centre grants a job of this size (a partition's MaxTime, a walltime
    # bin): a centre recipe declares it, and `time` may not exceed it.
    max_time: str | None = field(default=None, metadata=check(optional(slurm_time)))
    setup: tuple[str, ...] = ()  # shell lines run before the agents start (module load ..., conda activate ...)
    job_root: str = "jobs"
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    @property
    def devices_per_node(self) -> int:
        """Workers (devices) per node: workers_per_node, else one per GPU, else 1."""
        return self.workers_per_node or self.gpus_per_node or 1

    def stage_devices(self, factory_model: bool = False) -> int:
        """The bound the planner works with (`max_stage_devices`, or its default when unset)."""
        if self.max_stage_devices is not None:
            return self.max_stage_devices
        return 1 if factory_model else max(1, self.gpus_per_node)

    @property
    def threads_per_worker(self) -> int:
        """CPU threads each worker may use, so that a node's workers do not oversubscribe its cores."""
        return max(1, self.cpus_per_node // self.devices_per_node)


# The shape keys each built-in family takes beside `size` (the preset's fields they override).
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "gpt": ("n_layer", "d_model", "n_head", "seq_len", "vocab_size"),
    "llama": ("n_layer", "d_model", "n_head", "n_kv_heads", "ffn_dim", "rope_theta", "seq_len", "vocab_size"),
}
ALL_SHAPE_KEYS = tuple(dict.fromkeys(k for keys in SHAPE_KEYS.values() for k in keys))
HF_DEFAULT_SEQ_LEN = 2048  # a Hugging Face model's training sequence length unless model.seq_len is set


@dataclass(frozen=True)
class ModelConfig:
    """The model: a built-in `family` at a `size` with optional shape overrides; or a Hugging Face
    folder `hf` (config.json, and optionally safetensors weights to start from); or a user `factory`
    called as f(seed, start, stop, **kwargs) (see `models.factory`), with `seq_len` and `vocab_size`
    giving its data's shape."""

    family: Literal["gpt", "llama"] = "gpt"
    size: str = "tiny"
    n_layer: int | None = field(default=None, metadata=check(optional(positive)))
    d_model: int | None = field(default=None, metadata=check(optional(positive)))
    n_head: int | None = field(default=None, metadata=check(optional(positive)))
    n_kv_heads: int | None = field(default=None, metadata=check(optional(positive)))
    ffn_dim: int | None = field(default=None, metadata=check(optional(positive)))
    rope_theta: float | None = field(default=None, metadata=check(optional(positive)))
    seq_len: int | None = field(default=None, metadata=check(optional(positive)))
    vocab_size: int | None = field(default=None, metadata=check(optional(positive)))
    hf: str | None = None
    factory: str | None = field(default=None, metadata=check(factory_string))
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), metadata=check(json_values))

    def overrides(self) -> dict[str, Any]:
        """The shape keys this recipe sets."""
        return {name: getattr(self, name) for name in ALL_SHAPE_KEYS if getattr(self, name) is not None}

    def resolve(self) -> ModelDef:
        """The model's definition (pure data: no torch, no user code run; a factory's layers are found
        by `models.inspect_factory`). Raises ValueError (models.hf.HFError for a folder) when it
        cannot be made; `validate.cross_checks` reports those as recipe issues first."""
        if self.hf is not None:
            from oobleck_slurm.models.hf import model_from_hf

            longest = model_from_hf(self.hf).seq_len  # max_position_embeddings
            return model_from_hf(self.hf, seq_len=self.seq_len or min(HF_DEFAULT_SEQ_LEN, longest))
        if self.factory is not None:
            base = PRESETS["gpt"]["tiny"]
            return FactoryModel(self.factory, seq_len=self.seq_len or base.seq_len,
                                vocab_size=self.vocab_size or base.vocab_size, kwargs=plain_json(self.kwargs))
        return preset(self.family, self.size, **self.overrides())


@dataclass(frozen=True)
class SourceConfig:
    """One data source of a mixture: a prepared token file, a glob of them, or a prepared set (a
    folder or glob of .idx/.bin shards); `weight`: its share of the samples (relative; unset: in
    proportion to its size)."""

    path: str = ""
    weight: float | None = field(default=None, metadata=check(optional(positive)))


@dataclass(frozen=True)
class DataConfig:
    """Training tokens: a prepared token file, a text file prepared on first use, several weighted
    sources, or (local jobs only) the shipped text."""

    path: str | None = None
    text: str | None = None
    tokenizer: str = "byte"
    # What `training.eval_interval` evaluates on: a prepared token file (.bin) or a text file (prepared
    # with `tokenizer` on first use). Unset: the last `training.eval_samples` samples of the training
    # tokens, held out of training (of each source, apportioned by weight).
    validation: str | None = None
    sources: tuple[SourceConfig, ...] = ()  # instead of path/text: a deterministic weighted mixture
    # The most passes over any source the job's steps may make; a job that would make more is refused
    # at its start. Unset: no limit (a small source is repeated as often as its weight needs).
    epochs: int | None = field(default=None, metadata=check(optional(positive)))
    # Each worker reads the next step's samples while a step trains (docs/data.md, "Reads off the critical
    # path"); false: each step reads its own at its start, on the training loop's time (to measure it).
    prefetch: bool = True
    # Document masking (docs/data.md, "Document masking"): attention only within each document of a
    # window and positions restarting at each; the end-of-document id is found in the data, or `eos_id`.
    document_mask: bool = False
    eos_id: int | None = field(default=None, metadata=check(optional(non_negative)))


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "came"] = "adamw"
    lr: float = field(default=3e-4, metadata=check(positive))
    weight_decay: float = field(default=0.0, metadata=check(non_negative))
    betas: tuple[float, ...] | None = None  # adamw: 2 values, came: 3
    eps: tuple[float, ...] | None = None  # adamw: 1 value, came: 2


@dataclass(frozen=True)
class LRScheduleConfig:
    warmup_steps: int = field(default=0, metadata=check(non_negative))
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = field(default=0.0, metadata=check(non_negative))


def at_least_two(value: int) -> str | None:
    return None if value >= 2 else f"must be >= 2 (a standard deviation needs two losses), got {value}"


@dataclass(frozen=True)
class LossSpikeConfig:
    """`training.loss_spike` (docs/engine.md, numerical guards): a step whose loss exceeds the mean of
    the last `window` accepted losses by more than `sigma` of their standard deviation, once `warmup`
    losses were accepted, is skipped by every rank. `max_consecutive` spikes in a row: `on_consecutive:
    rollback` restarts every worker from the newest complete checkpoint at or before the first of them
    and skips the samples from there to the last spike's (the engine is exact: the same data would spike
    again), at most `max_rollbacks` times in a job, and stops without such a checkpoint; `stop` stops
    the job, naming the steps and the newest complete checkpoint. Absent: off."""

    sigma: float = field(default=6.0, metadata=check(positive))
    window: int = field(default=100, metadata=check(at_least_two))
    warmup: int = field(default=100, metadata=check(at_least_two))  # accepted losses before any is judged
    max_consecutive: int = field(default=5, metadata=check(positive))
    on_consecutive: Literal["rollback", "stop"] = "rollback"
    max_rollbacks: int = field(default=3, metadata=check(positive))


@dataclass(frozen=True)
class TrainingConfig:
    global_batch_size: int = field(default=32, metadata=check(positive))
    microbatch_size: int = field(default=4, metadata=check(positive))
    steps: int = field(default=100, metadata=check(positive))
    seed: int = 0
    # fp64: for exactness checks (reordering noise ~1e-13); bf16: autocast on GPUs, fp32 master weights
    precision: Literal["fp32", "bf16", "fp64"] = "fp32"
    grad_clip: float = field(default=1.0, metadata=check(non_negative))  # 0 disables clipping
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    # The validation loss every `eval_interval` steps and at the end (0: never), over `eval_samples`
    # samples of `data.validation`.
    eval_interval: int = field(default=0, metadata=check(non_negative))
    # Activation recomputation: each layer's activations are recomputed in the backward instead of kept,
    # so a stage holds only its layers' inputs per microbatch in flight, for about a third more compute
    # (what makes a 70B model fit without tensor parallelism).
    recompute: bool = False
    eval_samples: int = field(default=64, metadata=check(positive))
    # Deterministic kernels on GPUs (torch.use_deterministic_algorithms, cuBLAS's fixed workspace): two
    # runs, or a recovered run and an uninterrupted one, then agree bitwise, for some speed; a kernel
    # with no deterministic version stops the job with torch's error naming it. CPUs are deterministic.
    deterministic: bool = False
    # Sharded stages that keep their layers gathered: consecutive layers go as one all-gather and one
    # reduce-scatter up to this many MB of full-size buffers (as DDP's bucket_cap_mb); a larger layer
    # goes alone. Fewer, larger collectives cost less; smaller ones start sooner.
    bucket_mb: float = field(default=25.0, metadata=check(positive))
    # Loss-spike skipping (LossSpikeConfig); absent or null: off. `loss_spike: {}` turns it on with its defaults.
    loss_spike: LossSpikeConfig | None = None

    @property
    def global_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size


@dataclass(frozen=True)
class FaultToleranceConfig:
    """How many failures to survive and how fast to notice them (seconds).

    The timeouts must nest: collective < heartbeat lease < step < reconfiguration, so that a stuck
    collective fails before its node is declared lost, and a recovery is never cut short by a step
    timeout. The lease default is well under the ~10 s that Slurm takes to mark a node DOWN.
    """

    f: int = field(default=1, metadata=check(non_negative))
    heartbeat_interval: float = field(default=0.5, metadata=check(positive))
    heartbeat_lease: float = field(default=3.0, metadata=check(positive))
    collective_timeout: float = field(default=2.0, metadata=check(positive))
    step_timeout: float = field(default=60.0, metadata=check(positive))
    reconfiguration_timeout: float = field(default=120.0, metadata=check(positive))
    replacement: Literal["spare", "request", "none"] = "request"
    checkpoint_interval: int = field(default=100, metadata=check(non_negative))  # steps; 0 = never
    # Compare the replicas' per-layer checksums every this many steps (0: never); a replica that
    # disagrees is evicted and replaced from the others (docs/detection.md, "Replica integrity").
    integrity_interval: int = field(default=1, metadata=check(non_negative))
    # ... further apart where a check's measured time exceeds this share of a step's (0: no bound)
    integrity_max_cost: float = field(default=0.01, metadata=check(cost_share))
    # Complete checkpoints kept in the job folder, newest first; older ones are deleted once a newer one is
    # complete. 0 keeps every one: deleting is the one thing here that cannot be undone, so it is asked for.
    keep_checkpoints: int = field(default=0, metadata=check(non_negative))
    # Another job's checkpoint this job starts from (a job folder: its newest complete one; or one of its
    # step<S> folders): `submit --resume-from` sets it too. Relative to the recipe file.
    resume_from: str = ""


def at_least_three(value: int) -> str | None:
    return None if value >= 3 else f"must be >= 3 (a median of fewer nodes says nothing), got {value}"


def above_one(value: float) -> str | None:
    return None if value > 1 else f"must be > 1 (a ratio to the peers' compute time), got {value}"


def sampling_interval(value: float) -> str | None:
    return None if value >= 0.1 else f"must be >= 0.1 s (samples are stored to the millisecond), got {value}"


def metric_weights(value: Mapping[str, float]) -> str | None:
    for key, weight in value.items():
        if weight < 0:
            return f"weight of {key!r} must be >= 0 (0 switches the metric off), got {weight}"
    return None


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (`logging.wandb`): one run per job, its id kept in JOB/wandb across requeues and
    supervisor takeovers; needs the `wandb` extra."""

    project: str = "oobleck-slurm"
    entity: str | None = None
    # "online", or "offline" (files in JOB/wandb, `wandb sync` them later: compute nodes without internet)
    mode: Literal["online", "offline"] = "online"


@dataclass(frozen=True)
class LoggingConfig:
    """Where the job's metrics go besides its event log (which always holds everything)."""

    # TensorBoard scalars in JOB/tensorboard, written live by the supervisor (dashboard/tensorboard.py);
    # needs the `tensorboard` extra.
    tensorboard: bool = False
    # One device's peak dense TFLOP/s for MFU; unset: the GPU's data-sheet figure (planning/flops.py), and
    # no MFU where none is known (a CPU, an unlisted GPU).
    peak_tflops: float | None = field(default=None, metadata=check(optional(positive)))
    # collectives torch's flight recorder keeps per process group, dumped from every rank on a hang verdict
    # (engine/requests.py); unset: 2000 on GPUs, 0 (off) on CPUs
    flight_recorder: int | None = field(default=None, metadata=check(optional(non_negative)))
    # the same scalars to W&B, from the supervisor (dashboard/wandb_logger.py); null: off
    wandb: WandbConfig | None = None


def fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1] (a fraction of the fleet's median), got {value}"


@dataclass(frozen=True)
class PreflightConfig:
    """The pre-flight check (docs/detection.md "Pre-flight checks"): at the start and before each join
    every node measures a short matmul and its link to the supervisor (and on >= 2 GPUs an intra-node
    all-reduce); a node below `min_fraction` of the fleet's median on any figure is not admitted. With
    fewer than `min_nodes` nodes measured, nodes are admitted and their figures reported."""

    enabled: bool = True
    min_fraction: float = field(default=0.7, metadata=check(fraction))
    min_nodes: int = field(default=3, metadata=check(at_least_three))


@dataclass(frozen=True)
class DetectionConfig:
    """Gray failures from monitoring metrics (Minder-style) and stragglers (MegaScale-style).

    Times in seconds. A machine is flagged when its metrics stay `threshold` spreads away from its
    peers' for `continuity` seconds (after averaging over `window`); see detection/minder.py.
    """

    enabled: bool = True
    interval: float = field(default=1.0, metadata=check(sampling_interval))  # metrics sampling period (every agent)
    window: float = field(default=5.0, metadata=check(positive))  # denoising window
    continuity: float = field(default=1.0, metadata=check(positive))  # how long a deviation must last
    threshold: float = field(default=4.5, metadata=check(positive))  # robust z-score
    grace: float = field(default=10.0, metadata=check(non_negative))  # a newly joined node is not judged
    min_nodes: int = field(default=4, metadata=check(at_least_three))
    priorities: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}),
                                            metadata=check(metric_weights))  # metric -> weight (0 = ignore)
    # Act on a flagged machine like on a lost node (evict, replace); false (default): report it only (a
    # `faulty_node` event, the dashboard's flag). Off by default: the metrics detector has been judged on
    # synthetic traces and on one-host local jobs with two process metrics, never on a real machine's
    # counters or on NVML, and a false alarm evicts a healthy node (docs/detection.md#what-has-been-validated).
    # Hard evidence (a dead process, a lost heartbeat, a hung collective) evicts whatever this says.
    evict: bool = False
    # A straggler's pipeline gets fewer microbatches (rebalance), or it is evicted, or only reported; off:
    # compute times are not watched.
    stragglers: Literal["rebalance", "evict", "report", "off"] = "rebalance"
    straggler_threshold: float = field(default=1.3, metadata=check(above_one))  # slowdown vs peers
    straggler_window: int = field(default=20, metadata=check(positive))  # recent steps per rank
    metrics_max_mb: float = field(default=64.0, metadata=check(positive))  # metrics.csv cap (all rotations)
    # Not switched off by `enabled` (that is the metrics' and the stragglers' switch)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)


@dataclass(frozen=True)
class DrillConfig:
    """A scripted fault: when training reaches `step`, `how` is done to `node` (its worker `worker`),
    exactly as `kill-node` does it: the first run shows a failure, the recovery and the join."""

    step: int = field(default=1, metadata=check(positive))
    node: str = "node2"
    # a killed worker, a killed node agent, a SIGSTOP; "slow": the node keeps working, slower (its workers
    # duty-cycled with SIGSTOP/SIGCONT); "leak": a metric-only fault (the node's memory grows steadily)
    # "supervisor": the supervisor itself is killed (kill -9; `node` is ignored): its standby takes over
    how: Literal["worker", "agent", "hang", "slow", "leak", "supervisor"] = "worker"
    worker: int = field(default=0, metadata=check(non_negative))


@dataclass(frozen=True)
class Recipe:
    """A whole training job. Built only through `load_recipe`, which validates everything."""

    name: str = field(default="job", metadata=check(job_name))
    description: str = ""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    drills: tuple[DrillConfig, ...] = ()  # off with `submit --no-drills`
    source: str = field(default="", metadata={"internal": True})  # the file it was loaded from
