"""Opening a job's data in a worker, and the microbatches of one pipeline for one step.

Which samples a step trains on comes from `GlobalBatchSampler` (by step, seed, data and the stream's
origin only); a pipeline takes its contiguous microbatch slice of them. So a plan change never changes
the data. The data is one source (`DataSpec.path`) or several (`DataSpec.sources`, mixed by weight);
validation holds the last samples of each source out of training, apportioned by weight, so it never
shifts the order training draws the remaining samples in. A rank reads only its own slices of its
microbatches (`Reads`, `StepBatches.read`), a step ahead (engine/prefetch.py).

`prepare_data(spec, checkpoint_root)` is the supervisor's part: the data's identity, checked against
the checkpoint a job resumes from (DataChangedError naming what changed), the stream's origin at that
checkpoint (a changed global batch resumes there with no gap and no repeat), and `data.epochs`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from oobleck_slurm.data.dataset import Samples, TokenDataset, open_source
from oobleck_slurm.data.mixture import apportion
from oobleck_slurm.data.sampler import SAMPLER_VERSION, GlobalBatchSampler
from oobleck_slurm.engine.checkpoint import DataChangedError, identity_changes, latest_complete, read_data_record
from oobleck_slurm.engine.layout import Role, pass_slices
from oobleck_slurm.engine.spec import DataSpec, JobSpec
from oobleck_slurm.errors import BadInputError


class RandomTokens(Samples):
    """`num_samples` uniformly random token sequences from `seed`: same (x, y) layout as TokenDataset."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.num_samples, self.seq_len = num_samples, seq_len
        self._tokens = rng.integers(0, vocab_size, (num_samples, seq_len + 1))

    def read_windows(self, sample_ids: np.ndarray, out: np.ndarray) -> None:
        np.take(self._tokens, sample_ids, axis=0, out=out)


class SampleRange(Samples):
    """Samples [start, stop) of another dataset, numbered from 0."""

    def __init__(self, dataset: Samples, start: int, stop: int) -> None:
        self.dataset, self.start, self.num_samples = dataset, start, stop - start
        self.seq_len = dataset.seq_len

    def read_windows(self, sample_ids: np.ndarray, out: np.ndarray) -> None:
        self.dataset.read_windows(sample_ids + self.start, out)


class Sources(Samples):
    """Several datasets numbered back to back, each with its weight in the mix (None: by size)."""

    def __init__(self, parts: list[Samples], weights: list[float] | None) -> None:
        self.parts, self.weights = parts, weights
        self.sizes = [p.num_samples for p in parts]
        self.num_samples = sum(self.sizes)
        self.seq_len = parts[0].seq_len if parts else 0
        self._starts = np.cumsum([0, *self.sizes]).astype(np.int64)

    def read_windows(self, sample_ids: np.ndarray, out: np.ndarray) -> None:
        if len(self.parts) == 1:
            self.parts[0].read_windows(sample_ids, out)
            return
        part = np.searchsorted(self._starts, sample_ids, side="right") - 1
        for j in np.unique(part).tolist():  # one read per source, then back in the step's order
            at = np.flatnonzero(part == j)
            rows = np.empty((len(at), out.shape[1]), dtype=out.dtype)
            self.parts[j].read_windows(sample_ids[at] - self._starts[j], rows)
            out[at] = rows


def source_paths(spec: DataSpec) -> list[tuple[str, float]]:
    """(path, weight) per source; weight 0 means 'in proportion to its samples'."""
    if spec.kind == "random":
        return [("the random data", 0.0)]
    if spec.sources:
        return [(str(p), float(w)) for p, w in spec.sources]
    assert spec.path is not None  # DataSpec requires a path or sources for kind 'tokens'
    return [(spec.path, 0.0)]


def _weights(spec: DataSpec, sizes: list[int]) -> list[float] | None:
    given = [w for _, w in source_paths(spec)]
    if all(w == 0 for w in given):
        return None
    return [w if w > 0 else float(n) / max(1, sum(sizes)) for w, n in zip(given, sizes)]


def _open_source(path: str, seq_len: int, vocab_size: int) -> TokenDataset:
    source = open_source(path)
    if source.vocab_size is not None and source.vocab_size > vocab_size:
        raise ValueError(f"data: {path} was tokenized with a vocabulary of {source.vocab_size} ids, "
                         f"but the model's vocab_size is {vocab_size}")
    try:
        return TokenDataset(source.streams, seq_len)
    except ValueError as err:
        raise ValueError(f"data: {path}: {err}") from None


def _holdouts(spec: DataSpec, sizes: list[int]) -> list[int]:
    """Validation samples held out of each source: `holdout` apportioned by weight."""
    weights = _weights(spec, sizes) or [float(n) for n in sizes]
    return apportion(weights, spec.holdout, at_least_one=False)


def _all_sources(spec: DataSpec, seq_len: int, vocab_size: int) -> list[Samples]:
    if spec.kind == "random":
        return [RandomTokens(spec.num_samples, seq_len, vocab_size, spec.seed)]
    return [_open_source(p, seq_len, vocab_size) for p, _ in source_paths(spec)]


