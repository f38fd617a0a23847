"""The typed values of the job's TCPStore: each JSON-valued key of keys.py with its record type.

A record class names its key (`KEY`, a builder from keys.py), so a value is written and read only as
its type: `put(store, record, *key_args)` and `get(store, Record, *key_args)`, which checks the value
field by field (typed.py) and raises ProtocolError naming the key and the field, as control messages
are checked. Counters and bare integers (`current_gen`, `gen{g}/progress`, `worker/{w}/step`,
`gen{g}/errors`) stay plain strings, read with `get_int`.

    gen{g}/config           GenerationConfig   what every member of g runs, or that the job stops
    gen{g}/failed           Failed             leave g now: who was lost or joined, and why
    gen{g}/report/{worker}  WorkerReport       a worker's step and valid layers after leaving g
    gen{g}/rebuilt/{worker} Rebuilt            its group-build and copy seconds and bytes
    gen{g}/compute          StepCompute        the last step's compute seconds per rank (stragglers)
    gen{g}/first_step       FirstStep          g's first completed step and its time
    gen{g}/error/{worker}   WorkerError        a collective error a worker saw in g
    gen{g}/oom/{worker}     OutOfMemory        the worker ran out of device memory in g, doing what
    gen{g}/loss_spikes/{worker} LossSpikeStop  training.loss_spike stopped the worker in g, and why
    gen{g}/mismatch         ReplicaMismatch    replicas disagreed at a check: the nodes to evict
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from oobleck_slurm.cluster import durable
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.typed import decode, encode
from oobleck_slurm.protocol.wire import ProtocolError


@dataclass(frozen=True, kw_only=True)
class Record:
    """Base of the store's record types: `KEY(*args)` is the key a record of this type lives under."""

    KEY: ClassVar[Callable[..., str]]


R = TypeVar("R", bound=Record)


@dataclass(frozen=True, kw_only=True)
class CheckpointRef:
    root: str
    step: int


@dataclass(frozen=True, kw_only=True)
class GenerationConfig(Record):
    """What every member of generation `generation` runs: its members (node ids in rank order), the
    ExecPlan (JSON), the layer copies [(layer, src rank, dst rank)], the step to resume at and where
    the layers come from ('seed', 'checkpoint' with `checkpoint`, 'memory'); or `stop` (after writing
    the checkpoint `save`)."""

    KEY = staticmethod(keys.config)
    generation: int
    members: tuple[str, ...] = ()
    plan: dict[str, Any] | None = None  # checked by ExecPlan.from_json
    transfers: tuple[tuple[int, int, int], ...] = ()
    resume_step: int = 0
    source: str = "seed"
    checkpoint: CheckpointRef | None = None
    stop: bool = False
    save: CheckpointRef | None = None


@dataclass(frozen=True, kw_only=True)
class Failed(Record):
    KEY = staticmethod(keys.failed)
    lost: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()
    cause: str


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One finished step, as rank 0 logs it (`event`) and as a survivor reports it."""

    step: int
    loss: float  # mean loss over the global batch
    grad_norm: float  # global norm before clipping
    lr: float
    seconds: float  # this rank's wall time for the step
    pipeline_seconds: tuple[float, ...] = ()  # per pipeline: its first stage's schedule time
    compute_seconds: tuple[float, ...] = ()  # per rank: forward/backward only
    peak_memory: tuple[float, ...] = ()  # per rank: peak bytes allocated on its GPU during the step
    data_s: float = 0.0  # the longest any rank's training loop waited for its samples (engine/prefetch.py)
    skipped: bool = False  # no rank applied the update (engine/worker.py complete_step); `skip_reason` says why
    skip_reason: str | None = None  # "non_finite" (gradient norm or loss) | "loss_spike" (training.loss_spike)
    loss_threshold: float | None = None  # the loss-spike policy's bar for this step (None: off or warming up)
    # Throughput (planning/flops.py): tokens of the global batch, ranks that trained (spares excluded),
    # the step's model FLOPs (0: unknown, a factory model) and one device's peak FLOP/s (0: unknown, a CPU)
    tokens: int = 0
    devices: int = 0
    flops: float = 0.0
    peak_flops: float = 0.0

    def throughput(self) -> dict[str, float | int]:
        """tokens/s, per device, achieved TFLOP/s per device and MFU: those the step's figures allow."""
        if self.seconds <= 0 or self.tokens <= 0 or self.devices <= 0:
            return {}
        out: dict[str, float | int] = {"tokens_per_s": self.tokens / self.seconds, "devices": self.devices,
                                       "tokens_per_s_per_device": self.tokens / self.seconds / self.devices}
        if self.flops > 0:
            per_device = self.flops / self.seconds / self.devices
            out["tflops_per_device"] = per_device / 1e12
            if self.peak_flops > 0:
                out["mfu"] = per_device / self.peak_flops
        return out

    def event(self, generation: int, global_batch_size: int) -> dict[str, Any]:
        """The `step` event rank 0 writes to the job's log."""
        return {
            "step": self.step, "loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr,
            "seconds": self.seconds,
            "samples_per_s": global_batch_size / self.seconds if self.seconds > 0 else 0.0,
            "pipeline_seconds": list(self.pipeline_seconds), "compute_seconds": list(self.compute_seconds),
            "peak_memory": list(self.peak_memory), "data_s": self.data_s, "generation": generation,
            **({"skipped": True, "skip_reason": self.skip_reason} if self.skipped else {}),
            **({"loss_threshold": self.loss_threshold} if self.loss_threshold is not None else {}),
            **self.throughput(),
        }


