"""Training samples cut from a token file: non-overlapping windows of seq_len + 1 tokens.

Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1]; x is its first seq_len tokens and y the
same window shifted by one (the next-token targets). Consecutive samples share one boundary token,
so every token except the very last is a target exactly once per epoch.
"""

from __future__ import annotations

import numpy as np
import torch

from oobleck_slurm.data.tokens import TokenFile


class TokenDataset:
    """The samples of `token_file` for sequences of `seq_len` tokens."""

    def __init__(self, token_file: TokenFile, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.token_file = token_file
        self.seq_len = seq_len
        self.num_samples = max(0, (len(token_file) - 1) // seq_len)
        if self.num_samples == 0:
            raise ValueError(
                f"{token_file.path} has {len(token_file)} tokens, too few for one sample of "
                f"seq_len {seq_len} (needs {seq_len + 1})"
            )

    def __len__(self) -> int:
        return self.num_samples

    def window(self, sample_id: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample `sample_id` (a view of the memmap)."""
        if not 0 <= sample_id < self.num_samples:
            raise IndexError(f"sample {sample_id} outside [0, {self.num_samples})")
        start = sample_id * self.seq_len
        return self.token_file.tokens[start : start + self.seq_len + 1]

    def batch(self, sample_ids: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each int64 of shape (len(sample_ids), seq_len)."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        windows = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, sid in enumerate(ids):
            windows[row] = self.window(int(sid))
        t = torch.from_numpy(windows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
