"""Token data: corpora and their preparation, token files, samples, mixtures and the batch sampler.

    corpus      `prepare`'s inputs: files, folders, globs of jsonl, parquet and text (.gz/.zst)
    prepare     a corpus -> Megatron shards + manifest (`prepare_corpus`); one text -> a flat token
                file, streaming and atomic (`prepare`); `prepared`: reused while current
    indexed     Megatron's indexed .bin/.idx format: reader (`open_prepared`), writer, prepared folders
    tokens      `TokenFile` (memmap + JSON sidecar) and its metadata
    tokenizers  the byte tokenizer, a Hugging Face tokenizer.json (hf_tokenizer), user factories
                `package.module:function`; their protocol and error in tokenizer_base
    dataset     `TokenDataset`: non-overlapping (x, y) windows; `open_source`: one source, identified
    sampler     `GlobalBatchSampler`: which samples step s trains on, plan-independent, O(1) per step
                (a keyed Feistel bijection per source and pass)
    mixture     weighted sources interleaved by integer quotas over a fixed cycle
    default     the shipped public-domain text, prepared into a cache on first use

docs/data.md describes them.
"""

from oobleck_slurm.data.dataset import TokenDataset
from oobleck_slurm.data.default import DEFAULT_TEXT, cache_file, default_token_file
from oobleck_slurm.data.prepare import prepare, prepared
from oobleck_slurm.data.sampler import GlobalBatchSampler, contiguous_slices, pipeline_sample_ids
from oobleck_slurm.data.tokenizer_base import TokenizerError
from oobleck_slurm.data.tokenizers import ByteTokenizer, load_tokenizer
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