def open_dataset(spec: DataSpec, seq_len: int, vocab_size: int) -> Sources:
    """The training samples (without the validation samples held out of them)."""
    parts = _all_sources(spec, seq_len, vocab_size)
    sizes = [p.num_samples for p in parts]
    held = _holdouts(spec, sizes)
    for (path, _), part, h in zip(source_paths(spec), parts, held):
        if h and part.num_samples <= h:
            raise ValueError(f"data: {path} has {part.num_samples} samples of seq_len {seq_len}; holding {h} "
                             f"out for validation (training.eval_samples) leaves none to train on")
    kept: list[Samples] = [SampleRange(p, 0, p.num_samples - h) if h else p for p, h in zip(parts, held)]
    return Sources(kept, _weights(spec, sizes))


def open_validation(spec: DataSpec, seq_len: int, vocab_size: int, samples: int) -> Samples:
    """The first `samples` validation samples: of `spec.validation`, or those held out of training
    (each source's held-out tail, the sources in order)."""
    if spec.validation is not None:
        data = _open_source(spec.validation, seq_len, vocab_size)
        if data.num_samples < samples:
            raise ValueError(f"data.validation: {spec.validation} has {data.num_samples} samples of seq_len {seq_len}, "
                             f"fewer than training.eval_samples ({samples})")
        return SampleRange(data, 0, samples)
    if spec.holdout < samples:
        raise ValueError(f"data: {spec.holdout} samples held out for validation, {samples} asked for")
    parts = _all_sources(spec, seq_len, vocab_size)
    held = _holdouts(spec, [p.num_samples for p in parts])
    tails: list[Samples] = [SampleRange(p, p.num_samples - h, p.num_samples) for p, h in zip(parts, held) if h]
    return SampleRange(Sources(tails, None), 0, samples)


def sampler_for(dataset: Samples, global_batch_size: int, seed: int,
                origin: tuple[int, int] = (0, 0)) -> GlobalBatchSampler:
    """The sampler of a dataset `open_dataset` returned (or any dataset: one source)."""
    sizes = getattr(dataset, "sizes", None) or dataset.num_samples
    return GlobalBatchSampler(sizes, global_batch_size, seed, getattr(dataset, "weights", None), origin)


@dataclass(frozen=True)
class Reads:
    """What one rank reads for one step, and what a read made ahead of time is known by: the step, the
    plan it was made for (`plan`: its identity; a read made for another plan is never used, even if its
    microbatches coincide) and, per pass of the rank's stage, the (microbatch of the step, first sample,
    end) slices it computes (layout.pass_slices, the microbatches numbered in the whole step)."""

    step: int
    plan: Hashable
    passes: tuple[tuple[tuple[int, int, int], ...], ...]

    @staticmethod
    def of(step: int, plan: Hashable, role: Role, microbatch_size: int) -> Reads:
        """What `role` of `plan` reads for `step`: its stage's passes (layout.pass_slices)."""
        passes = pass_slices(microbatch_size, role.width, role.index, role.mb_count)
        return Reads(step, plan, tuple(tuple((role.mb_start + m, lo, hi) for m, lo, hi in p) for p in passes))


class StepBatches:
    """The (x, y) of every microbatch of a step, by global microbatch index.

    `origin`: the stream's (step, samples consumed) where the job resumed (DataSpec.origin);
    `identity`: the data's identity (DataSpec.identity), which `record` adds to each checkpoint."""

    def __init__(self, dataset: Samples, global_batch_size: int, microbatch_size: int, seed: int,
                 origin: tuple[int, int] | list[int] = (0, 0), identity: dict[str, Any] | None = None) -> None:
        self.dataset = dataset
        self.microbatch_size = microbatch_size
        self.sampler = sampler_for(dataset, global_batch_size, seed, (int(origin[0]), int(origin[1])))
        self.identity = identity
        self._ids: tuple[int, np.ndarray] | None = None  # the last step's ids: each is asked per microbatch

    def resume_at(self, step: int, consumed: int) -> None:
        """Go on from a checkpoint's cursor: step `step` reads from stream position `consumed` (a
        loss-spike rollback's checkpoint records a cursor moved past the samples it skips)."""
        if (step, consumed) != self.sampler.origin:
            self.sampler.origin = (int(step), int(consumed))  # the origin only places the cursor
            self._ids = None

    @property
    def origin(self) -> tuple[int, int]:
        return self.sampler.origin

    def step_ids(self, step: int) -> np.ndarray:
        # one read of the cache: the worker's reader thread asks for the next step meanwhile
        cached = self._ids
        if cached is None or cached[0] != step:
            cached = (step, self.sampler.sample_ids(step))
            self._ids = cached
        return cached[1]

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.step_ids(step)
        b = self.microbatch_size
        return self.dataset.batch(ids[index * b : (index + 1) * b])

    def read(self, reads: Reads, pin: bool = False) -> list[torch.Tensor]:
        """The windows (int64, (samples, seq_len + 1)) of each pass of `reads`: only its slices' samples,
        in their order, each pass in one buffer (pinned with `pin`)."""
        ids = self.step_ids(reads.step)
        b = self.microbatch_size
        return [self.dataset.windows(np.concatenate([ids[m * b + lo : m * b + hi] for m, lo, hi in slices])
                                     if slices else np.empty(0, dtype=np.int64), pin)
                for slices in reads.passes]

    def record(self, step: int) -> dict[str, Any]:
        """What a checkpoint of `step` records of the data (engine/checkpoint.py DATA_FILE)."""
        return {"step": step, "consumed_samples": self.sampler.cursor(step),
                "global_batch_size": self.sampler.global_batch_size, "identity": self.identity}


