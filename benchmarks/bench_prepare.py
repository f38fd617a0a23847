"""`prepare` at corpus scale (issue 36): throughput per core, peak memory on CJK text, a kill half-way
and the rerun, and the output checked against the tokenizer document by document.

    python benchmarks/bench_prepare.py [--mb 200] [--cjk-mb 12] [--shard-mb 8] [--workers 1,2]
                                       [--sample 200] [--quick] [--json PATH] [--keep DIR]

Everything is made here, nothing is downloaded: a jsonl corpus of synthetic English-like text
(`--mb` MB; words drawn from a Zipf-like vocabulary, sentences, paragraphs), a CJK jsonl corpus
(`--cjk-mb` MB, including one document of half of it with no whitespace at all), and a Llama-3-style
byte-level BPE tokenizer.json (Llama 3's split regex, byte-level alphabet, <|begin_of_text|> added by
the post-processor, <|end_of_text|> as the eos) trained with the `tokenizers` library on 2 MB of
the same generator's text, vocabulary 8,192.

Measured (each a separate `python -m oobleck_slurm prepare` process, so its peak RSS is its own):
- throughput: input MB/s with `--workers` 1 and 2, per core, and the scaling efficiency
  (MB/s with N / (N x MB/s with 1)). The machine has 2 cores: scaling to 8 processes cannot be shown
  here;
- peak RSS on the CJK corpus (goal < 2 GB), as the maximum RSS of the process tree (the command and
  its workers) sampled every 50 ms, and the command's own ru_maxrss;
- a kill: the English corpus prepared again into a new folder, the process tree killed with SIGKILL
  once half of the shards are complete, then the same command again: how many shards it redid and
  skipped, and that its manifest equals the uninterrupted run's (content hash);
- correctness: `--sample` documents, chosen at random, read back through `open_prepared` equal
  `tokenizer.encode(text).ids + [eos]`.
Writes benchmarks/results/bench_prepare.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from oobleck_slurm.data.indexed import open_prepared
from oobleck_slurm.data.prepare import PIECE_CHARS

RESULTS = Path(__file__).parent / "results" / "bench_prepare.json"
REPO = Path(__file__).resolve().parents[1]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
console = Console()


def make_words(rng: random.Random, n: int = 20_000) -> list[str]:
    """Pronounceable words, so BPE finds English-like merges."""
    onsets, vowels, codas = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "st", "t", "th", "w"], \
        ["a", "e", "i", "o", "u", "ea", "ou", "ai"], ["", "n", "r", "s", "t", "nd", "ng", "ll", "ck"]
    return ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.choice((1, 1, 2, 3))))
            for _ in range(n)]


def english_doc(rng: random.Random, words: list[str], weights: list[float]) -> str:
    paragraphs = []
    for _ in range(rng.randrange(1, 6)):
        sentences = []
        for _ in range(rng.randrange(2, 9)):
            ws = rng.choices(words, weights, k=rng.randrange(5, 25))
            s = " ".join(ws).capitalize() + rng.choice(".!?.")
            if rng.random() < 0.1:
                s = s.replace(" ", f", {rng.randrange(1800, 2030)} ", 1)
            sentences.append(s)
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def cjk_doc(rng: random.Random, chars: int, lines: bool) -> str:
    base = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)] + [chr(c) for c in range(0x3041, 0x3097)]
    s = "".join(rng.choices(base, k=chars))
    return "\n".join(s[i : i + rng.randrange(40, 120)] for i in range(0, len(s), 80)) if lines else s


def write_corpora(root: Path, mb: float, cjk_mb: float) -> tuple[Path, Path, Path]:
    rng = random.Random(0)
    words = make_words(rng)
    weights = [1.0 / (i + 1) for i in range(len(words))]
    en = root / "en" / "corpus.jsonl"
    en.parent.mkdir(parents=True)
    with open(en, "w", encoding="utf-8") as f:
        while f.tell() < mb * 1e6:
            f.write(json.dumps({"text": english_doc(rng, words, weights), "source": "synthetic"}) + "\n")
    cjk = root / "cjk" / "corpus.jsonl"
    cjk.parent.mkdir(parents=True)
    with open(cjk, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": cjk_doc(rng, int(cjk_mb * 1e6 / 2 / 3), lines=False)}, ensure_ascii=False) + "\n")
        while f.tell() < cjk_mb * 1e6:
            f.write(json.dumps({"text": cjk_doc(rng, rng.randrange(200, 20_000), lines=True)}, ensure_ascii=False) + "\n")
    train = [english_doc(rng, words, weights) for _ in range(700)] + [cjk_doc(rng, 3000, True) for _ in range(200)]
    return en, cjk, build_tokenizer(root / "tokenizer" / "tokenizer.json", train)


def build_tokenizer(path: Path, texts: list[str]) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    path.parent.mkdir(parents=True)
    tok.save(str(path))
    return path


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def prepare(inputs: Path, out: Path, tok: Path, workers: int, shard_mb: int,
            kill_at: int | None = None) -> dict[str, Any]:
    """One `prepare` command; its wall time, the peak RSS of its process tree, and (with `kill_at`) a
    SIGKILL of the tree once that many shards are complete."""
    cmd = [sys.executable, "-c", "import resource, sys; from oobleck_slurm.cli import main; rc = main(sys.argv[1:]); "
           "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)",
           "prepare", str(inputs), str(out), "--tokenizer", str(tok), "--workers", str(workers),
           "--shard-size", str(shard_mb)]
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # One tokenizer thread per process (the pool's workers set it themselves): the processes are the
    # parallelism, and MB/s per core means one core per process.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    ps = psutil.Process(proc.pid)
    peak = 0
    killed = False
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        if kill_at is not None and len(list(out.glob("*.idx"))) >= kill_at:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command and the workers it reaped
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if not killed and proc.returncode != 0:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{stdout}\n{stderr}")
    maxrss = next((int(line.split()[1]) * 1024 for line in stderr.splitlines() if line.startswith("MAXRSS")), None)
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_tree_rss_bytes": peak, "command_maxrss_bytes": maxrss, "killed": killed,
            "stdout": stdout}


def check_sample(corpus: Path, out: Path, tok_path: Path, n: int, seed: int = 1) -> dict[str, Any]:
    """`n` random documents of the output equal encode(text) + [eos] of the input's documents (the
    output's documents are in input order: the document index maps straight to the jsonl line)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    data = open_prepared(out, verify=True)
    eos = data.eos_id
    assert eos is not None
    where = [(s, d) for s in data for d in range(s.num_documents)]
    lines = corpus.read_text(encoding="utf-8").splitlines()
    texts = [t for line in lines if line.strip() and (t := json.loads(line)["text"])]
    assert len(texts) == len(where), (len(texts), len(where))
    picks = sorted(random.Random(seed).sample(range(len(texts)), min(n, len(texts))))
    bad = []
    for i in picks:
        shard, d = where[i]
        b = shard.document_boundaries()
        got = shard.tokens(int(b[d]), int(b[d + 1] - b[d])).tolist()
        if got != tok.encode(texts[i]).ids + [eos]:
            bad.append(i)
    # A document longer than a piece may be cut at a character boundary where it has no whitespace
    # (docs/data.md): a few tokens at each such cut may differ. Any other mismatch is a bug.
    long_ = [i for i in bad if len(texts[i]) > PIECE_CHARS]
    return {"documents": len(texts), "checked": len(picks), "mismatched": len(bad), "mismatched_ids": bad[:20],
            "mismatched_longer_than_a_piece": len(long_)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200.0, help="English jsonl corpus size, MB")
    ap.add_argument("--cjk-mb", type=float, default=12.0, help="CJK jsonl corpus size, MB")
    ap.add_argument("--shard-mb", type=int, default=8, help="--shard-size of the runs, MiB")
    ap.add_argument("--workers", default="1,2", help="worker counts to measure")
    ap.add_argument("--sample", type=int, default=200, help="documents checked against the tokenizer")
    ap.add_argument("--quick", action="store_true", help="20 MB English, 6 MB CJK, 2 MiB shards")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary one)")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()
    if args.quick:
        args.mb, args.cjk_mb, args.shard_mb = 20.0, 6.0, 2
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_prepare."))
    if root.exists() and args.keep:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        console.print(f"generating {args.mb:g} MB English, {args.cjk_mb:g} MB CJK and a tokenizer in {root} ...")
        en, cjk, tok = write_corpora(root, args.mb, args.cjk_mb)
        en_bytes, cjk_bytes = en.stat().st_size, cjk.stat().st_size
        runs = {}
        for w in [int(x) for x in args.workers.split(",")]:
            console.print(f"English corpus, {w} worker(s) ...")
            r = prepare(en, root / f"out-en-{w}", tok, w, args.shard_mb)
            r["mb_per_s"] = en_bytes / 1e6 / r["seconds"]
            r["mb_per_s_per_core"] = r["mb_per_s"] / w
            r["mb_per_cpu_s"] = en_bytes / 1e6 / r["cpu_seconds"]
            runs[w] = r
        base = runs[min(runs)]["mb_per_s"] / min(runs)
        for w, r in runs.items():
            r["scaling_efficiency"] = r["mb_per_s"] / (w * base)
        first = open_prepared(root / f"out-en-{min(runs)}")
        same = all(open_prepared(root / f"out-en-{w}").identity() == first.identity() for w in runs)
        console.print("CJK corpus, 1 worker ...")
        cjk_run = prepare(cjk, root / "out-cjk", tok, 1, args.shard_mb)
        cjk_run["mb_per_s"] = cjk_bytes / 1e6 / cjk_run["seconds"]
        n_shards = len(first)
        console.print(f"kill: {n_shards} shards, SIGKILL once {n_shards // 2} are complete, then the same command ...")
        w_kill = max(runs)
        killed = prepare(en, root / "out-kill", tok, w_kill, args.shard_mb, kill_at=n_shards // 2)
        complete_at_kill = len(list((root / "out-kill").glob("*.idx")))
        rerun = prepare(en, root / "out-kill", tok, w_kill, args.shard_mb)
        redone = sum(1 for line in rerun["stdout"].splitlines() if line.strip().startswith("shard-"))
        kill_equal = open_prepared(root / "out-kill").identity() == first.identity()
        console.print(f"checking {args.sample} documents against the tokenizer ...")
        sample = check_sample(en, root / f"out-en-{min(runs)}", tok, args.sample)
        sample_cjk = check_sample(cjk, root / "out-cjk", tok, args.sample)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    table = Table(title=f"prepare: {en_bytes / 1e6:.0f} MB English jsonl, Llama-3-style BPE (8,192), "
                        f"{args.shard_mb} MiB shards, {os.cpu_count()} cores")
    for col in ("run", "MB/s", "MB/s per core", "scaling", "MB per CPU-s", "peak RSS (tree)", "time"):
        table.add_column(col, justify="right")
    for w, r in runs.items():
        table.add_row(f"English, {w} worker(s)", f"{r['mb_per_s']:.2f}", f"{r['mb_per_s_per_core']:.2f}",
                      f"{r['scaling_efficiency']:.0%}", f"{r['mb_per_cpu_s']:.2f}", f"{r['peak_tree_rss_bytes'] / 2**20:.0f} MiB", f"{r['seconds']:.1f} s")
    table.add_row(f"CJK {cjk_bytes / 1e6:.0f} MB, 1 worker", f"{cjk_run['mb_per_s']:.2f}", "", "",
                  f"{cjk_bytes / 1e6 / cjk_run['cpu_seconds']:.2f}",
                  f"{cjk_run['peak_tree_rss_bytes'] / 2**20:.0f} MiB", f"{cjk_run['seconds']:.1f} s")
    console.print(table)
    load = os.getloadavg()
    console.print(f"load average during the runs' end: {load[0]:.1f} (the machine's other users share its cores)")
    console.print(f"kill at {complete_at_kill}/{n_shards} shards complete: the rerun redid {redone}, skipped "
                  f"{n_shards - redone}; same content as uninterrupted: {kill_equal}")
    console.print(f"outputs with 1 and 2 workers identical: {same}; sample: {sample['checked']} English and "
                  f"{sample_cjk['checked']} CJK documents checked, {sample['mismatched'] + sample_cjk['mismatched']} "
                  "differ from encode(text) + \\[eos] (of which longer than a piece, cut where there is no "
                  f"whitespace: {sample['mismatched_longer_than_a_piece'] + sample_cjk['mismatched_longer_than_a_piece']})")
    for r in [*runs.values(), cjk_run, killed, rerun]:
        r.pop("stdout", None)
    result = {
        "benchmark": "bench_prepare", "when": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args), "loadavg_at_end": os.getloadavg(), "english_bytes": en_bytes, "cjk_bytes": cjk_bytes, "shards": n_shards,
        "runs": {str(w): r for w, r in runs.items()}, "identical_across_workers": same, "cjk": cjk_run,
        "kill": {"complete_at_kill": complete_at_kill, "shards": n_shards, "redone": redone,
                 "skipped": n_shards - redone, "equal_to_uninterrupted": kill_equal, "killed_run": killed,
                 "rerun": rerun},
        "sample_english": sample, "sample_cjk": sample_cjk,
        "goals": {"cjk_peak_rss_under_2gb": cjk_run["peak_tree_rss_bytes"] < 2 * 2**30,
                  "redoes_only_unfinished": redone == n_shards - complete_at_kill and kill_equal,
                  "sample_exact": all(x["mismatched"] == x["mismatched_longer_than_a_piece"]
                                      for x in (sample, sample_cjk))},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