@dataclass(frozen=True, kw_only=True)
class LastStep:
    """The last step a worker completed, with what its `step` event needs."""

    result: StepResult
    generation: int
    global_batch_size: int


@dataclass(frozen=True, kw_only=True)
class WorkerReport(Record):
    """A worker after leaving a generation: its step, the layers it holds valid, whether it can complete
    a step that some ranks applied (engine/recovery.py), and its last completed step."""

    KEY = staticmethod(keys.report)
    step: int
    layers: tuple[int, ...] = ()
    completable: bool = False
    last_step: LastStep | None = None
    # (layer, width, index) of each layer held as a shard of a stage of `width` workers: the
    # coordinator counts a layer held only where its whole stage reports it (decisions.whole_holders)
    shards: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Rebuilt(Record):
    KEY = staticmethod(keys.rebuilt)
    groups_s: float
    copy_s: float
    bytes: int
    t: float


@dataclass(frozen=True, kw_only=True)
class StepCompute(Record):
    KEY = staticmethod(keys.step_compute)
    step: int
    compute_seconds: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True)
class FirstStep(Record):
    KEY = staticmethod(keys.first_step)
    step: int
    t: float


@dataclass(frozen=True, kw_only=True)
class WorkerError(Record):
    KEY = staticmethod(keys.error)
    step: int
    error: str
    t: float


@dataclass(frozen=True, kw_only=True)
class OutOfMemory(Record):
    """A worker ran out of device memory in generation g (it exits next): its step, what it was doing
    (`phase`: "adopt:memory", "adopt:checkpoint", "adopt:seed", "groups", "step", "evaluate",
    "checkpoint"), the error, and its device's bytes then (-1 where there is no device: the CPU)."""

    KEY = staticmethod(keys.out_of_memory)
    step: int
    phase: str
    error: str
    allocated: int
    peak: int
    capacity: int
    t: float


@dataclass(frozen=True, kw_only=True)
class LossSpikeStop(Record):
    """training.loss_spike judged `max_consecutive` steps in a row spikes (every rank does, at the same
    step). `on_consecutive: stop`: the worker exits next, and the coordinator stops the job with `message`
    instead of recovering (a replay from memory or a checkpoint would meet the same spikes: the engine is
    exact); `rollback`: the worker waits, and the coordinator rolls back past `spikes` or stops."""

    KEY = staticmethod(keys.loss_spike_stop)
    step: int
    message: str
    t: float
    spikes: tuple[int, ...] = ()  # the steps of the spikes in a row (a rollback skips the data up to the last)


@dataclass(frozen=True, kw_only=True)
class ReplicaMismatch(Record):
    """Replicas of a layer disagreed at the integrity check of `step` (engine/integrity.py), written by
    rank 0 (every rank decided alike): the nodes to evict (`nodes`: those attributed, else every
    holder of a disagreeing pair) and what was seen. The step is withheld on every rank and replayed."""

    KEY = staticmethod(keys.replica_mismatch)
    step: int
    nodes: tuple[str, ...]
    attributed: tuple[int, ...] = ()  # ranks singled out (a majority, or a checksum that changed on a second read)
    unresolved: tuple[int, ...] = ()  # holders of a pair that disagrees steadily: neither can be singled out
    detail: str = ""
    t: float


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """`elastic.json` in the job folder: how a worker reaches the job's store, and the settings every
    worker needs before the first generation (written by the supervisor before any agent starts)."""

    host: str
    port: int
    timeouts: dict[str, float]  # the job's JobTimeouts (timeouts.py), `asdict`: rebuilt with JobTimeouts(**...)
    checkpoint_interval: int = 0
    checkpoint_dir: str | None = None
    workers_per_node: int = 1
    epoch: int = 1  # the supervisor's (lease.py): a higher one means a new supervisor and store took over
    failover_s: float = 0.0  # how long a worker whose store went away waits for a new one (0: it exits)


