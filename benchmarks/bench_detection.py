"""Detection time per failure kind on the real local Slurm lab, against Slurm's own DOWN time measured
in the same run, and end to end (fault -> training resumed -> replacement joined).

    bash tests/slurm/start.sh && python benchmarks/bench_detection.py [--repeats 3] [--kinds node,agent,...]

Each job (`submit --detach`, 4 lab nodes, a tiny GPT, `replacement: request`) takes FAULTS_PER_JOB
faults one after the other, each on another non-batch node once the previous replacement joined; the
kinds rotate so that one job sees different kinds. Kinds (tests/slurm/drill.py): node, agent, worker,
hang, down, freeze. Prints a table of medians and writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FAULTS_PER_JOB = 3  # one per non-batch node of the 4-node job: the batch node hosts the supervisor


def lab_file(stem: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"oobleck_slurm_tests_{stem}", REPO / "tests" / "slurm" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cli(work: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)


def one_job(lab: Any, drill: ModuleType, kinds: list[str], work: Path) -> list[dict]:
    """Submit a job, inject `kinds` into its non-batch nodes in turn, cancel it; one row per fault."""
    recipe = work / "bench.yaml"
    recipe.write_text(drill.RECIPE.format(repo=REPO))
    done = cli(work, "submit", str(recipe), "--detach")
    if done.returncode != 0:
        raise RuntimeError(f"submit failed: {done.stdout}{done.stderr}")
    (job,) = (work / "jobs").iterdir()
    rows = []
    try:
        start = drill.wait_event(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"], 60)[0]
        drill.wait_event(job, "first steps", lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 3], 120)
        for node, kind in zip(start["nodes"][1:], kinds):
            row = {**drill.drill(lab, job, node, kind).row(), "job": job.name}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        cli(work, "cancel", str(job), timeout=60)
        lab.reset()
    return rows


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        rs = [r for r in rows if r["kind"] == kind]
        detect, down = median(rs, "detection_s"), median(rs, "slurm_down_s")
        ratios = [r["slurm_down_s"] / r["detection_s"] for r in rs if r["slurm_down_s"] and r["detection_s"]]
        out.append({"kind": kind, "n": len(rs), "causes": sorted({r["cause"] for r in rs}),
                    "detection_s": detect, "detection_range_s": [min(r["detection_s"] for r in rs),
                                                                 max(r["detection_s"] for r in rs)],
                    "slurm_down_s": down, "slurm_down_over_detection": statistics.median(ratios) if ratios else None,
                    "resumed_s": median(rs, "resumed_s"), "recovery_s": median(rs, "recovery_s"),
                    "joined_s": median(rs, "joined_s")})
    return out


def table(summaries: list[dict]) -> str:
    def f(value: float | None, digits: int = 2) -> str:
        return "never" if value is None else f"{value:.{digits}f}"

    lines = [f"{'kind':<7} {'n':>2} {'detected by':<22} {'detect s':>9} {'(min-max)':>13} {'Slurm DOWN s':>12} "
             f"{'DOWN/detect':>11} {'resumed s':>9} {'joined s':>8}"]
    for s in summaries:
        lo, hi = s["detection_range_s"]
        lines.append(f"{s['kind']:<7} {s['n']:>2} {'/'.join(s['causes']):<22} {f(s['detection_s'], 3):>9} "
                     f"{f'{lo:.2f}-{hi:.2f}':>13} {f(s['slurm_down_s']):>12} "
                     f"{f(s['slurm_down_over_detection'], 0) + 'x' if s['slurm_down_over_detection'] else '-':>11} "
                     f"{f(s['resumed_s']):>9} {f(s['joined_s']):>8}")
    lines.append("medians; seconds from the fault. 'never': Slurm does not see the fault (the agent injected it).")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="faults of each kind")
    parser.add_argument("--kinds", default="node,agent,worker,hang,down,freeze")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "bench_detection.json")
    args = parser.parse_args()
    lab, drill = lab_file("lab").SlurmLab(), lab_file("drill")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    kinds = args.kinds.split(",")
    if unknown := [k for k in kinds if k not in drill.KINDS]:
        parser.error(f"unknown kind(s) {unknown}; kinds: {', '.join(drill.KINDS)}")
    faults = kinds * args.repeats  # rotating: consecutive faults of one job are of different kinds
    os.environ["SLURM_CONF"] = str(lab.conf)
    rows: list[dict] = []
    t0 = time.time()
    with lab.exclusive():
        lab.reset()
        for i in range(0, len(faults), FAULTS_PER_JOB):
            work = Path(tempfile.mkdtemp(prefix="bench-detection-"))  # kept: its job folder explains a failure
            rows += one_job(lab, drill, faults[i:i + FAULTS_PER_JOB], work)
    summaries = summary(rows)
    print()
    print(table(summaries))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                     "seconds": time.time() - t0, "summary": summaries, "faults": rows}, indent=1))
    print(f"wrote {args.json} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
