"""Worker: one process's part of training, as a small class with explicit state.

State: `step` (the next step to run), `layers` and `optimizers` (by layer index; `keys` names them),
the current `plan` and `gen` (Generation). `adopt(plan, gen, source, ...)` moves a live worker to a
new plan: it takes the layers it now needs from the seed, a checkpoint or their holders in memory
(parameters and optimizer state), drops the ones it no longer needs, and from then on uses the new
generation's groups. `train_step()` runs
one step: 1F1B over this rank's stage, layer-wise gradient all-reduce overlapped with the last
microbatch's backward, global-norm clipping, optimizer step.

Memory: a layer's gradients are views into one flat buffer per layer (`grads`), all-reduced in place,
so a worker holds what a plain training loop holds (parameters, one gradient, optimizer state) and no
copy for fault tolerance: an interrupted step is completed, not undone (`pending`, recovery.py).

Exactness: every microbatch's mean loss is scaled by 1 / (microbatches in the whole step), so the
SUM all-reduce of a layer's gradient over the pipelines holding it is the gradient of the mean loss
over the global batch, for any split of microbatches between pipelines.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from oobleck_slurm.engine.batches import Reads, StepBatches, open_dataset, open_validation
from oobleck_slurm.engine.checkpoint import (
    CheckpointError,
    LayerCopier,
    Snapshot,
    layer_payload,
    live_tensors,
    load_layer,
    persistent_buffers,
    read_data_record,
)
from oobleck_slurm.engine.comm import Generation, step_timeout_waits
from oobleck_slurm.engine.integrity import (
    GroupKey,
    ReplicaMismatchError,
    TransferCorruptError,
    attribute,
    check_due,
    checksum,
    mismatched,
    needs_second_read,
    next_check,
    pack,
    unpack,
)
from oobleck_slurm.engine.layer_optim import clip_coefficient, make_layer_optimizer, set_lr
from oobleck_slurm.engine.layer_rng import LayerDrawError, LayerDraws
from oobleck_slurm.engine.layout import ExecPlan, Role, edge_pieces, pass_slices, reduce_pieces, sample_range
from oobleck_slurm.engine.loss_spike import Judgement, SpikeState, judge
from oobleck_slurm.engine.lr import lr_at
from oobleck_slurm.engine.nccl_order import P2POp
from oobleck_slurm.engine.prefetch import Prefetcher
from oobleck_slurm.engine.schedule import one_f_one_b
from oobleck_slurm.engine.shard import (
    MOMENTS,
    BucketWork,
    FlatViews,
    ShardedLayer,
    StageParams,
    factored_count,
    factored_moves,
    factored_numel,
    flat_state,
    layer_factored,
    layer_views,
    load_flat_state,
    param_spans,
    parts_to_elements,
    piece_range,
    shard_range,
    slice_moves,
    state_layout,
    step_like,
    view_of,
)
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.engine.stage import Stage
from oobleck_slurm.engine.transfer import layer_tensors, run_transfers
from oobleck_slurm.models.documents import Documents, run_layer
from oobleck_slurm.optim import optimizer_state_tensors
from oobleck_slurm.optim.came_sharded import ShardedCAME
from oobleck_slurm.peak_memory import StepPeak
from oobleck_slurm.planning.cost import stage_fold
from oobleck_slurm.planning.flops import flops_per_token, peak_flops
from oobleck_slurm.protocol.records import StepResult
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS


def attach_grad_buffer(layer: nn.Module) -> torch.Tensor:
    """One zeroed flat buffer for the layer's gradients, each parameter's `.grad` a view into it:
    autograd accumulates in place, and the buffer is all-reduced in place (no packing copy)."""
    params = list(layer.parameters())
    if not params:
        return torch.zeros(0)
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def peer(rank: int | None) -> int:
    """A stage's neighbour rank, where the schedule needs one (only the ends lack a neighbour)."""
    if rank is None:
        raise RuntimeError("the schedule sends to or receives from a stage that does not exist")
    return rank


@dataclass(frozen=True)
class FlatHolding:
    """A rank's holding of one layer in flat form (shard.py): its parameters' logical elements from
    `base` on, the optimizer moments over the same elements, the step counter, and CAME's row/column
    statistics (whole; empty for AdamW)."""

    params: torch.Tensor
    moments: dict[str, torch.Tensor]
    step: torch.Tensor
    factored: torch.Tensor
    base: int


@dataclass(frozen=True)
class PendingStep:
    """A step whose every collective this rank finished (its layers' reduced gradients are in `grads`,
    the pipeline's squared gradient norm is `total_sq`): it can be completed without any peer."""

    step: int
    total_sq: float
    loss: float | None = None  # the step's world-summed loss, when the loss-spike policy needs it


SPIKE_SNAPSHOTS = 4  # loss-spike states kept for checkpoints still being written (steps apart by an interval)


@dataclass
class _EvalMicrobatch:
    """A validation microbatch on its way through a stage: its index, samples, hidden state (token ids
    on a first stage), targets (last stage) and documents (document masking)."""

    index: int
    samples: int
    hidden: torch.Tensor
    targets: torch.Tensor | None
    documents: Documents | None


# cuBLAS's deterministic workspace (the CUDA docs' "Results reproducibility"); PyTorch reads it when its
# first cuBLAS handle starts, so it must be set before the process's first matrix product on a GPU.
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def use_deterministic_kernels() -> None:
    """`training.deterministic`: every kernel of this process deterministic from now on. Not warn-only:
    a kernel with only a nondeterministic version raises (naming itself) rather than silently breaking
    the bitwise agreement between a recovered run and an uninterrupted one; cuDNN's attention backward,
    nondeterministic by default, switches to its deterministic algorithm only then."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)


class ComputeClock:
    """A step's forward and backward time: wall time on the CPU; on a GPU, CUDA events around the
    kernels, since the CPU only launches them asynchronously (its own time would be launch time)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cpu_seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self.cpu_seconds += time.perf_counter() - t

    def seconds(self) -> float:
        """The total so far (on a GPU this waits for the last span's kernels)."""
        if not self.events:
            return self.cpu_seconds
        self.events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1000.0


def check_supported(job: JobSpec) -> None:
    """Refuse what the engine cannot train exactly, with the reason."""
    if getattr(job.model.config, "tie_embeddings", False):
        raise NotImplementedError(
            "tie_embeddings=True is not supported by the engine: layers are built and moved one at a "
            "time and the embedding and the head may sit on different stages, so one shared weight "
            "would need its own gradient all-reduce; use tie_embeddings=False (the default)"
        )
    if job.data.document_mask and not job.model.config.supports_document_mask:
        raise NotImplementedError(f"data.document_mask: the {job.model.config.family} family's layers take one "
                                  f"tensor, not a microbatch's documents (models/documents.py): gpt and llama do")


