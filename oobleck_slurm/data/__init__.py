"""Token data: the flat token file, its preparation, samples and the global batch sampler.

    tokens      `TokenFile` (memmap + JSON sidecar) and its metadata
    tokenizers  the byte tokenizer, a Hugging Face tokenizer.json (hf_tokenizer), user factories
                `package.module:function`
    prepare     text -> token file, streaming and atomic; `prepared`: reused while current
    dataset     `TokenDataset`: non-overlapping (x, y) windows
    sampler     `GlobalBatchSampler`: which samples step s trains on, plan-independent
    default     the shipped public-domain text, prepared into a cache on first use
"""

from oobleck_slurm.data.dataset import TokenDataset
from oobleck_slurm.data.default import DEFAULT_TEXT, cache_file, default_token_file
from oobleck_slurm.data.prepare import prepare, prepared
from oobleck_slurm.data.sampler import GlobalBatchSampler, contiguous_slices, pipeline_sample_ids
from oobleck_slurm.data.tokenizers import ByteTokenizer, TokenizerError, load_tokenizer
from oobleck_slurm.data.tokens import TokenFile, TokenFileError, TokenFileMeta

__all__ = [
    "DEFAULT_TEXT",
    "ByteTokenizer",
    "GlobalBatchSampler",
    "TokenDataset",
    "TokenFile",
    "TokenFileError",
    "TokenFileMeta",
    "TokenizerError",
    "cache_file",
    "contiguous_slices",
    "default_token_file",
    "load_tokenizer",
    "pipeline_sample_ids",
    "prepare",
    "prepared",
]
