"""Opening a job's dataset in a worker, and the microbatches of one pipeline for one step.

Which samples a step trains on comes from `GlobalBatchSampler` (by step and global index only); a
pipeline takes its contiguous microbatch slice of them. So a plan change never changes the data.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from oobleck_slurm.data import GlobalBatchSampler, TokenDataset, TokenFile
from oobleck_slurm.engine.spec import DataSpec


class Dataset(Protocol):
    num_samples: int

    def batch(self, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...


class RandomTokens:
    """`num_samples` uniformly random token sequences from `seed`: same (x, y) layout as TokenDataset."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.num_samples = num_samples
        self._tokens = torch.from_numpy(rng.integers(0, vocab_size, (num_samples, seq_len + 1)))

    def batch(self, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._tokens[torch.as_tensor(np.asarray(sample_ids, dtype=np.int64))]
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class SampleRange:
    """Samples [start, stop) of another dataset, numbered from 0."""

    def __init__(self, dataset: Dataset, start: int, stop: int) -> None:
        self.dataset, self.start, self.num_samples = dataset, start, stop - start

    def batch(self, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(np.asarray(sample_ids, dtype=np.int64) + self.start)


def open_dataset(spec: DataSpec, seq_len: int, vocab_size: int) -> Dataset:
    """The training samples (without the validation samples held out of them)."""
    data = _open(spec, spec.path, seq_len, vocab_size)
    if spec.holdout:
        if data.num_samples <= spec.holdout:
            raise ValueError(f"data: {spec.path or 'the random data'} has {data.num_samples} samples of seq_len "
                             f"{seq_len}; holding {spec.holdout} out for validation (training.eval_samples) leaves none to train on")
        return SampleRange(data, 0, data.num_samples - spec.holdout)
    return data


def open_validation(spec: DataSpec, seq_len: int, vocab_size: int, samples: int) -> Dataset:
    """The first `samples` validation samples: of `spec.validation`, or those held out of training."""
    if spec.validation is not None:
        data = _open(spec, spec.validation, seq_len, vocab_size)
        if data.num_samples < samples:
            raise ValueError(f"data.validation: {spec.validation} has {data.num_samples} samples of seq_len {seq_len}, "
                             f"fewer than training.eval_samples ({samples})")
        return SampleRange(data, 0, samples)
    data = _open(spec, spec.path, seq_len, vocab_size)
    if spec.holdout < samples:
        raise ValueError(f"data: {spec.holdout} samples held out for validation, {samples} asked for")
    return SampleRange(data, data.num_samples - spec.holdout, data.num_samples - spec.holdout + samples)


def _open(spec: DataSpec, path: str | None, seq_len: int, vocab_size: int) -> Dataset:
    if spec.kind == "random":
        return RandomTokens(spec.num_samples, seq_len, vocab_size, spec.seed)
    assert path is not None  # DataSpec requires a path for kind 'tokens'
    tf = TokenFile(path)
    if tf.meta.vocab_size > vocab_size:
        raise ValueError(
            f"data: {path} was tokenized with a vocabulary of {tf.meta.vocab_size} ids, "
            f"but the model's vocab_size is {vocab_size}"
        )
    return TokenDataset(tf, seq_len)


class StepBatches:
    """The (x, y) of every microbatch of a step, by global microbatch index."""

    def __init__(self, dataset: Dataset, global_batch_size: int, microbatch_size: int, seed: int) -> None:
        self.dataset = dataset
        self.microbatch_size = microbatch_size
        self.sampler = GlobalBatchSampler(dataset.num_samples, global_batch_size, seed)

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.sampler.sample_ids(step)
        b = self.microbatch_size
        return self.dataset.batch(ids[index * b : (index + 1) * b])