class Worker:
    def __init__(self, job: JobSpec, rank: int, device: torch.device | None = None) -> None:
        check_supported(job)
        if job.train.deterministic:
            use_deterministic_kernels()
        self.job = job
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.peak = StepPeak(self.device)
        # the step event's throughput: model FLOPs per token, and this device's peak (rank 0's stands for
        # all: MFU assumes like devices)
        self.flops_per_token = flops_per_token(job.model.config) or 0.0
        self.peak_flops = peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
                                     job.peak_tflops) or 0.0
        self.keys = job.model.keys()
        self.step = 0
        self.layers: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.skipped = False  # the last completed step's update was skipped (`skip_reason` says why)
        self.skip_reason: str | None = None  # "non_finite" | "loss_spike" | None
        # The loss-spike policy's state (engine/loss_spike.py), the same on every rank; None: off.
        self.spike: SpikeState | None = SpikeState() if job.train.loss_spike is not None else None
        self.judgement: Judgement | None = None  # the last completed step's verdict (None: policy off)
        self.spike_stop: Judgement | None = None  # set once a verdict said stop (max_consecutive spikes)
        self._spike_at: dict[int, SpikeState] = {}  # step -> the state, for that step's checkpoint record
        self.grads: dict[int, torch.Tensor] = {}  # layer -> the flat buffer its parameters' .grad view
        self.shards: dict[int, ShardedLayer] = {}  # layer -> this rank's shard, on a stage wider than one rank
        self.pending: PendingStep | None = None  # a step finished everywhere but not yet applied here
        self.before_update: Callable[[int], None] | None = None  # called before each layer's update (faults)
        self.before_scatter: Callable[[int], None] | None = None  # before each reduce-scatter wait (faults)
        self.loss_factor: Callable[[int], float] | None = None  # scales a step's loss and gradients (faults: a spike)
        self.next_check = 0  # the first step of an integrity check (integrity.next_check; every rank alike)
        self.corrupt_sends = False  # a drill: the next adoption's sends carry a flipped bit (faults.py "corrupt")
        # the last adoption's copies fetched again: (layer, sender, receiver, next holder or None)
        self.refetches: list[tuple[int, int, int, int | None]] = []
        self.plan: ExecPlan | None = None
        self.gen: Generation | None = None
        self.role: Role | None = None
        # periodic checkpoints copy layers off the training path (`snapshot`); `settle_copies` fences them
        self.copier = LayerCopier(self.device)
        self.copy_wait_s = 0.0  # how long the last update waited for a checkpoint's copy (`settle_copies`)
        t = job.train
        dataset = open_dataset(job.data, job.model.seq_len, job.model.vocab_size)
        self.batches = StepBatches(dataset, t.global_batch_size, t.microbatch_size, t.seed,
                                   origin=job.data.origin, identity=job.data.identity)
        self.validation = (open_validation(job.data, job.model.seq_len, job.model.vocab_size, t.eval_samples)
                           if t.eval_interval else None)
        self.reads = self._new_reads()
        # document masking: every stage reads its rows' token ids (engine.batches.prepare_data resolved the eos)
        if job.data.document_mask and job.data.eos_id is None:
            raise ValueError("data.document_mask needs the end-of-document id (DataSpec.eos_id): "
                             "engine.batches.prepare_data finds it in the data")
        self.eos_id = job.data.eos_id if job.data.document_mask else None

    def _documents(self, tokens: torch.Tensor) -> Documents | None:
        """The document structure of input rows `tokens` (document masking), else None."""
        return None if self.eos_id is None else Documents.of(tokens, self.eos_id)

    # ---- reading the samples ------------------------------------------------------------------

    def _new_reads(self) -> Prefetcher[Reads, list[torch.Tensor]]:
        # pinned buffers on a GPU: their non-blocking copy is a DMA in stream order, and the loop goes on
        # at once (a blocking copy waits for every kernel queued before it: the pipeline's work so far)
        pin = self.device.type == "cuda"
        setup = (lambda: torch.cuda.set_device(self.device)) if pin else None  # no context on another GPU
        return Prefetcher(lambda reads: self.batches.read(reads, pin), f"reads-{self.rank}", setup)

    def stop_reads(self, wait: float = DEFAULT_TIMEOUTS.prefetch_stop) -> None:
        """End the reader thread and drop what it read ahead (leaving a generation, or a plan change)."""
        self.reads.stop(wait)
        self.reads = self._new_reads()

    def _step_windows(self, role: Role) -> tuple[list[torch.Tensor], Reads | None]:
        """This step's samples for this rank, one (samples, seq_len + 1) window tensor per pass, on the
        device: the first stage uses their first seq_len tokens (inputs), the last their last seq_len
        (targets), each rank of a wide stage only its slices. Read during the previous step if that
        read was made for this step, plan and slices, else now. Also the next step's reads, to start
        (None: reading ahead is off, or this is the last step)."""
        reads = Reads.of(self.step, self.plan, role, self.job.train.microbatch_size)
        windows = [w.to(self.device, non_blocking=True) for w in self.reads.take(reads)]
        ahead = self.job.data.prefetch and self.step + 1 < self.job.train.steps
        return windows, replace(reads, step=self.step + 1) if ahead else None

    # ---- plan changes -------------------------------------------------------------------------

    def _fresh_layer(self, index: int, initialise: bool = True, role: Role | None = None,
                     checkpoint: tuple[str, int] | None = None) -> int:
        """Layer `index` with a new optimizer and gradient buffer: as the seed makes it, or, when its
        state is about to be received (`initialise=False`), built on the meta device and only then
        allocated on the worker's device, uninitialised (no time spent on an initialisation that the
        copy overwrites). With `checkpoint` (root, step) its state is read from there; returns the
        bytes read. On a stage wider than one rank (`role`) the whole layer is built (or read), then
        this rank keeps its shard (shard.py)."""
        seed, dtype = self.job.train.seed, self.job.train.param_dtype
        layer = self.job.model.build(seed, index, index + 1, device=self.device, initialise=initialise)[0].to(dtype)
        opt = make_layer_optimizer(layer, self.job.optim)
        read = 0
        if checkpoint is not None:
            read = load_layer(checkpoint[0], checkpoint[1], self.keys[index], layer, opt)
        self.layers[index] = layer
        if role is None or role.width == 1:
            self.optimizers[index] = opt
            self.grads[index] = attach_grad_buffer(layer)
            return read
        # read from a checkpoint, `opt` holds the whole layer's state: this rank keeps its shard of it
        whole = flat_state(layer, opt) if checkpoint is not None else None
        sharded = ShardedLayer(layer, role.width, role.index, self.job.optim)
        if whole is not None:
            moments, step, factored = whole
            base, size = sharded.base, sharded.size
            sharded.load_state_shards({k: v[base : base + size] for k, v in moments.items()}, step, factored)
        self.shards[index] = sharded
        self.optimizers[index] = sharded.opt
        self.grads[index] = sharded.grad_shard
        return read

    def _drop_layer(self, index: int) -> None:
        del self.layers[index], self.optimizers[index], self.grads[index]
        self.shards.pop(index, None)

    def _clear_layers(self) -> None:
        for index in list(self.layers):
            self._drop_layer(index)

    def adopt(self, plan: ExecPlan, gen: Generation, source: str = "seed",
              transfers: Sequence[tuple[int, int, int]] = (), checkpoint: tuple[str, int] | None = None) -> int:
        """Move to `plan` on generation `gen` (this worker is rank `self.rank` of it); returns the bytes
        received. The layers of the new stage come from `source`:

        seed        built from the seed (the first generation);
        checkpoint  read from the complete checkpoint (root, step), which also sets `step`;
        memory      copied from their holders by `transfers` [(layer, src rank, dst rank)] (every rank
                    of `gen` passes the same list): parameters and optimizer state, all posted at once.

        Layers the new stage does not need are dropped. A copy that fails drops the half-received
        layers again, so only valid copies are ever reported as held.
        """
        if plan.num_layers != len(self.keys):
            raise ValueError(f"plan has {plan.num_layers} layers, the model has {len(self.keys)}")
        if plan.num_microbatches != self.job.train.num_microbatches:
            raise ValueError(f"plan splits {plan.num_microbatches} microbatches, the job's step has "
                             f"{self.job.train.num_microbatches}")
        self.settle_copies()  # layers are dropped, replaced, read into and sent from below
        role = plan.role(self.rank)
        needed = set(role.layers) if role else set()
        received = 0
        self.pending = None  # a plan change starts at a step boundary (recovery.reach_step ran before)
        self.refetches = []
        self.next_check = 0  # a new plan's first step is checked (copies just made; newcomers know no spacing)
        self.stop_reads()  # nothing read ahead for the old plan is used, nor read on
        b = self.job.train.microbatch_size
        if role is not None and stage_fold(b, role.width) > 1 and (role.num_stages > 1 or not role.keep):
            raise ValueError(f"a stage of {role.width} ranks splits each microbatch between them: the microbatch "
                             f"size {b} must be a multiple of {role.width}, unless the stage is its pipeline's "
                             f"only one and kept (it then computes several microbatches per pass)")
        random = set(getattr(self.job.model.config, "random_layers", ())) & needed
        if role is not None and role.width > 1 and random:
            raise LayerDrawError(f"layer(s) {', '.join(self.keys[i] for i in sorted(random))} draw random numbers "
                                 f"in training (dropout): a stage of {role.width} workers gives each a slice of a "
                                 f"microbatch, whose draws would depend on the plan (engine/layer_rng.py); set "
                                 f"cluster.max_stage_devices: 1")
        if source == "seed":
            self._clear_layers()
            for index in sorted(needed):
                self._fresh_layer(index, role=role)
        elif source == "checkpoint":
            if checkpoint is None:
                raise ValueError("adopt from a checkpoint needs its (root, step)")
            self._clear_layers()
            for index in sorted(needed):
                received += self._fresh_layer(index, role=role, checkpoint=checkpoint)
            self.step, self.pending = checkpoint[1], None
            self._resume_data(*checkpoint)
            self.spike = self._spike_from_checkpoint(*checkpoint)
            # a rollback (training.loss_spike) comes back to an earlier step in this process: what was
            # judged and kept after it belongs to the abandoned trajectory
            self.spike_stop = self.judgement = None
            self._spike_at = {s: v for s, v in self._spike_at.items() if s <= self.step}
        elif source == "memory":
            # What every rank holds now, read by every adopt (one world all-reduce): a table kept from an
            # earlier adopt names layers dropped since, and a newcomer would post the all-reduce alone.
            held = self._holdings(gen, plan.num_layers)
            if plan.sharded or any(w > 1 for layers in held.values() for w, _ in layers.values()):
                received = self._adopt_slices(plan, gen, role, list(transfers), held)
            else:
                received = self._adopt_whole(gen, list(transfers), needed, held)
            self._share_spike_state(gen)
        else:
            raise ValueError(f"adopt: source must be 'seed', 'checkpoint' or 'memory', got {source!r}")
        if missing := needed - set(self.layers):
            raise RuntimeError(f"rank {self.rank} lacks layer(s) {sorted(missing)} after adopting the plan")
        self.plan, self.gen, self.role = plan, gen, role
        return received

    def _resume_data(self, root: str, step: int) -> None:
        """Read on from the checkpoint's data cursor (its data record): the supervisor checked the data
        against it when the job started (engine/batches.prepare_data), and a loss-spike rollback moves
        the cursor of the checkpoint it goes back to past the samples it skips (supervisor/coordinator.py)."""
        record = read_data_record(root, step)
        if record is not None:
            self.batches.resume_at(step, int(record["consumed_samples"]))

    def data_step(self, step: int) -> int:
        """The step of the job's stream (from its origin, at this global batch) whose samples `step`
        reads: `step` itself but after a loss-spike rollback, which skipped some (the "spike" fault
        strikes by it: a bad batch, not a step number)."""
        gbs = self.job.train.global_batch_size
        s0, c0 = self.job.data.origin
        return s0 + (self.batches.sampler.cursor(step) - c0) // gbs

    def _spike_from_checkpoint(self, root: str, step: int) -> SpikeState | None:
        """The loss-spike state recorded with the checkpoint of `step` (its data record); a checkpoint
        without one (written with the policy off, or before it existed) starts the policy fresh."""
        if self.spike is None:
            return None
        record = read_data_record(root, step)
        saved = record.get("loss_spike") if record is not None else None
        if saved is None:
            return SpikeState(step=step)
        try:
            state = SpikeState.from_json(saved)
        except ValueError as e:
            raise CheckpointError(f"{root}/step{step}: data record: {e}") from None
        if state.step != step:
            raise CheckpointError(f"{root}/step{step}: data record: loss-spike state of step {state.step}")
        return state

    def _share_spike_state(self, gen: Generation) -> None:
        """Give every rank of `gen` the loss-spike state of its step, from a rank that holds it: the
        survivors hold it (they judged every step, or completed the last one with its loss), a newcomer
        does not. Two world all-reduces, once per adopt from memory: which ranks hold the state of the
        step (the first one's is taken: they are all the same), then that rank's state."""
        policy = self.job.train.loss_spike
        if policy is None or self.spike is None:
            return
        holds = torch.zeros(gen.world_size, dtype=torch.int64, device=self.device)
        holds[self.rank] = int(self.spike.step == self.step)
        with step_timeout_waits(gen):
            gen.wait(gen.world.allreduce([holds]))
        holders = [r for r, h in enumerate(holds.cpu().tolist()) if h]
        if not holders:  # nobody judged this step (a bug: a memory adopt has survivors at the step)
            raise RuntimeError(f"no rank holds the loss-spike state of step {self.step}")
        # the state, then the data cursor's origin: a newcomer started with the job's, which a rollback
        # moved (exact in float64: steps and sample counts stay below 2**53)
        n = SpikeState.floats_len(policy)
        values = torch.zeros(n + 2, dtype=torch.float64, device=self.device)
        if self.rank == holders[0]:
            mine = self.spike.to_floats()
            values[: len(mine)] = torch.tensor(mine, dtype=torch.float64)
            values[n:] = torch.tensor([float(v) for v in self.batches.origin], dtype=torch.float64)
        with step_timeout_waits(gen):
            gen.wait(gen.world.allreduce([values]))  # a sum of zeros and one row: the same bits
        got = values.cpu().tolist()
        self.spike = SpikeState.from_floats(got[:n])
        self.batches.resume_at(int(got[n]), int(got[n + 1]))

    def data_record(self, step: int) -> dict[str, Any]:
        """The checkpoint of `step`'s data record (engine/checkpoint.py DATA_FILE): the data's, and the
        loss-spike state at that step when the policy is on (a resume goes on with it)."""
        record = self.batches.record(step)
        if (state := self._spike_at.get(step)) is not None:
            record["loss_spike"] = state.to_json()
        return record

    def _adopt_whole(self, gen: Generation, transfers: list[tuple[int, int, int]], needed: set[int],
                     held: dict[int, dict[int, tuple[int, int]]]) -> int:
        """Adopt a plan of width-1 stages from holders of whole layers: receive the layers `transfers`
        bring, then drop those not `needed`. A copy that fails drops the half-received layers again.
        Every copy is checked against its sender's checksum (transfer.py); those that disagree are
        fetched again, from another holder of the layer (`held`: what every rank holds), until all
        agree (TransferCorruptError when no holder is left). Returns the bytes received."""
        incoming = [layer for layer, _, dst in transfers if dst == self.rank]
        for index in incoming:
            self._fresh_layer(index, initialise=False)
        try:
            with step_timeout_waits(gen):
                received = self._verified_transfers(gen, transfers, held)
        except BaseException:
            for index in incoming:
                self._drop_layer(index)
            raise
        for index in list(self.layers):
            if index not in needed:
                self._drop_layer(index)
        return received

    def _verified_transfers(self, gen: Generation, transfers: list[tuple[int, int, int]],
                            held: dict[int, dict[int, tuple[int, int]]]) -> int:
        """Run `transfers`, then again those whose copy disagreed with its sender's checksum, each from a
        holder not tried yet: after each round one world all-reduce of the disagreeing copies' flags,
        so that every rank retries the same list. Each retry is recorded in `refetches`."""
        received, tried = 0, [{src} for _, src, _ in transfers]
        self.refetches = []
        while transfers:
            got, corrupted = run_transfers(gen, transfers, self.layers, self.optimizers, self.corrupt_sends)
            received += got
            flags = torch.zeros(len(transfers), dtype=torch.int64, device=self.device)
            for k in corrupted:
                flags[k] = 1
            gen.wait(gen.world.allreduce([flags]))
            retry, retry_tried = [], []
            for k in torch.nonzero(flags.cpu()).flatten().tolist():
                layer, src, dst = transfers[k]
                others = sorted(r for r, layers in held.items()
                                if layers.get(layer, (0, 0))[0] == 1 and r != dst and r not in tried[k])
                self.refetches.append((layer, src, dst, others[0] if others else None))
                if not others:
                    raise TransferCorruptError(f"layer {layer} copied to rank {dst} disagrees with the checksum of "
                                               f"every holder it was fetched from ({sorted(tried[k])}); no other "
                                               f"holder is left")
                retry.append((layer, others[0], dst))
                retry_tried.append(tried[k] | {others[0]})
            transfers, tried = retry, retry_tried
        self.corrupt_sends = False  # a drill's corrupted sends: one adoption
        return received

    def _holdings(self, gen: Generation, num_layers: int) -> dict[int, dict[int, tuple[int, int]]]:
        """What every rank of `gen` holds now: rank -> layer -> (width, index), from one world
        all-reduce (each rank fills its row). Ranks of a new generation keep their node's order."""
        table = torch.zeros(gen.world_size, num_layers, 2, dtype=torch.int64, device=self.device)
        for index in self.layers:
            sharded = self.shards.get(index)
            table[self.rank, index, 0] = sharded.width if sharded else 1
            table[self.rank, index, 1] = (sharded.index if sharded else 0) + 1
        with step_timeout_waits(gen):
            gen.wait(gen.world.allreduce([table]))
        rows = table.cpu().tolist()
        return {r: {i: (w, k - 1) for i, (w, k) in enumerate(row) if w > 0} for r, row in enumerate(rows)}

    def _state_views(self, index: int) -> FlatViews:
        """This rank's holding of layer `index` as views of its live tensors (shard.FlatViews)."""
        sharded = self.shards.get(index)
        if sharded is not None:
            return sharded.state_views()
        return layer_views(self.layers[index], self.optimizers[index])

    def _state_step(self, index: int) -> torch.Tensor:
        sharded = self.shards.get(index)
        if sharded is not None:
            return sharded.state_step()
        return optimizer_state_tensors(self.optimizers[index])["0.step"]

    def _state_factored(self, index: int) -> torch.Tensor:
        sharded = self.shards.get(index)
        if sharded is not None:
            return sharded.state_factored()
        return layer_factored(self.layers[index], self.optimizers[index])

    def _adopt_slices(self, plan: ExecPlan, gen: Generation, role: Role | None,
                      transfers: list[tuple[int, int, int]], held: dict[int, dict[int, tuple[int, int]]]) -> int:
        """Adopt `plan` from the holders' memory when a stage of it or a holding is wider than one
        rank: every rank gets its new shard of each layer (the whole layer on a stage of one) as
        element ranges of parameters and optimizer moments from one whole replica (shard.slice_moves),
        with CAME also the layer's row/column statistics, whole, from one rank of that replica
        (shard.factored_moves); all posted as one batch, then the old holdings are replaced. `held`:
        what every rank holds now (`_holdings`, read in this adopt). Returns the bytes received.

        Memory (docs/engine.md, plan changes): what is sent or kept is read in place, as views of the
        live tensors, one message per parameter's piece (`shard.param_spans`: both ends cut a range
        alike); what is received lands in the new holdings' flat buffers. So the rank holds its old
        state and the new holdings' parameters and moments until the batch completes; then the old
        state goes, and each layer is installed in turn, its flat holding freed as it is."""
        stages = [(p.stage_ranks(s), p.stage_layers(s)) for p in plan.pipelines for s in range(p.num_stages)]
        moves = slice_moves(stages, held, transfers)
        came = self.job.optim.name == "came"
        width = role.width if role else 1
        index_in_stage = role.index if role else 0
        dtype = self.job.train.param_dtype
        shapes: dict[int, list[tuple[int, ...]]] = {}

        def shapes_of(layer: int) -> list[tuple[int, ...]]:
            if layer not in shapes:
                meta = self.job.model.build(self.job.train.seed, layer, layer + 1, device="meta", initialise=False)[0]
                shapes[layer] = [tuple(q.shape) for q in meta.parameters()]
            return shapes[layer]

        def n_of(layer: int) -> int:
            return sum(math.prod(shape) for shape in shapes_of(layer))

        views: dict[int, FlatViews] = {}  # the old holdings read in place: dropped before they are
        targets: dict[int, FlatHolding] = {}

        def source(layer: int) -> FlatViews:
            if layer not in views:
                views[layer] = self._state_views(layer)
            return views[layer]

        def target(layer: int) -> FlatHolding:
            if layer not in targets:
                n = n_of(layer)
                tlo, thi = shard_range(n, width, index_in_stage) if width > 1 else (0, n)
                targets[layer] = FlatHolding(
                    torch.empty(thi - tlo, dtype=dtype, device=self.device),
                    {key: torch.zeros(thi - tlo, dtype=dtype, device=self.device) for key in MOMENTS},
                    torch.zeros(1, dtype=torch.float64 if dtype == torch.float64 else torch.float32),
                    torch.zeros(factored_numel(shapes_of(layer)) if came else 0, dtype=dtype, device=self.device),
                    tlo)
            return targets[layer]

        def spans(layer: int, key: str, lo: int, hi: int) -> list[tuple[int, int]]:
            # CAME keeps no elementwise second moment of a matrix: only its vectors' elements move
            return param_spans(shapes_of(layer), lo, hi, vectors_only=came and key == "exp_avg_sq")

        p2p = None if gen.backend == "gloo" else self.device  # NCCL moves the CPU step counter on the device
        ops: list[P2POp] = []
        step_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        tags: dict[tuple[int, int], int] = collections.defaultdict(int)  # per (src, dst): both ends count alike

        def tag(src: int, dst: int) -> int:
            tags[(src, dst)] += 1
            return tags[(src, dst)]

        received = 0
        for layer, src, dst, part_lo, part_hi in moves:
            if self.rank not in (src, dst):
                continue
            if self.rank == dst:
                target(layer)  # even a shard of padding only: the rank holds the layer
            lo, hi = parts_to_elements(n_of(layer), part_lo, part_hi)
            if lo >= hi:
                continue  # padding only
            if src == dst:  # kept: from the old holding to the new one
                s, t = source(layer), targets[layer]
                for key in ("params", *MOMENTS):
                    flat = t.params if key == "params" else t.moments[key]
                    for a, b in spans(layer, key, lo, hi):
                        flat[a - t.base : b - t.base] = view_of(s, key, a, b)
                t.step.copy_(self._state_step(layer).reshape(1))
                continue
            if self.rank == src:
                s = source(layer)
                for key in ("params", *MOMENTS):
                    ops += [P2POp("send", view_of(s, key, a, b), dst, tag(src, dst))
                            for a, b in spans(layer, key, lo, hi)]
                step = self._state_step(layer).reshape(1).to(dtype).to(p2p or "cpu")
                ops.append(P2POp("send", step, dst, tag(src, dst)))
            else:
                t = targets[layer]
                for key in ("params", *MOMENTS):
                    flat = t.params if key == "params" else t.moments[key]
                    for a, b in spans(layer, key, lo, hi):
                        buf = flat[a - t.base : b - t.base]
                        ops.append(P2POp("recv", buf, src, tag(src, dst)))
                        received += buf.numel() * buf.element_size()
                step_buf = torch.zeros(1, dtype=dtype, device=p2p or "cpu")
                step_copies.append((t.step, step_buf))
                ops.append(P2POp("recv", step_buf, src, tag(src, dst)))
        if came:  # after every move, in the same order on both ends (NCCL matches a pair's operations in order)
            for layer, src, dst in factored_moves(moves, held):
                if self.rank not in (src, dst) or not factored_numel(shapes_of(layer)):
                    continue
                if src == dst:
                    targets[layer].factored.copy_(self._state_factored(layer))
                elif self.rank == src:
                    ops.append(P2POp("send", self._state_factored(layer), dst, tag(src, dst)))
                else:
                    buf = targets[layer].factored
                    ops.append(P2POp("recv", buf, src, tag(src, dst)))
                    received += buf.numel() * buf.element_size()
        views.clear()  # the sends hold what they read
        self._run_batch(gen, ops)
        ops.clear()  # nothing may keep the old state alive once its layers go
        for tstep, buf in step_copies:
            tstep.copy_(buf.cpu())
        self._clear_layers()
        for layer in sorted(targets):
            self._install(layer, role, targets.pop(layer))
        return received

    @staticmethod
    def _run_batch(gen: Generation, ops: list[P2POp]) -> None:
        """Post `ops` as one batch and wait for it (its works, which hold the tensors, end here)."""
        if not ops:
            return
        with step_timeout_waits(gen):
            for work in gen.exchange(ops):
                gen.wait(work)

    def _install(self, index: int, role: Role | None, holding: FlatHolding) -> None:
        """Layer `index` from its new shard's flat holding (the whole layer on a stage of one). Built from
        the seed first: its non-persistent buffers are the models' constants."""
        self._fresh_layer(index, role=role)
        sharded = self.shards.get(index)
        step = holding.step.reshape(())
        with torch.no_grad():
            if sharded is not None:
                sharded.shard.zero_()
                sharded.shard[: holding.params.numel()] = holding.params
                # moments of the holding's logical size: the shard's optimizer reads no padding
                sharded.load_state_shards(holding.moments, step, holding.factored)
                return
            offset = 0
            for q in self.layers[index].parameters():
                q.copy_(holding.params[offset : offset + q.numel()].view_as(q))
                offset += q.numel()
        load_flat_state(self.layers[index], self.optimizers[index], holding.moments, step, holding.factored)

    # ---- one step -----------------------------------------------------------------------------

    def _boundary_buffer(self, index: int, samples: int | None = None) -> torch.Tensor:
        """A receive buffer for the tensor entering layer `index` (or its gradient), for `samples`
        samples (default: a whole microbatch)."""
        shape = self.job.model.config.boundary_shape(index)
        return torch.empty(self.job.train.microbatch_size if samples is None else samples, *shape,
                           device=self.device, dtype=self.job.train.param_dtype)

    def _edge(self, b: int, senders: tuple[int, ...], receivers: tuple[int, ...],
              sender: bool) -> list[tuple[int, int, int, int]]:
        """This rank's pieces of a pipeline edge (layout.edge_pieces): those it sends (`sender`) or
        receives. Width 1 on both sides: the whole microbatch, to or from the neighbour."""
        return [e for e in edge_pieces(b, senders, receivers) if e[0 if sender else 1] == self.rank]

    def _numel(self, index: int) -> int:
        sharded = self.shards.get(index)
        return sharded.n if sharded is not None else self.grads[index].numel()

    def _holds(self, index: int, lo: int, hi: int) -> bool:
        """Whether this rank holds the logical elements [lo, hi) of layer `index`'s flat buffer."""
        sharded = self.shards.get(index)
        return sharded is None or (sharded.lo <= lo and hi <= sharded.hi)

    def _grad_view(self, index: int, lo: int, hi: int) -> torch.Tensor:
        sharded = self.shards.get(index)
        return sharded.grad_view(lo, hi) if sharded is not None else self.grads[index][lo:hi]

    def _my_pieces(self, index: int) -> list[tuple[int, int, int, int]]:
        """(piece, pieces, lo, hi) of layer `index`'s cross-pipeline all-reduce that this rank holds."""
        if self.plan is None:
            return []
        n = self._numel(index)
        out = []
        for piece, pieces, members in reduce_pieces(self.plan, index):
            if self.rank in members:
                lo, hi = piece_range(n, pieces, piece)
                out.append((piece, pieces, lo, hi))
        return out

    def train_step(self) -> StepResult:
        """Run step `self.step` on the current plan, then advance `self.step`.

        The step's last collective (the world all-reduce of its metrics) is its commit point: before
        it, this rank records the step as `pending` (every collective it needs is done); a rank that
        finishes the metrics all-reduce proves every rank reached that point, so a failure after it
        leaves survivors that can complete the step on their own (recovery.py).

        A step interrupted before that point leaves its layers fresh gradient buffers on gloo
        (`_abandon_grads`)."""
        try:
            return self._train_step()
        except BaseException:
            if self.pending is None and self.gen is not None and self.gen.backend == "gloo":
                self._abandon_grads()
            raise

    def _abandon_grads(self) -> None:
        """Give every whole layer a new gradient buffer, leaving the old ones to the interrupted step's
        all-reduces: they run in place, and gloo cannot abort them (abort.py), so they may go on writing
        the old buffers after the step raised, until their peers finish or the group times out (up to
        a minute), while a replay already accumulates into the layer's gradients. The old buffers are
        freed when that work ends. NCCL aborts a failed generation's communicators (abort.py), and a
        pending step waited for every collective: both keep their buffers. Sharded layers are rebuilt,
        buffers included, by every adoption of a plan from memory (`_adopt_slices`)."""
        for index, layer in self.layers.items():
            if index not in self.shards:
                self.grads[index] = attach_grad_buffer(layer)

    def _train_step(self) -> StepResult:
        plan, gen, role = self.plan, self.gen, self.role
        if plan is None or gen is None:
            raise RuntimeError("Worker.train_step: no plan/generation; call adopt() first")
        t0 = time.perf_counter()
        self.peak.start()  # the step's own peak, not the process's (an evaluation's, an earlier step's)
        self.pending = None
        # Replica integrity: the state this step starts from (the previous update's), read before any
        # of this step's work; compared at the commit point, in the metrics all-reduce (no collective
        # of its own). Nothing changes a holding until `complete_step`.
        t = self.job.train
        check = self._check_layout(plan) if check_due(self.step, t.integrity_interval, self.next_check) else None
        check_s = time.perf_counter()
        mine = self._checksums(role) if check is not None and role is not None else None
        if mine is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the check's own time (a check step only)
        check_s = time.perf_counter() - check_s
        for flat in self.grads.values():
            flat.zero_()
        for index, sharded in self.shards.items():
            sharded.begin_step(role is not None and role.keep and index in role.layers)
        # Sends in flight, per direction, with their buffers (one entry per microbatch: its pieces). At
        # most as many as 1F1B keeps microbatches in flight at this stage: the oldest is waited for
        # before one more is posted, so a stage holds O(stages) send buffers, not one per microbatch.
        # That wait cannot deadlock: the peer's thread never waits for a send of ours that is not yet posted.
        Sent = list[tuple[torch.distributed.Work, torch.Tensor]]
        sends: dict[str, collections.deque[Sent]] = {"act": collections.deque(), "grad": collections.deque()}
        in_flight = max(1, min(role.num_stages - role.stage, role.mb_count)) if role is not None else 1
        b = self.job.train.microbatch_size

        def post_send(direction: str, tensor: torch.Tensor, receivers: tuple[int, ...], tag: int) -> None:
            """Send this rank's slice of a microbatch's boundary tensor to the overlapping ranks of
            the neighbour stage (`receivers`)."""
            queue = sends[direction]
            while len(queue) >= in_flight:
                for work, _ in queue.popleft():
                    gen.wait(work)
            posted = []
            for _, dst, lo, hi in self._edge(b, role.stage_ranks, receivers, sender=True):  # type: ignore[union-attr]
                piece = tensor[lo - my_lo : hi - my_lo].contiguous()
                posted.append((gen.send(piece, dst, tag), piece))
            queue.append(posted)

        upcoming: Reads | None = None  # the next step's reads, started when this thread first waits

        def read_ahead() -> None:
            """Start the next step's reads. The reader's Python holds the GIL while it runs, so it starts
            when this thread is about to wait (its first receive, else the end of the schedule), not
            while it launches the schedule's work."""
            nonlocal upcoming
            if upcoming is not None:
                self.reads.ahead(upcoming)
                upcoming = None

        def receive(buf: torch.Tensor, senders: tuple[int, ...], tag: int) -> None:
            works = [gen.recv(buf[lo - my_lo : hi - my_lo], src, tag)
                     for src, _, lo, hi in self._edge(b, senders, role.stage_ranks, sender=False)]  # type: ignore[union-attr]
            read_ahead()
            for work in works:
                gen.wait(work)

        # A crossing: a send to the neighbour stage that the next action receives from. Both are posted
        # as one batch per neighbour rank (comm.Generation.batch), the receive's buffer allocated early,
        # and the next action waits for the batch instead of receiving: the neighbour's matching crossing
        # sends first too, and two sends waiting for receives posted behind them deadlock on NCCL.
        # (action, microbatch) -> (its buffer, the batches' works, their operations: they hold the buffers)
        crossed: dict[tuple[str, int], tuple[torch.Tensor, list[torch.distributed.Work], list[P2POp]]] = {}

        def cross(action: tuple[str, int], tensor: torch.Tensor, send_tag: int, buf: torch.Tensor, recv_tag: int,
                  peers: tuple[int, ...]) -> None:
            """Send this rank's slice of `tensor` to the overlapping ranks of the neighbour stage on
            `peers` and receive theirs into `buf` (for `action`), one batch per peer, in the edge's order."""
            by_peer: dict[int, list[P2POp]] = {}
            for _, dst, lo, hi in self._edge(b, role.stage_ranks, peers, sender=True):  # type: ignore[union-attr]
                piece = tensor[lo - my_lo : hi - my_lo].contiguous()
                by_peer.setdefault(dst, []).append(P2POp("send", piece, dst, send_tag))
            for src, _, lo, hi in self._edge(b, peers, role.stage_ranks, sender=False):  # type: ignore[union-attr]
                by_peer.setdefault(src, []).append(P2POp("recv", buf[lo - my_lo : hi - my_lo], src, recv_tag))
            works = [work for peer_rank, ops in by_peer.items() for work in gen.batch(peer_rank, ops)]
            crossed[action] = (buf, works, [op for ops in by_peer.values() for op in ops])

        def take_crossed(op: str, m: int) -> torch.Tensor | None:
            """The buffer of action (op, m) if a crossing received it, once its batches are done."""
            entry = crossed.pop((op, m), None)
            if entry is None:
                return None
            read_ahead()
            for work in entry[1]:
                gen.wait(work)
            return entry[0]

        reductions: list[torch.distributed.Work] = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        clock = ComputeClock(self.device)
        schedule_s = 0.0
        data_s = 0.0  # how long this step waited for its samples (read ahead: only the hand-over)

        scattering: list[BucketWork] = []  # kept stages' reduce-scatters in flight
        gather: StageParams | None = None

        def post_pieces(index: int) -> None:
            """All-reduce the layer's gradient across the pipelines, in place: whole, or (a wide stage
            holds or a wide replica exists) piece by piece, from the rank's shard."""
            sharded = self.shards.get(index)
            for piece, pieces, lo, hi in self._my_pieces(index):
                group = gen.piece_group.get((index, piece))
                if group is not None and lo < hi:
                    view = self.grads[index] if pieces == 1 and sharded is None else self._grad_view(index, lo, hi)
                    reductions.append(group.allreduce([view]))

        def flush_scatters() -> None:
            while scattering:
                work = scattering.pop(0)
                if self.before_scatter is not None:
                    self.before_scatter(self.step)
                work.complete(gen.wait)  # the pieces read its result
                for position in work.positions:
                    post_pieces(role.layers.start + position)  # type: ignore[union-attr]

        def reduce_layer(index: int) -> None:
            """The layer's gradient is complete. A kept stage reduce-scatters it first, asynchronously,
            with the rest of its bucket (shard.py): the bucket's pieces are posted once the next layer's
            backward is done (or at the schedule's end), so the scatter runs behind that backward.
            Resharded, each microbatch's backward posted its scatter into the shard: the last one's
            pieces wait for it the same way."""
            flush_scatters()
            if gather is not None:
                position = index - role.layers.start  # type: ignore[union-attr]
                work = gather.scatter(position) if role.keep else gather.scattered(position)  # type: ignore[union-attr]
                if work is not None:
                    scattering.append(work)
                if work is not None or role.keep:  # type: ignore[union-attr]
                    return
            post_pieces(index)

        if role is not None:
            my_lo = sample_range(b, role.width, role.index)[0]  # edges: pipelines of several stages, one
            # microbatch per pass
            passes = pass_slices(b, role.width, role.index, role.mb_count)
            # reduce behind the last pass this rank computes: a folded stage's last, partial pass may
            # give it no sample, and being kept it then skips that pass (no collective runs per pass)
            last_pass = max((i for i, slices in enumerate(passes) if slices), default=-1)
            windows: list[torch.Tensor] = []
            # the stages between read nothing, unless each layer needs its rows' documents: the token ids
            # are read then, by the same reader and a step ahead, rather than sent along with the hidden states
            if role.is_first or role.is_last or self.eos_id is not None:
                t_data = time.perf_counter()
                windows, upcoming = self._step_windows(role)
                data_s = time.perf_counter() - t_data
            held = [self.layers[i] for i in role.layers]
            if role.width > 1:
                if gen.stage is None:
                    raise RuntimeError(f"rank {self.rank}: a stage of {role.width} ranks without its group")
                gather = StageParams([self.shards[i] for i in role.layers], gen.stage, gen.wait, role.keep,
                                     self.job.train.bucket_mb * 2**20, gen.scatter_by_allreduce)
            stage = Stage(held, role.layers.start, role.is_last, self.device, self.job.model.config.loss,
                          bf16=self.job.train.precision == "bf16", recompute=self.job.train.recompute,
                          params=gather, draws=LayerDraws(self.job.train.seed, self.step, self.device),
                          names=[self.keys[i] for i in role.layers])
            actions = [a for a in one_f_one_b(role.stage, role.num_stages, len(passes))
                       if sum(hi - lo for _, lo, hi in passes[a.microbatch])]
            for k, (op, m) in enumerate(actions):
                samples = sum(hi - lo for _, lo, hi in passes[m])
                following = actions[k + 1] if k + 1 < len(actions) else None
                if op == "F":
                    y = windows[m][:, 1:].contiguous() if role.is_last else None
                    if role.is_first:
                        x = windows[m][:, :-1].contiguous()
                    elif (got := take_crossed("F", m)) is not None:
                        x = got
                    else:
                        x = self._boundary_buffer(role.layers.start, samples)
                        receive(x, role.prev_ranks, 2 * m)
                    # each rank takes the mean over its samples, weighted by their share of a microbatch:
                    # the sum over the stage's ranks is the mean of the pass's microbatches' means
                    scale = samples / b / plan.num_microbatches
                    if self.loss_factor is not None:
                        scale *= self.loss_factor(self.data_step(self.step))
                    documents = self._documents(windows[m][:, :-1]) if self.eos_id is not None else None
                    with clock.span():
                        out = stage.forward(m, x, y, scale, split=m == last_pass, documents=documents,
                                            microbatch=role.mb_start + passes[m][0][0])
                    if role.is_last:
                        loss_sum += out.double()  # on the device: no host sync per microbatch
                    elif following is not None and following.op == "B":  # its gradient comes from next_ranks
                        n = following.microbatch
                        buf = self._boundary_buffer(role.layers.stop, sum(hi - lo for _, lo, hi in passes[n]))
                        cross(("B", n), out, 2 * m, buf, 2 * n + 1, role.next_ranks)
                    else:
                        post_send("act", out, role.next_ranks, 2 * m)
                else:
                    grad = None
                    if not role.is_last:
                        grad = take_crossed("B", m)
                        if grad is None:
                            grad = self._boundary_buffer(role.layers.stop, samples)
                            receive(grad, role.next_ranks, 2 * m + 1)
                    with clock.span():
                        grad_in = stage.backward(m, grad, reduce_layer if m == last_pass else None)
                    if not role.is_first:
                        if grad_in is None:
                            raise RuntimeError("a stage after the first returned no input gradient")
                        if following is not None and following.op == "F":  # its input comes from prev_ranks
                            n = following.microbatch
                            buf = self._boundary_buffer(role.layers.start, sum(hi - lo for _, lo, hi in passes[n]))
                            cross(("F", n), grad_in, 2 * m + 1, buf, 2 * n, role.prev_ranks)
                        else:
                            post_send("grad", grad_in, role.prev_ranks, 2 * m + 1)
            read_ahead()
            if gather is not None:
                if last_pass < 0 and role.keep and role.mb_count:
                    # a folded stage's pipeline with fewer microbatches than a pass: the ranks with a
                    # sample gathered the layers at their first forward, so this one gathers them too
                    gather.before(0, 1)
                gather.finish()
            if last_pass < 0:  # no sample this step: still take part in every layer's all-reduce
                for index in reversed(role.layers):
                    reduce_layer(index)
            flush_scatters()
            for queue in sends.values():
                for posted in queue:
                    for work, _ in posted:
                        gen.wait(work)
            schedule_s = time.perf_counter() - t0

        # The loss-spike policy judges the step's loss, reduced over the world before the commit point, so
        # that every rank, also one that completes the step alone in a recovery (or a spare), decides the
        # same: one more all-reduce of one value, only with the policy on, posted as soon as the loss is
        # known (every rank posts it after its layers' reductions: one order everywhere, as NCCL needs) and
        # waited for once the gradients are.
        loss_work = None
        reduced_loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.spike is not None:
            if role is not None and role.is_last:
                reduced_loss[0] = loss_sum
            loss_work = gen.world.allreduce([reduced_loss])
        # Gradients: wait for every layer's all-reduce; the squared norms of the plan's finest pieces
        # of each layer (one piece per layer when no stage is wide), summed over the pipeline's ranks:
        # each piece has one holder there, so the sum adds zeros, and every pipeline gets the same bits.
        for reduction in reductions:
            gen.wait(reduction)
        pieces = plan.max_width
        sq = torch.zeros(plan.num_layers, pieces, dtype=torch.float64, device=self.device)  # nccl: on the GPU
        for index in self.grads:
            if pieces == 1 and index not in self.shards:
                sq[index, 0] = torch.linalg.vector_norm(self.grads[index], dtype=torch.float64).square()
                continue
            n = self._numel(index)
            for piece in range(pieces):
                lo, hi = piece_range(n, pieces, piece)
                if lo < hi and self._holds(index, lo, hi):
                    sq[index, piece] = torch.linalg.vector_norm(self._grad_view(index, lo, hi),
                                                                dtype=torch.float64).square()
        if gen.pipeline is not None:
            gen.wait(gen.pipeline.allreduce([sq]))
        total_sq = sum(sq.flatten().tolist())  # fixed order: every pipeline gets the same bits
        spike_loss = None
        if loss_work is not None:
            gen.wait(loss_work)
            spike_loss = float(reduced_loss.cpu()[0])
        if role is not None:
            self._prepare_stage_updates(gen, role, total_sq)
            self.pending = PendingStep(self.step, total_sq, spike_loss)

        # Step metrics, summed over the world: loss, per-pipeline time, per-rank compute time, peak memory,
        # per-rank wait for data.
        num_p, world = len(plan.pipelines), gen.world_size
        # a check's packed checksums, then each rank's time for them (the next check's spacing)
        sums_at = 1 + num_p + 3 * world
        cost_at = sums_at + (2 * check[1] if check is not None else 0)
        metrics = torch.zeros(cost_at + (world if check is not None else 0), dtype=torch.float64, device=self.device)
        if check is not None:
            metrics[cost_at + self.rank] = check_s
            if mine is not None:
                offset = sums_at + 2 * check[0][self.rank]
                metrics[offset : offset + mine.numel()] = mine
        if role is not None:
            if role.is_last:
                metrics[0] = loss_sum
            if role.is_first and role.index == 0:  # one rank per pipeline: the metrics are summed
                metrics[1 + role.pipeline] = schedule_s
        compute, memory, data = (1 + num_p + k * world for k in range(3))  # where each per-rank row starts
        metrics[compute + self.rank] = clock.seconds()
        if (peak := self.peak.peak()) is not None:  # what the planner's memory model is checked against
            metrics[memory + self.rank] = peak
        metrics[data + self.rank] = data_s
        gen.wait(gen.world.allreduce([metrics]))  # the commit point
        gen.step_completed(time.perf_counter() - t0)  # bounds the next steps' waits (Generation.wait_timeout)
        metrics = metrics.cpu()
        if check is not None:
            self._verify(plan, gen, check, metrics[sums_at:cost_at].tolist())
            # every rank the same figures (all-reduced): the same next check
            self.next_check = next_check(self.step, t.integrity_interval, t.integrity_max_cost,
                                         float(metrics[cost_at:].max()), float(metrics[1 : 1 + num_p].max()))
        if role is not None:
            lr = self.complete_step()
        else:  # a spare: nothing to update, but it judges the loss as the members do (it may join them)
            lr = self.lr()
            self._judge(spike_loss)
            self.step += 1
        return StepResult(
            step=self.step - 1,
            loss=float(metrics[0]),
            grad_norm=total_sq**0.5,
            lr=lr,
            seconds=time.perf_counter() - t0,
            pipeline_seconds=tuple(float(v) for v in metrics[1 : 1 + num_p]),
            compute_seconds=tuple(float(v) for v in metrics[compute:memory]),
            peak_memory=tuple(float(v) for v in metrics[memory:data]) if self.device.type == "cuda" else (),
            data_s=float(metrics[data:].max()),  # the longest wait: a pipeline's ranks wait for each other
            skipped=role is not None and self.skipped,
            skip_reason=self.skip_reason if role is not None else None,
            loss_threshold=self.judgement.threshold if self.judgement is not None else None,
            tokens=(tokens := self.job.train.global_batch_size * self.job.model.seq_len),
            devices=len(plan.ranks),  # spares excluded
            flops=tokens * self.flops_per_token,
            peak_flops=self.peak_flops,
        )

    # ---- replica integrity (engine/integrity.py) -------------------------------------------------

    @staticmethod
    def _check_layout(plan: ExecPlan) -> tuple[dict[int, int], int] | None:
        """Where each rank's checksums go in a check's table (rank -> its first slot; one slot per held
        layer, in layer order) and the slots in all; None when no layer has two holders to compare."""
        first, total, holders = {}, 0, collections.Counter[GroupKey]()
        for rank in plan.ranks:
            role = plan.role(rank)
            if role is None:
                continue
            first[rank] = total
            total += len(role.layers)
            holders.update((i, role.width, role.index) for i in role.layers)
        return (first, total) if any(n > 1 for n in holders.values()) else None

    def holding_tensors(self, index: int) -> list[torch.Tensor]:
        """What this rank holds of layer `index`, as its checksum reads it: a whole layer's parameters,
        buffers and optimizer state (what a recovery copy moves, transfer.layer_tensors); a shard's
        elements of its parameters and moments, the step counter and CAME's row/column statistics."""
        sharded = self.shards.get(index)
        if sharded is None:
            return layer_tensors(self.layers[index], self.optimizers[index])
        views = sharded.state_views()
        return ([t for key in sorted(views) for _, _, t in views[key]]
                + [sharded.state_step().reshape(-1), sharded.state_factored()])

    def _checksums(self, role: Role) -> torch.Tensor:
        """This rank's checksums of its layers, in layer order, packed (integrity.pack)."""
        values = torch.stack([checksum(self.holding_tensors(i), self.device) for i in role.layers])
        return pack(values)

    def _verify(self, plan: ExecPlan, gen: Generation, check: tuple[dict[int, int], int], table: list[float]) -> None:
        """Compare the check's checksums (the commit point's table, the same bits on every rank, so every
        rank decides alike). A mismatch withholds this step everywhere (no rank applies it: it is
        replayed once the suspects are evicted, from the good replicas' copies) and raises
        ReplicaMismatchError with the verdict. Where two holders disagree with no majority, every rank
        reads its checksums again and they are compared in one more world all-reduce."""
        first = check[0]

        def grouped(values: list[int]) -> dict[GroupKey, dict[int, int]]:
            out: dict[GroupKey, dict[int, int]] = {}
            for rank, start in first.items():
                role = plan.role(rank)
                assert role is not None
                for k, i in enumerate(role.layers):
                    out.setdefault((i, role.width, role.index), {})[rank] = values[start + k]
            return out

        sums = grouped(unpack(table))
        if not mismatched(sums):
            return
        again = None
        if needs_second_read(sums):
            second = torch.zeros(2 * check[1], dtype=torch.float64, device=self.device)
            if self.role is not None:
                start = 2 * first[self.rank]
                second[start : start + 2 * len(self.role.layers)] = self._checksums(self.role)
            gen.wait(gen.world.allreduce([second]))
            again = grouped(unpack(second.cpu().tolist()))
        self.pending = None  # withheld everywhere: replayed after the eviction
        raise ReplicaMismatchError(attribute(sums, again), self.step)

    def _prepare_stage_updates(self, gen: Generation, role: Role, total_sq: float) -> None:
        """CAME on a wide stage: the reductions of this step's update inside the stage (row/column sums
        and the update's RMS, optim/came_sharded.py), for the gradients as `complete_step` clips them.
        They run here, before the step's commit point, so that completing a pending step needs no peer
        (recovery.py). Every rank of the stage runs them for its layers in the same order, each a SUM
        all-reduce on the stage group waited on through the generation's abortable wait."""
        came = [opt for i in role.layers if isinstance(opt := self.optimizers[i], ShardedCAME)]
        if not came:
            return
        stage = gen.stage
        if stage is None:
            raise RuntimeError(f"rank {self.rank}: a stage of {role.width} ranks without its group")
        coef = clip_coefficient(total_sq, self.job.train.grad_clip)

        def stage_sum(t: torch.Tensor) -> None:
            gen.wait(stage.allreduce([t]))

        for opt in came:
            opt.prepare(coef, stage_sum)

    def evaluate(self) -> tuple[float, int]:
        """The mean loss over the job's validation samples with the current parameters, and their count:
        forward only, every pipeline taking its share of the validation microbatches (in proportion to
        its share of a training step's), each microbatch the same samples whatever the plan. Every rank
        of the generation calls it (the loss is summed over the world).

        A wide stage runs on its first rank alone (validation microbatches need not split evenly); the
        others take part in its gathers. Kept, the stage gathers its layers once (they fit, as in a step);
        resharded, one layer at a time (`_evaluate_resharded`), as its step does."""
        plan, gen, role = self.plan, self.gen, self.role
        if plan is None or gen is None:
            raise RuntimeError("Worker.evaluate: no plan/generation; call adopt() first")
        if self.validation is None:
            raise RuntimeError("Worker.evaluate: the job has no validation samples (training.eval_interval 0)")
        n = self.validation.num_samples
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if role is not None:
            self._evaluate_share(role, gen, total)
        for sharded in self.shards.values():
            sharded.release()
        gen.wait(gen.world.allreduce([total]))
        return float(total.cpu()) / n, n

    def _evaluate_share(self, role: Role, gen: Generation, total: torch.Tensor) -> None:
        """This stage's part of `evaluate`, its layers in eval mode (no dropout) for the time being: the
        loss summed over its pipeline's validation microbatches is added to `total` on the last stage.
        A wide stage runs on its first rank alone, the others taking part in its gathers: kept, it
        gathers its layers once; resharded, one layer at a time (`_evaluate_resharded`)."""
        plan, validation = self.plan, self.validation
        if plan is None or validation is None:
            raise RuntimeError("Worker.evaluate: no plan or no validation samples")
        n, b = validation.num_samples, self.job.train.microbatch_size
        layers = [self.layers[i] for i in role.layers]
        for layer in layers:
            layer.eval()
        try:
            count = -(-n // b)  # validation microbatches, the last one possibly smaller
            microbatches = range(count * role.mb_start // plan.num_microbatches,
                                 count * (role.mb_start + role.mb_count) // plan.num_microbatches)
            if role.width > 1 and gen.stage is None:
                raise RuntimeError(f"rank {self.rank}: a stage of {role.width} ranks without its group")
            if role.width > 1 and not role.keep:
                self._evaluate_resharded(role, microbatches, total)
                return
            if role.width > 1:
                for index in role.layers:
                    gen.wait(self.shards[index].gather(gen.stage))  # type: ignore[arg-type]
            if role.index == 0:
                for m in microbatches:
                    h = self._eval_input(role, m)
                    with torch.no_grad(), self._eval_autocast():
                        for layer in layers:
                            h.hidden = run_layer(layer, h.hidden, h.documents)
                    self._eval_output(role, h, total)
        finally:
            for layer in layers:
                layer.train()

    def _evaluate_resharded(self, role: Role, microbatches: range, total: torch.Tensor) -> None:
        """Evaluate a resharded stage's share of the validation microbatches layer by layer: the stage's
        first rank takes the hidden states of a group of microbatches (as many as 1F1B keeps in flight
        at this stage), then each layer is gathered (the next one's gather posted first, as in a step:
        two layers whole at most, what the planner counts), applied to every hidden state of the group
        and freed. Each microbatch meets the same operations in the same order as through a whole
        forward: the same loss, bit for bit. The group's inputs are all received before its first
        gather and its outputs sent after its last layer: a neighbour's sends and receives go in
        microbatch order, so NCCL's in-order rules hold."""
        gen = self.gen
        assert gen is not None and gen.stage is not None
        shards = [self.shards[i] for i in role.layers]
        group = max(1, min(role.num_stages - role.stage, role.mb_count))
        for first in range(microbatches.start, microbatches.stop, group):
            held = ([self._eval_input(role, m) for m in range(first, min(first + group, microbatches.stop))]
                    if role.index == 0 else [])
            pending: torch.distributed.Work | None = shards[0].gather(gen.stage)
            for k, sharded in enumerate(shards):
                assert pending is not None
                gen.wait(pending)
                pending = shards[k + 1].gather(gen.stage) if k + 1 < len(shards) else None
                with torch.no_grad(), self._eval_autocast():
                    for h in held:
                        h.hidden = run_layer(sharded.module, h.hidden, h.documents)
                sharded.release()
            for h in held:
                self._eval_output(role, h, total)

    def _eval_autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.job.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _eval_input(self, role: Role, m: int) -> _EvalMicrobatch:
        """Validation microbatch `m` entering this stage: its token ids on a first stage, else the
        hidden state received from the previous stage; its targets on a last stage."""
        assert self.validation is not None and self.gen is not None
        n, b = self.validation.num_samples, self.job.train.microbatch_size
        ids = list(range(m * b, min(n, (m + 1) * b)))
        tokens: torch.Tensor | None = None
        y = documents = None
        if role.is_first or role.is_last or self.eos_id is not None:
            pin = self.device.type == "cuda"  # pinned host buffers: the copies to the device do not block
            tokens, y = (t.pin_memory().to(self.device, non_blocking=True) if pin else t
                         for t in self.validation.batch(ids))
            documents = self._documents(tokens)
        if tokens is not None and role.is_first:
            h = tokens
        else:
            h = self._boundary_buffer(role.layers.start)[: len(ids)].contiguous()
            self.gen.wait(self.gen.recv(h, peer(role.prev_rank), 2 * m))
        return _EvalMicrobatch(m, len(ids), h, y, documents)

    def _eval_output(self, role: Role, h: _EvalMicrobatch, total: torch.Tensor) -> None:
        """A validation microbatch leaving this stage: its loss added (last stage), else sent on."""
        assert self.gen is not None
        if role.is_last:
            assert h.targets is not None  # a last stage reads them
            with torch.no_grad(), self._eval_autocast():
                total += self.job.model.config.loss(h.hidden, h.targets).double() * h.samples
        else:
            self.gen.wait(self.gen.send(h.hidden.to(self.job.train.param_dtype).contiguous(),
                                        peer(role.next_rank), 2 * h.index))

    def snapshot(self, index: int) -> Snapshot | None:
        """Layer `index` for the checkpoint of this step, as `layer_payload` gives it, but a whole layer
        is copied in the background (`copier`): the training path only hands over its tensors, and
        whatever next writes them in place waits for the copy first (`settle_copies`). A layer sharded
        over a wide stage is gathered and copied now, as `layer_payload` does: its gather is a
        collective of the stage, and its copies are of the gathered buffers, which it frees at once."""
        if index in self.shards:
            payload = self.layer_payload(index)
            return None if payload is None else Snapshot.taken(self.keys[index], payload)
        self._keep_spike_state()
        return self.copier.copy(self.keys[index], live_tensors(self.layers[index], self.optimizers[index]))

    def settle_copies(self, layers: Iterable[int] | None = None) -> float:
        """The one fence before anything writes or frees held layers' tensors in place (the update, a
        plan change, a drill's corruption): wait until the checkpoint copies pending for `layers` (every
        held layer by default) no longer read them. Returns the seconds waited."""
        return self.copier.fence(None if layers is None else [self.keys[i] for i in layers])

    def _keep_spike_state(self) -> None:
        """Keep the loss-spike state at this step for the checkpoint's data record (`data_record`),
        which the writer's thread makes later, when the state may have moved on."""
        if self.spike is not None and self.step not in self._spike_at:
            self._spike_at[self.step] = self.spike
            for old in sorted(self._spike_at)[:-SPIKE_SNAPSHOTS]:
                del self._spike_at[old]

    def layer_payload(self, index: int) -> dict[str, torch.Tensor] | None:
        """The whole of layer `index` (checkpoint.layer_payload: parameters, buffers, optimizer
        state), as CPU copies. A layer sharded over a wide stage is gathered first: every rank of the
        stage must call this for the same layers in the same order; its first rank gets the payload,
        the others None.

        Gathered one tensor at a time (the parameters, then each moment), each cut into the payload's
        CPU copies and freed before the next gather: beyond the payload, a rank holds one whole-layer
        buffer and its own shard of one moment (docs/engine.md, checkpoints).

        The loss-spike state at this step is kept for the checkpoint's data record (`_keep_spike_state`)."""
        self._keep_spike_state()
        sharded = self.shards.get(index)
        if sharded is None:
            return layer_payload(self.layers[index], self.optimizers[index], self.step)
        gen = self.gen
        if gen is None or gen.stage is None:
            raise RuntimeError(f"rank {self.rank}: layer {index} is sharded but the stage has no group")
        first = sharded.index == 0
        module = sharded.module
        payload: dict[str, torch.Tensor] = {}
        gen.wait(sharded.gather(gen.stage))
        if first:
            payload.update({f"param.{n}": p.detach().to("cpu", copy=True) for n, p in module.named_parameters()})
            payload.update({f"buffer.{n}": b.detach().to("cpu", copy=True)
                            for n, b in persistent_buffers(module).items()})
        sharded.release()
        opt = make_layer_optimizer(module, self.job.optim)  # the whole layer's state names: it allocates none
        layout = state_layout(module, opt)
        state: dict[str, torch.Tensor] = {}
        for key in MOMENTS:
            mine = sharded.state_shard(key)
            whole = torch.empty(sharded.size * sharded.width, dtype=mine.dtype, device=mine.device)
            gen.wait(gen.stage._allgather_base(whole, mine))  # flat: no copy of the output of its own
            del mine
            if first:
                for name, (source, offset, shape) in layout.items():
                    if source == key:
                        state[name] = whole[offset : offset + math.prod(shape)].view(shape).to("cpu", copy=True)
            del whole
        if not first:
            return None
        factored = sharded.state_factored()  # CAME's row/column statistics: whole on every rank
        if (need := factored_count(layout)) != factored.numel():
            raise RuntimeError(f"layer {index}: {factored.numel()} row/column statistics held, {need} expected")
        step = step_like(opt, sharded.state_step())
        for name, (source, offset, shape) in layout.items():
            if source == "step":
                state[name] = step.to("cpu", copy=True)
            elif source == "factored":
                state[name] = factored[offset : offset + math.prod(shape)].view(shape).to("cpu", copy=True)
        payload.update({f"state.{name}": state[name] for name in layout})  # the optimizer's order
        return payload

    def lr(self) -> float:
        """The learning rate of step `self.step`."""
        t = self.job.train
        return lr_at(self.step, lr=self.job.optim.lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                     min_lr=t.min_lr, decay=t.decay)

    def complete_step(self) -> float:
        """Apply the pending step: clip the reduced gradients to the global norm, update every layer,
        advance `step`. Returns the step's learning rate. Needs no peer (recovery.py). A step whose
        global gradient norm (or loss) is not finite, or whose loss the loss-spike policy judges a spike,
        is skipped (`skipped`, `skip_reason`): parameters and optimizer state stay as they were, and the
        step is consumed (the next reads the next samples)."""
        if self.pending is None or self.pending.step != self.step:
            raise RuntimeError(f"no pending step {self.step} to complete (pending: {self.pending})")
        lr = self.lr()
        judgement = self._judge(self.pending.loss)
        if not math.isfinite(self.pending.total_sq) or (judgement is not None and judgement.verdict == "non_finite"):
            self.skip_reason = "non_finite"
        elif judgement is not None and judgement.skips:
            self.skip_reason = "loss_spike"
        else:
            self.skip_reason = None
        self.skipped = self.skip_reason is not None
        if self.skipped:
            # A NaN or Inf in any rank's gradient reaches every replica's all-reduce, and every rank holds
            # this global norm with the same bits (also one that completes the step alone, recovery.py):
            # every rank skips the update, so no replica takes in the non-finite values. The loss-spike
            # verdict is the same on every rank too: the same state and the same reduced loss.
            self.step += 1
            self.pending = None
            return lr
        coef = clip_coefficient(self.pending.total_sq, self.job.train.grad_clip)
        self.copy_wait_s = self.settle_copies(self.optimizers)  # the update writes parameters and state in place
        for index in sorted(self.optimizers):
            if self.before_update is not None:
                self.before_update(self.step)
            if coef < 1.0:
                self.grads[index].mul_(coef)
            set_lr(self.optimizers[index], lr)
            self.optimizers[index].step()
        self.step += 1
        self.pending = None
        return lr

    def _judge(self, loss: float | None) -> Judgement | None:
        """The loss-spike verdict on step `self.step` (None with the policy off), advancing its state;
        a `stop` verdict is kept in `spike_stop` (the process stops the job: elastic_process.py)."""
        policy = self.job.train.loss_spike
        if policy is None or self.spike is None or loss is None:
            self.judgement = None
            return None
        self.judgement, self.spike = judge(policy, self.spike, self.step, loss)
        if self.judgement.verdict == "stop" and self.spike_stop is None:
            self.spike_stop = self.judgement
        return self.judgement

    def layer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Parameters of the held layers, by layer key then parameter name (CPU copies)."""
        return {
            self.keys[i]: {n: p.detach().cpu().clone() for n, p in self.layers[i].named_parameters()}
            for i in sorted(self.layers)
        }
