"""The global batch sampler at pretraining scale: the O(1) bijection sampler against the permutation
sampler it replaced (issue 36), side by side.

    python benchmarks/bench_sampler.py [--samples 244140625] [--batch 512] [--old-samples N] [--json PATH]

244,140,625 samples of seq_len 4096 are 1T tokens. For each sampler, in a fresh process (so the RSS
is its own): open (construct), the first step, the step that crosses the end of the first pass, a
"replacement's first step" (a fresh sampler asked for step 10^6 directly), and the RSS growth over
the process's RSS after imports (ru_maxrss, the peak). The old sampler is version 1 of
data/sampler.py, kept here verbatim in `PermutationSampler`: it materialises
`rng.permutation(num_samples)` for each pass it touches. Targets for the new one: open, first step
and crossing step each < 1 s, RSS growth < 100 MB. Writes benchmarks/results/bench_sampler.json;
exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "bench_sampler.json"


class PermutationSampler:
    """Version 1 of GlobalBatchSampler (the code this issue replaced): one permutation per epoch."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self._cache: dict[int, np.ndarray] = {}

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            perm = rng.permutation(self.num_samples).astype(np.int64)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm

    def sample_ids(self, step: int) -> np.ndarray:
        out = np.empty(self.global_batch_size, dtype=np.int64)
        pos, filled = step * self.global_batch_size, 0
        while filled < self.global_batch_size:
            epoch, offset = divmod(pos + filled, self.num_samples)
            take = min(self.global_batch_size - filled, self.num_samples - offset)
            out[filled : filled + take] = self.epoch_permutation(epoch)[offset : offset + take]
            filled += take
        return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(kind: str, samples: int, batch: int) -> dict[str, float]:
    """One sampler's timings, in this process (run it in a fresh one)."""
    from oobleck_slurm.data.sampler import GlobalBatchSampler

    def make() -> GlobalBatchSampler | PermutationSampler:
        return GlobalBatchSampler(samples, batch, 0) if kind == "bijection" else PermutationSampler(samples, batch, 0)

    base = rss_mb()
    out: dict[str, float] = {}
    t = time.perf_counter()
    s = make()
    out["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    s.sample_ids(0)
    out["first_step_s"] = time.perf_counter() - t
    crossing = samples // batch  # its positions run from before the end of pass 0 into pass 1
    t = time.perf_counter()
    s.sample_ids(crossing)
    out["crossing_step_s"] = time.perf_counter() - t
    t = time.perf_counter()
    s.sample_ids(crossing + 1)
    out["next_step_s"] = time.perf_counter() - t
    del s
    t = time.perf_counter()
    make().sample_ids(10**6)  # a replacement process: a fresh sampler, straight at a late step
    out["replacement_first_step_s"] = time.perf_counter() - t
    out["rss_growth_mb"] = rss_mb() - base
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=244_140_625)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--old-samples", type=int, default=None, help="samples for the old sampler (default: --samples)")
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--one", choices=["bijection", "permutation"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.samples, args.batch)))
        return 0
    rows = {}
    for kind, n in (("bijection", args.samples), ("permutation", args.old_samples or args.samples)):
        run = subprocess.run([sys.executable, __file__, "--one", kind, "--samples", str(n), "--batch", str(args.batch)],
                             capture_output=True, text=True, check=True)
        rows[kind] = {"samples": n, **json.loads(run.stdout.strip().splitlines()[-1])}
    keys = ["open_s", "first_step_s", "crossing_step_s", "next_step_s", "replacement_first_step_s", "rss_growth_mb"]
    print(f"{'':26}{'bijection (v2)':>16}{'permutation (v1)':>18}")
    print(f"{'samples':26}{rows['bijection']['samples']:>16,}{rows['permutation']['samples']:>18,}")
    for k in keys:
        print(f"{k:26}{rows['bijection'][k]:>16.4f}{rows['permutation'][k]:>18.4f}")
    new = rows["bijection"]
    ok = (new["open_s"] < 1 and new["first_step_s"] < 1 and new["crossing_step_s"] < 1
          and new["replacement_first_step_s"] < 1 and new["rss_growth_mb"] < 100)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"batch": args.batch, "samplers": rows, "targets_met": ok}, indent=2) + "\n")
    print(f"targets (new: each < 1 s, RSS growth < 100 MB): {'met' if ok else 'MISSED'}; wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
