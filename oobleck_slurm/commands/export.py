"""`export JOB [--step S] --format hf --out DIR`: a job's checkpoint as a Hugging Face model folder.

DIR gets config.json, model.safetensors (sharded with model.safetensors.index.json above
--max-shard-size) and, when the job tokenized its text with a tokenizer.json, that tokenizer's files;
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it. The checkpoint is the final one
(written when training ends) unless --step names a periodic or on-demand one.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_OK

if TYPE_CHECKING:  # imported when the command runs, not when the CLI starts
    from collections.abc import Iterator

    import torch

    from oobleck_slurm.cluster.jobdir import JobDir

FORMATS = ("hf",)
# Besides tokenizer.json, the files Hugging Face keeps beside it (special tokens, chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a job's checkpoint as a Hugging Face model folder")
    parser.add_argument("job", help="job folder, or a job id under --job-root")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (created; its weight files replaced)")
    parser.add_argument("--format", choices=FORMATS, default="hf", help="hf: config.json + safetensors (default)")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint to export (default: the latest complete one, the final model)")
    parser.add_argument("--max-shard-size", default="5GB", help="split the weights into files of at most this size")
    parser.add_argument("--job-root", type=Path, default=Path("jobs"), help="where job ids are looked up (default: jobs)")


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.cluster.jobdir import JobNotFound, find_job
    from oobleck_slurm.engine.checkpoint import CheckpointError, latest_complete, layer_file, read_layer_file
    from oobleck_slurm.engine.spec import JobSpec
    from oobleck_slurm.models.hf import HFError, hf_adapter, save_hf
    from oobleck_slurm.recipe.schema import parse_bytes

    try:
        max_shard = parse_bytes(args.max_shard_size)
    except ValueError as err:
        return fail(f"--max-shard-size: {err}")
    try:
        job = find_job(args.job, args.job_root)
    except JobNotFound as err:
        return fail(str(err))
    if not job.job_spec.is_file():
        return fail(f"{job.path}: the job has not started ({job.job_spec.name} is missing): nothing to export")
    spec = JobSpec.from_json(job.job_spec.read_text())
    model, keys = spec.model.config, spec.model.keys()
    try:
        hf_adapter(model)
    except NotImplementedError as err:
        return fail(f"{job.path}: {err}; --format hf needs a built-in family (gpt, llama)")
    step = args.step if args.step is not None else latest_complete(job.checkpoints, keys)
    if step is None:
        return fail(f"{job.checkpoints}: no complete checkpoint (a job writes one when training ends, and every "
                    f"fault_tolerance.checkpoint_interval steps)")
    missing = [k for k in keys if not layer_file(job.checkpoints, step, k).is_file()]
    if missing:
        return fail(f"{job.checkpoints}: the checkpoint of step {step} lacks {len(missing)} of {len(keys)} layers "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")

    def layer_states() -> Iterator[tuple[int, dict[str, torch.Tensor]]]:  # one layer in memory at a time: {parameter or persistent buffer name: tensor}
        for index, key in enumerate(keys):
            tensors = read_layer_file(layer_file(job.checkpoints, step, key), step)
            yield index, {name.split(".", 1)[1]: t for name, t in tensors.items()
                          if name.startswith(("param.", "buffer."))}

    try:
        files = save_hf(args.out, model, layer_states(), max_shard_bytes=max_shard)
    except (CheckpointError, HFError, OSError) as err:
        return fail(str(err))
    files += _copy_tokenizer(job, args.out)
    size = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    console.print(f"[bold green]✓[/] exported step {step} of {escape(job.job_id)} ({model.describe()}) to "
                  f"{escape(str(args.out))}: {len(files)} files, {size / 2**20:,.1f} MiB of weights", highlight=False)
    return EXIT_OK


def _copy_tokenizer(job: JobDir, out: Path) -> list[Path]:
    """The tokenizer.json the job prepared its text with, and the files Hugging Face keeps beside it."""
    from oobleck_slurm.data.hf_tokenizer import tokenizer_json
    from oobleck_slurm.data.tokenizers import is_hf_spec
    from oobleck_slurm.engine.from_recipe import tokenizer_for

    tokenizer = tokenizer_for(job.recipe())
    if not is_hf_spec(tokenizer):
        return []
    source = tokenizer_json(tokenizer)
    copied = []
    for name in TOKENIZER_FILES:
        found = source if name == "tokenizer.json" else source.parent / name
        if found.is_file():
            copied.append(Path(shutil.copyfile(found, out / name)))
    return copied