def data_identity(spec: DataSpec, seq_len: int, global_batch_size: int, seed: int) -> dict[str, Any]:
    """What defines the training samples and their order: each source's identity (data/dataset.py
    open_source: sizes, token counts, hashes; no whole-file read), weights, seq_len, holdout, seed and the
    sampler's version. The global batch is recorded but may change at a resume."""
    sources: list[dict[str, Any]] = []
    if spec.kind == "random":
        sources.append({"random": {"num_samples": spec.num_samples, "seed": spec.seed}})
    else:
        for path, weight in source_paths(spec):
            sources.append({"path": path, "weight": weight, **open_source(path).identity})
    return {"sampler_version": SAMPLER_VERSION, "seq_len": seq_len, "global_batch_size": global_batch_size,
            "holdout": spec.holdout, "seed": seed, "sources": sources}


def document_eos(spec: DataSpec) -> int:
    """The id that ends a document, for document masking: `data.eos_id`, which every source (and the
    validation file) that records its own must share, else the one they all record. BadInputError when
    it is unknown or they disagree: the wrong id would mask nothing, or cut documents anywhere."""
    paths = [p for p, _ in source_paths(spec)] if spec.kind == "tokens" else []
    found = {p: open_source(p).eos_id for p in paths + ([spec.validation] if spec.validation else [])}
    if spec.eos_id is not None:
        for path, eos in found.items():
            if eos is not None and eos != spec.eos_id:
                raise BadInputError(f"data.eos_id is {spec.eos_id}, but {path} ends its documents with {eos}")
        return spec.eos_id
    unknown = [p for p, eos in found.items() if eos is None] or ([] if found else ["the random data"])
    if unknown:
        raise BadInputError(f"data.document_mask: {unknown[0]} does not record which token ends a document (only "
                            f"`prepare`'s folders and byte-level token files do): give data.eos_id")
    ids = {eos for eos in found.values() if eos is not None}
    if len(ids) > 1:
        raise BadInputError("data.document_mask: the sources end their documents with different ids ("
                            + ", ".join(f"{p}: {eos}" for p, eos in found.items()) + "): prepare them alike")
    return ids.pop()


def prepare_data(job: JobSpec, checkpoint_root: str | None, step: int | None = None) -> DataSpec:
    """The job's DataSpec with its identity and the stream's origin: (0, 0), or the (step, consumed
    samples) of the checkpoint of `step` (by default the last complete one) under `checkpoint_root`,
    whose data must be this data (DataChangedError naming what changed); with document masking, the
    end-of-document id (`document_eos`). Refuses (BadInputError) a run whose steps would take more passes
    over a source than `data.epochs` allows."""
    spec, t = job.data, job.train
    identity = data_identity(spec, job.model.seq_len, t.global_batch_size, t.seed)
    origin = (0, 0)
    if step is None and checkpoint_root:
        step = latest_complete(checkpoint_root, job.model.keys())
    if step is not None:
        record = read_data_record(checkpoint_root or "", step)
        if record is None:  # written before checkpoints recorded their data: its order is unknown
            origin = (step, step * t.global_batch_size)
        else:
            changes = identity_changes(record.get("identity") or {}, identity)
            if changes:
                raise DataChangedError(f"the job resumes from the checkpoint of step {step} "
                                       f"({checkpoint_root}), which was trained on other data: "
                                       + "; ".join(changes))
            origin = (step, int(record["consumed_samples"]))
    if spec.epochs and spec.kind == "tokens":
        dataset = open_dataset(spec, job.model.seq_len, job.model.vocab_size)
        sampler = sampler_for(dataset, t.global_batch_size, t.seed, origin)
        last = max(t.steps - 1, origin[0])
        for (path, _), passes, n in zip(source_paths(spec), sampler.passes(last), sampler.sizes):
            if passes > spec.epochs:
                raise BadInputError(
                    f"data.epochs: the job's {t.steps} steps of {t.global_batch_size} samples make {passes} passes "
                    f"over {path} ({n} training samples), data.epochs allows {spec.epochs}: raise data.epochs, "
                    f"add data or lower training.steps")
    eos_id = document_eos(spec) if spec.document_mask else spec.eos_id
    return replace(spec, identity=identity, origin=origin, eos_id=eos_id)
