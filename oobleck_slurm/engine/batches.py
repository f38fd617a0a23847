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


def open_dataset(spec: DataSpec, seq_len: int, vocab_size: int) -> Dataset:
    if spec.kind == "random":
        return RandomTokens(spec.num_samples, seq_len, vocab_size, spec.seed)
    assert spec.path is not None  # DataSpec requires a path for kind 'tokens'
    tf = TokenFile(spec.path)
    if tf.meta.vocab_size > vocab_size:
        raise ValueError(
            f"data: {spec.path} was tokenized with a vocabulary of {tf.meta.vocab_size} ids, "
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
