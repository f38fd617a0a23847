"""Faulty-machine detection from metrics (the Minder-style detector) on labelled synthetic traces.

    python benchmarks/bench_detection_metrics.py            # the report seeds; table + JSON
    python benchmarks/bench_detection_metrics.py --set tune # the seeds the defaults were tuned on

Traces (tests/detection/detection_traces.py): 8 fault kinds and healthy traces with a job's rhythm
(step-periodic compute/communication phases, pipeline-stage lags, checkpoints, a recovery that
idles every node, a node lost and a replacement joining, noise and single-sample glitches), on 8,
32, 128 and 1,024 machines, one sample per second, 4 minutes each. The detector runs with its
defaults (DetectorConfig()). Per kind and overall: precision, recall, F1 (per faulty machine: a
flag on a faulty machine after its fault began is a true positive, any other flag a false positive),
median detection delay (flag time - fault onset, slow-onset faults included) and the number of
healthy traces with any flag. Also the detector's time per sample at 1,024 machines (12 metrics),
from the dict input the runtime passes and from a dense array. Minder's published figures
(production faults) are shown beside them; they are not the same faults.

The tune and report sets use disjoint seeds: the defaults were chosen on the tune set only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "detection"))

from detection_traces import KINDS, METRICS, make_trace  # noqa: E402

from oobleck_slurm.detection import DetectorConfig, MinderDetector  # noqa: E402

SIZES = (8, 32, 128, 1024)
SEED_BASE = {"tune": 1_000, "report": 2_000_000}
MINDER = {"precision": 0.904, "f1": 0.893, "delay_s": 3.6}
TARGETS = {"precision": 0.95, "f1": 0.95, "delay_s": 5.0, "ms_per_sample_1024": 100.0}


def run_trace(trace, config: DetectorConfig) -> list[dict]:
    detector = MinderDetector(config)
    flags = []
    for ti, t in enumerate(trace.times):
        present = ~np.isnan(trace.values[ti, :, 0])
        nodes = [n for n, p in zip(trace.nodes, present) if p]
        flags += detector.observe_array(float(t), nodes, METRICS, trace.values[ti, present])
    return [{"node": f.node, "time": f.time, "metrics": list(f.metrics)} for f in flags]


def score(trace, flags: list[dict]) -> dict:
    tp, fp, delays = 0, 0, []
    hit = set()
    for f in flags:
        onset = trace.faulty.get(f["node"])
        if onset is not None and f["time"] >= onset and f["node"] not in hit:
            tp += 1
            hit.add(f["node"])
            delays.append(f["time"] - onset)
        else:
            fp += 1
    return {"tp": tp, "fp": fp, "fn": len(trace.faulty) - len(hit), "delays": delays}


def prf(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def evaluate(seed_set: str, per_size: int, config: DetectorConfig, kinds=KINDS, sizes=SIZES, log=print) -> dict:
    rows, traces = {}, []
    base = SEED_BASE[seed_set]
    for ki, kind in enumerate(kinds):
        agg = {"tp": 0, "fp": 0, "fn": 0, "delays": [], "traces": 0, "flagged_traces": 0, "faults": 0}
        for si, size in enumerate(sizes):
            for r in range(per_size):
                seed = base + 10_000 * ki + 100 * si + r
                trace = make_trace(kind, size, seed)
                flags = run_trace(trace, config)
                s = score(trace, flags)
                for k in ("tp", "fp", "fn"):
                    agg[k] += s[k]
                agg["delays"] += s["delays"]
                agg["traces"] += 1
                agg["faults"] += len(trace.faulty)
                agg["flagged_traces"] += bool(flags)
                traces.append({"kind": kind, "nodes": size, "seed": seed, "faulty": trace.faulty,
                               "recovery": trace.recovery, "flags": flags})
                if s["fp"] or s["fn"]:
                    log(f"  {kind} n={size} seed={seed}: fp={s['fp']} fn={s['fn']} faulty={trace.faulty} "
                        f"flags={[(f['node'], f['time'], f['metrics'][:2]) for f in flags][:4]}")
        rows[kind] = agg
    return {"rows": rows, "traces": traces}


def summarise(rows: dict) -> list[dict]:
    out = []
    total = {"tp": 0, "fp": 0, "fn": 0, "delays": [], "traces": 0, "flagged_traces": 0, "faults": 0}
    for kind, a in rows.items():
        p, r, f = prf(a["tp"], a["fp"], a["fn"])
        out.append({"kind": kind, "traces": a["traces"], "faults": a["faults"], "tp": a["tp"], "fp": a["fp"],
                    "fn": a["fn"], "precision": p, "recall": r, "f1": f,
                    "median_delay_s": statistics.median(a["delays"]) if a["delays"] else None,
                    "max_delay_s": max(a["delays"]) if a["delays"] else None,
                    "flagged_traces": a["flagged_traces"]})
        for k in ("tp", "fp", "fn", "traces", "flagged_traces", "faults"):
            total[k] += a[k]
        total["delays"] += a["delays"]
    p, r, f = prf(total["tp"], total["fp"], total["fn"])
    out.append({"kind": "overall", "traces": total["traces"], "faults": total["faults"], "tp": total["tp"],
                "fp": total["fp"], "fn": total["fn"], "precision": p, "recall": r, "f1": f,
                "median_delay_s": statistics.median(total["delays"]) if total["delays"] else None,
                "max_delay_s": max(total["delays"]) if total["delays"] else None,
                "flagged_traces": total["flagged_traces"]})
    return out


def time_per_sample(nodes: int = 1024, samples: int = 120, seed: int = 7) -> dict:
    trace = make_trace("healthy", nodes, seed, duration=samples)
    dict_samples = list(trace.samples())
    detector = MinderDetector()
    times = []
    for t, sample in dict_samples:
        t0 = time.perf_counter()
        detector.observe(t, sample)
        times.append(time.perf_counter() - t0)
    detector = MinderDetector()
    array_times = []
    for ti, t in enumerate(trace.times):
        present = ~np.isnan(trace.values[ti, :, 0])
        nodes_now = [n for n, p in zip(trace.nodes, present) if p]
        t0 = time.perf_counter()
        detector.observe_array(float(t), nodes_now, METRICS, trace.values[ti, present])
        array_times.append(time.perf_counter() - t0)
    return {"nodes": nodes, "metrics": len(METRICS), "samples": samples,
            "dict_ms_median": 1e3 * statistics.median(times), "dict_ms_p99": 1e3 * float(np.percentile(times, 99)),
            "array_ms_median": 1e3 * statistics.median(array_times)}


def fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SEED_BASE), default="report", help="which seeds (default: report)")
    parser.add_argument("--per-size", type=int, default=3, help="traces per kind and machine count (default 3)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "bench_detection_metrics.json")
    parser.add_argument("--quiet", action="store_true", help="do not list the misses and false flags")
    args = parser.parse_args()
    if args.per_size < 1:
        parser.error(f"--per-size must be >= 1, got {args.per_size}")
    console = Console(width=max(Console().width, 150))  # the table is wide; never squeeze it into 80 columns
    config = DetectorConfig()
    t0 = time.time()
    result = evaluate(args.set, args.per_size, config, log=(lambda *_: None) if args.quiet else print)
    summary = summarise(result["rows"])
    speed = time_per_sample()

    table = Table(title=f"Minder-style detector, synthetic traces ({args.set} seeds), sizes {', '.join(map(str, SIZES))}")
    for col in ("kind", "traces", "faulty machines", "TP", "FP", "FN", "precision", "recall", "F1",
                "median delay s", "max delay s", "traces flagged"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for s in summary:
        table.add_row(s["kind"], str(s["traces"]), str(s["faults"]), str(s["tp"]), str(s["fp"]), str(s["fn"]),
                      fmt(s["precision"]), fmt(s["recall"]), fmt(s["f1"]), fmt(s["median_delay_s"], 1),
                      fmt(s["max_delay_s"], 0), str(s["flagged_traces"]), end_section=s["kind"] == "straggler")
    console.print(table)
    overall = summary[-1]
    healthy = next(s for s in summary if s["kind"] == "healthy")
    side = Table(title="Overall vs Minder (published, production faults) and the targets")
    for col in ("", "precision", "F1", "median delay s", "ms/sample @1024", "healthy traces flagged"):
        side.add_column(col, justify="right")
    side.add_row("this detector", fmt(overall["precision"]), fmt(overall["f1"]), fmt(overall["median_delay_s"], 1),
                 f"{speed['dict_ms_median']:.1f} (array {speed['array_ms_median']:.1f})",
                 f"{healthy['flagged_traces']}/{healthy['traces']}")
    side.add_row("Minder (published)", fmt(MINDER["precision"]), fmt(MINDER["f1"]), f"{MINDER['delay_s']:.1f} (mean)", "-", "-")
    side.add_row("target", ">= 0.95", ">= 0.95", "<= 5", "< 100", "0")
    console.print(side)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "seed_set": args.set, "per_size": args.per_size, "sizes": SIZES, "seconds": time.time() - t0,
        "config": {k: getattr(config, k) for k in ("interval", "window", "continuity", "threshold", "clip", "rel_floor", "grace",
                                                   "baseline", "offset_cap", "min_nodes")},
        "summary": summary, "speed": speed, "minder_published": MINDER, "targets": TARGETS,
        "traces": result["traces"]}, indent=1))
    console.print(f"wrote {args.json} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
