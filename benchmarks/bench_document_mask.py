"""The cost of document masking (`data.document_mask`, models/documents.py) on the CPU: a microbatch's forward
and backward through the whole model with masking off (SDPA, is_causal) and on (SDPA with a boolean
block-diagonal causal mask, positions restarting at each document), side by side.

    python benchmarks/bench_document_mask.py [--models gpt:tiny gpt:mini ...] [--microbatch 4] [--doc-len 32]
                                             [--repeats 30] [--threads 1] [--json PATH]

A model is FAMILY:SIZE[:SEQ_LEN] (a preset, its seq_len overridden by SEQ_LEN). The windows are cut, as
training cuts them, from a stream of documents of random lengths (uniform, mean `--doc-len` tokens) each
ended by the eos. Per model: the median over `--repeats` rounds (off and on alternate within a round, so
that the machine's load moves both alike) of one forward + backward of the full model on one
microbatch (fp32), of building the microbatch's `Documents` (part of the "on" time), and of one
attention layer's kernel alone (SDPA forward + backward at the model's head shape); the mask's size. Writes benchmarks/results/bench_document_mask.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from oobleck_slurm.models import preset
from oobleck_slurm.models.documents import Documents, causal_attention, run_layer
from oobleck_slurm.models.loss import lm_loss

RESULTS = Path(__file__).parent / "results" / "bench_document_mask.json"
EOS = 0


def windows(seq_len: int, rows: int, doc_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """`rows` windows of seq_len + 1 tokens of a stream of documents of 1 .. 2 * doc_len - 1 tokens."""
    rng = np.random.default_rng(seed)
    stream: list[int] = []
    while len(stream) < rows * seq_len + 1:
        stream += list(rng.integers(1, vocab, int(rng.integers(1, 2 * doc_len)))) + [EOS]
    tokens = torch.tensor(stream, dtype=torch.int64)
    return torch.stack([tokens[r * seq_len : r * seq_len + seq_len + 1] for r in range(rows)])


def step(layers: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor, masked: bool) -> tuple[float, float]:
    """Seconds of one forward + backward, and of building the documents (0 when off)."""
    t0 = time.perf_counter()
    documents = Documents.of(x, EOS) if masked else None
    t1 = time.perf_counter()
    h = x
    for layer in layers:
        h = run_layer(layer, h, documents)
    lm_loss(h, y).backward()
    return time.perf_counter() - t0, t1 - t0


def attention(documents: Documents | None, shape: tuple[int, ...]) -> float:
    """Seconds of one attention layer's kernel alone, forward + backward, on random q, k, v of `shape`."""
    q, k, v = (torch.randn(shape, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(3))
    t0 = time.perf_counter()
    causal_attention(q, k, v, documents).sum().backward()
    return time.perf_counter() - t0


def measure(name: str, microbatch: int, doc_len: int, repeats: int) -> dict:
    family, size, *seq = name.split(":")
    cfg = preset(family, size, **({"seq_len": int(seq[0])} if seq else {}))
    layers = cfg.build_layers(0, 0, cfg.num_layers)
    w = windows(cfg.seq_len, microbatch, doc_len, cfg.vocab_size)
    x, y = w[:, :-1], w[:, 1:]
    for masked in (False, True, False, True):  # warm-up
        step(layers, x, y, masked)
    documents = Documents.of(x, EOS)
    shape = (microbatch, cfg.n_head, cfg.seq_len, cfg.d_model // cfg.n_head)  # type: ignore[attr-defined]
    off, on, build, kernel_off, kernel_on = [], [], [], [], []
    for _ in range(repeats):
        off.append(step(layers, x, y, False)[0])
        seconds, built = step(layers, x, y, True)
        on.append(seconds)
        build.append(built)
        kernel_off.append(attention(None, shape))
        kernel_on.append(attention(documents, shape))
    median_off, median_on = statistics.median(off), statistics.median(on)
    return {"model": name, "family": family, "layers": cfg.num_layers, "seq_len": cfg.seq_len,
            "microbatch": microbatch, "documents_per_row": float((x == EOS).sum()) / microbatch + 1,
            "off_ms": 1e3 * median_off, "on_ms": 1e3 * median_on, "on_over_off": median_on / median_off,
            "documents_ms": 1e3 * statistics.median(build), "mask_bytes": documents.mask.numel(),
            "attention_off_ms": 1e3 * statistics.median(kernel_off), "attention_on_ms": 1e3 * statistics.median(kernel_on),
            "off_all_ms": [1e3 * s for s in off], "on_all_ms": [1e3 * s for s in on]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt:tiny", "gpt:mini", "llama:tiny", "llama:mini",
                                                       "gpt:mini:1024"])
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=32, help="mean document length in tokens")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least noise when shared)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(m, args.microbatch, args.doc_len, args.repeats) for m in args.models]
    print(f"torch {torch.__version__}, {args.threads} thread(s), microbatch {args.microbatch}, "
          f"mean document {args.doc_len} tokens; median of {args.repeats} (forward + backward, fp32)")
    print(f"{'model':<16} {'seq':>5} {'docs/row':>8} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'Documents ms':>12} "
          f"{'mask':>10} {'attn off ms':>11} {'attn on ms':>10}")
    for r in rows:
        print(f"{r['model']:<16} {r['seq_len']:>5} {r['documents_per_row']:>8.1f} {r['off_ms']:>8.2f} "
              f"{r['on_ms']:>8.2f} {r['on_over_off']:>7.2f} {r['documents_ms']:>12.3f} {r['mask_bytes']:>10,} "
              f"{r['attention_off_ms']:>11.2f} {r['attention_on_ms']:>10.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"torch": torch.__version__, "threads": args.threads,
                                     "microbatch": args.microbatch, "doc_len": args.doc_len,
                                     "repeats": args.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
