"""`prepare TEXT OUT [--tokenizer byte|tokenizer.json|pkg.mod:fn]`: tokenize a text file into a token file."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.markup import escape

from oobleck_slurm.commands.common import console, fail
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize a text file into a flat token file (+ JSON sidecar) for training",
    )
    parser.add_argument("text", type=Path, help="UTF-8 text file to tokenize")
    parser.add_argument("out", type=Path, help="token file to write (its sidecar is OUT.json)")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (default: vocabulary 256, nothing to download), a Hugging Face tokenizer.json "
        "or a folder holding one (needs the 'tokenizers' library), or a factory "
        "'package.module:function' returning an object with encode(str) and vocab_size",
    )


def run(args: argparse.Namespace) -> int:
    from oobleck_slurm.data import TokenizerError, prepare  # numpy import kept out of --help

    if not args.text.is_file():
        return fail(f"text file {args.text} does not exist", EXIT_BAD_INPUT)
    if args.out.is_dir():
        return fail(f"output {args.out} is a directory; give a file path such as {args.out}/tokens.bin")
    start = time.perf_counter()
    try:
        meta = prepare(args.text, args.out, args.tokenizer)
    except TokenizerError as e:
        return fail(str(e))
    except (ValueError, OSError) as e:
        return fail(f"cannot prepare {args.text}: {e}")
    seconds = time.perf_counter() - start
    console.print(
        f"[bold green]✓[/] wrote [bold]{meta.num_tokens:,}[/] tokens ({meta.dtype}, vocabulary "
        f"{meta.vocab_size:,}, tokenizer {escape(str(meta.tokenizer))}) to {escape(str(args.out))} in {seconds:.2f} s",
        highlight=False,
    )
    return EXIT_OK
