"""`prepare INPUT... OUT`: tokenize a corpus into a folder of Megatron shards (+ manifest.json), or, when
OUT ends in `.bin`, one text file into a flat token file (+ JSON sidecar). docs/data.md."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.markup import escape

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus into Megatron-format shards (or one text file into a flat token file)",
        description="Tokenize INPUTs (files, folders searched recursively, globs; .jsonl, .parquet, text; "
        ".gz/.zst compressed) into the folder OUT: numbered shards PREFIX.bin + PREFIX.idx in Megatron's "
        "indexed format and manifest.json. Rerunning the same command redoes only unfinished shards. "
        "With OUT ending in .bin and one text file: the flat token file (+ OUT.json) of that text.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT... OUT",
                        help="what to tokenize, then where to write it (a folder, or FILE.bin)")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (default: vocabulary 256, nothing to download), a Hugging Face tokenizer.json "
        "or a folder holding one (needs the 'tokenizers' library), or a factory "
        "'package.module:function' returning an object with encode(str) and vocab_size",
    )
    parser.add_argument("--text-key", default="text",
                        help="the key of a jsonl object, or the column of a parquet file, holding the text (default: text)")
    parser.add_argument("--eos", default=None,
                        help="the end-of-document token appended to every document (a token of the tokenizer, or "
                        "an id); default: the tokenizer's own (tokenizer_config.json's eos_token, a known name, a "
                        "factory's eos_token_id), NUL (0) for the byte tokenizer")
    parser.add_argument("--workers", type=_positive, default=None,
                        help="processes on this node (default: the CPUs this process may use)")
    parser.add_argument("--shard-of", default=None, metavar="K/N",
                        help="prepare only shards i with i %% N == K (default: from SLURM_ARRAY_TASK_ID/COUNT "
                        "and SLURM_PROCID/SLURM_STEP_NUM_TASKS, else all)")
    parser.add_argument("--shard-size", type=_positive, default=256, metavar="MB",
                        help="input megabytes (MiB) per shard: the unit of parallelism and of resumption (default 256)")


def run(args: argparse.Namespace) -> int:
    *inputs, out_arg = args.inputs
    out = Path(out_arg)
    if not inputs:
        return fail("give at least one INPUT and then OUT (a folder, or FILE.bin)", EXIT_BAD_INPUT)
    if out_arg.endswith(".bin"):
        if len(inputs) != 1:
            return fail(f"output {out} is one flat token file, made from one text file; for {len(inputs)} inputs "
                        "give a folder", EXIT_BAD_INPUT)
        return _flat(Path(inputs[0]), out, args.tokenizer)
    return _corpus(inputs, out, args)


def _flat(text: Path, out: Path, tokenizer: str) -> int:
    from oobleck_slurm.data import TokenizerError, prepare  # numpy import kept out of --help

    if not text.is_file():
        return fail(f"text file {text} does not exist", EXIT_BAD_INPUT)
    if out.is_dir():
        return fail(f"output {out} is a directory; give a file path such as {out}/tokens.bin")
    start = time.perf_counter()
    try:
        meta = prepare(text, out, tokenizer)
    except TokenizerError as e:
        return fail(str(e))
    except (ValueError, OSError) as e:
        return fail(f"cannot prepare {text}: {e}")
    seconds = time.perf_counter() - start
    console.print(
        f"[bold green]✓[/] wrote [bold]{meta.num_tokens:,}[/] tokens ({meta.dtype}, vocabulary "
        f"{meta.vocab_size:,}, tokenizer {escape(str(meta.tokenizer))}) to {escape(str(out))} in {seconds:.2f} s",
        highlight=False,
    )
    return EXIT_OK


def _corpus(inputs: list[str], out: Path, args: argparse.Namespace) -> int:
    from oobleck_slurm.data.prepare import prepare_corpus  # numpy import kept out of --help
    from oobleck_slurm.errors import BadInputError

    start = time.perf_counter()

    def on_shard(name: str, counts: dict[str, int] | None) -> None:
        if counts is None:
            return
        console.print(f"  {escape(name)}: {counts['num_tokens']:,} tokens, {counts['num_documents']:,} documents "
                      f"({time.perf_counter() - start:.1f} s)", highlight=False)

    eos: str | int | None = args.eos
    try:
        result = prepare_corpus(inputs, out, args.tokenizer, text_key=args.text_key, workers=args.workers,
                                shard_of=args.shard_of, shard_bytes=args.shard_size << 20, eos=eos,
                                on_shard=on_shard)
    except BadInputError as e:
        return fail(str(e))
    except (ValueError, OSError) as e:
        return fail(f"cannot prepare {', '.join(inputs)}: {e}")
    seconds = time.perf_counter() - start
    rate = result.input_bytes / seconds / 1e6 if seconds > 0 else 0.0
    share = f" (this task's share: {result.mine} of {result.shards})" if result.mine != result.shards else ""
    console.print(
        f"[bold green]✓[/] {result.done} shard(s) prepared, {result.skipped} already complete{share}: "
        f"{result.num_tokens:,} tokens from {result.input_bytes / 1e6:,.1f} MB in {seconds:.1f} s ({rate:.1f} MB/s)",
        highlight=False)
    m = result.manifest
    if m is None:
        console.print(f"  {escape(str(out))}: other tasks' shards are not all complete yet; the last task to finish "
                      "writes manifest.json (or run this command again without --shard-of)", highlight=False)
    else:
        console.print(f"  {escape(str(out / 'manifest.json'))}: {len(m['shards'])} shards, {m['num_tokens']:,} tokens, "
                      f"{m['num_documents']:,} documents, content {m['content_hash'][:16]}", highlight=False)
    return EXIT_OK