def read_launch_config(path: Any) -> LaunchConfig:
    """The job folder's elastic.json; ProtocolError naming the file when it is not one (FileNotFoundError
    when there is none)."""
    return decode(LaunchConfig, _read_json(path), str(path))


def write_launch_config(path: Any, config: LaunchConfig) -> None:
    """Replace elastic.json whole and durably: a worker (re)reading it after a takeover sees the old
    supervisor's address or the new one."""
    durable.write_json(path, encode(config))


def _read_json(path: Any) -> Any:
    """A record file's JSON (an open that NFS reports stale is retried); ProtocolError naming the file
    and what is wrong with it when it is empty, truncated or not text."""
    try:
        text = durable.read_text(path)
    except UnicodeDecodeError as err:
        raise ProtocolError(f"{path}: not UTF-8 text (damaged: {err})") from None
    if not text.strip():
        raise ProtocolError(f"{path}: empty (written by a process that crashed before it reached the disk)")
    try:
        return json.loads(text)
    except ValueError as err:
        raise ProtocolError(f"{path}: truncated or not JSON ({err})") from None


@dataclass(frozen=True, kw_only=True)
class RecoveryState:
    """A published recovery that has not completed its first step yet."""

    id: int
    generation: int
    t_start: float
    step: int
    started: float
    joined: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SupervisorState:
    """`supervisor_state.json` in the job folder: what the supervisor cannot rebuild from its agents and
    workers, rewritten whole (atomically) whenever it changes: the current generation, its members
    (node ids in rank order), the planner's plan of it, the step it resumed at, the coordinator's
    phase, a recovery in progress, the replacement nodes asked for and not joined yet (id -> when),
    the nodes whose workers finished, and whether any step trained. A supervisor that takes over
    resumes from it and from the workers' reports; `epoch` is the writer's fencing token."""

    epoch: int
    generation: int
    members: tuple[str, ...]
    plan: dict[str, Any]  # planning.instantiate.Plan.to_dict()
    start_step: int
    phase: str
    recovery: RecoveryState | None = None
    pending_joins: dict[str, float] | None = None
    finished: tuple[str, ...] = ()
    trained: bool = False


def read_state(path: Any) -> SupervisorState | None:
    """The job folder's supervisor state, or None before a supervisor wrote one; ProtocolError naming
    the file and the damage when it is empty, truncated or not a state (written durably, so only a crash
    of an older version or of the disk leaves one)."""
    try:
        data = _read_json(path)
    except FileNotFoundError:
        return None
    return decode(SupervisorState, data, str(path))


def write_state(path: Any, state: SupervisorState) -> None:
    """Replace the state file whole and durably (cluster/durable.py): a reader (a supervisor taking
    over, after this one's machine died) sees the old state or the new, never an empty file."""
    durable.write_json(Path(path), encode(state))


def put(store: Any, record: Record, *key_args: Any) -> None:
    """Write `record` under its key (`type(record).KEY(*key_args)`)."""
    store.set(type(record).KEY(*key_args), json.dumps(encode(record)))


def get(store: Any, cls: type[R], *key_args: Any) -> R:
    """The record under `cls.KEY(*key_args)` (it must exist), checked as a `cls`."""
    key = cls.KEY(*key_args)
    return parse(cls, store.get(key), key)


def get_if(store: Any, cls: type[R], *key_args: Any) -> R | None:
    """The record, or None when the key is not set."""
    key = cls.KEY(*key_args)
    return parse(cls, store.get(key), key) if store.check([key]) else None


def parse(cls: type[R], raw: bytes | str, key: str) -> R:
    """A stored value (`raw`, as the store returns it) as a `cls`; ProtocolError naming `key` otherwise."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"store key {key!r}: not JSON ({err})") from err
    return decode(cls, data, f"store key {key!r}", finite=False)


def get_int(store: Any, key: str) -> int | None:
    """A plain integer key (`current_gen`, `gen{g}/progress`, a counter), or None when not set."""
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        return int(raw)
    except ValueError as err:
        raise ProtocolError(f"store key {key!r}: expected an integer, got {raw[:50]!r}") from err
