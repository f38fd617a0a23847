"""Detection time per failure kind on the real local Slurm lab, against Slurm's own DOWN time, and
end to end (fault -> training resumed -> replacement joined).

    bash tests/slurm/start.sh && python benchmarks/bench_detection.py [--repeats 3] [--kinds node,agent,...]

One 4-node job per measurement (submitted with `submit --detach`, a tiny GPT), a fault injected into a
non-batch node once training runs, then `cancel` and a lab reset. Kinds: node (slurmd, stepds and tasks
SIGKILLed), agent (kill -9), worker (kill -9), hang (worker SIGSTOPped), down (scontrol state=down),
freeze (every process of the node SIGSTOPped).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
KINDS = ("node", "agent", "worker", "hang", "down", "freeze")
RECIPE = """extends: {repo}/recipes/lab-slurm.yaml
cluster:
  time: "00:10:00"
  sbatch:
    exclusive: ""
training:
  steps: 1000000
fault_tolerance:
  heartbeat_interval: 0.25
  heartbeat_lease: 2.5
  collective_timeout: 2.0
  step_timeout: 8
  reconfiguration_timeout: 60
  replacement: request
  checkpoint_interval: 0
"""


def lab_module():
    spec = importlib.util.spec_from_file_location("lab", REPO / "tests" / "slurm" / "lab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def events(job: Path) -> list[dict]:
    from oobleck_slurm.events import read_events

    return read_events(job / "events.jsonl")


def wait(job: Path, check, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not (found := check(events(job))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job}: timed out; last events {[e['kind'] for e in events(job)[-8:]]}")
        time.sleep(0.1)
    return found


def slurm_down_after(lab, node: str, t0: float, limit: float, out: dict) -> None:
    while time.time() - t0 < limit:
        with contextlib.suppress(Exception):
            if {"DOWN", "FAIL"} & lab.node_state(node):
                out["down"] = time.time() - t0
                return
        time.sleep(0.1)


def one_run(lab, kind: str, work: Path) -> dict:
    from oobleck_slurm.supervisor.client import notify_fault

    recipe = work / "bench.yaml"
    recipe.write_text(RECIPE.format(repo=REPO))
    env = dict(os.environ, SLURM_CONF=str(lab.conf))
    subprocess.run([sys.executable, "-m", "oobleck_slurm", "submit", str(recipe), "--detach"], cwd=work, env=env,
                   check=True, capture_output=True, timeout=300)
    (job,) = (work / "jobs").iterdir()
    try:
        start = wait(job, lambda ev: [e for e in ev if e["kind"] == "job_started"], 60)[0]
        wait(job, lambda ev: [e for e in ev if e["kind"] == "step" and e["step"] >= 3], 120)
        lab.start_spare()
        node = start["nodes"][-1]
        t0 = time.time()
        relayed = kind in ("agent", "worker", "hang")
        notify_fault(job, node, kind, t0)
        if kind == "node":
            lab.kill_node(node)
        elif kind == "down":
            lab.set_down(node, "bench")
        elif kind == "freeze":
            for p in lab.node_processes(node):
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGSTOP)
        down: dict = {}
        watcher = threading.Thread(target=slurm_down_after, args=(lab, node, t0, 20.0, down), daemon=True)
        if not relayed:
            watcher.start()
        lost = wait(job, lambda ev: [e for e in ev if e["kind"] == "node_lost"], 60)[0]
        resumed = wait(job, lambda ev: [e for e in ev if e["kind"] == "resumed"], 60)[0]
        joined = wait(job, lambda ev: [e for e in ev if e["kind"] == "node_joined"], 120)[0]
        if not relayed:
            watcher.join()
        return {"kind": kind, "cause": lost["cause"], "detection_s": lost["detection_seconds"],
                "slurm_down_s": down.get("down"), "resumed_s": resumed["t"] - t0, "joined_s": joined["t"] - t0}
    finally:
        subprocess.run([sys.executable, "-m", "oobleck_slurm", "cancel", str(job)], cwd=work, env=env,
                       capture_output=True, timeout=60)
        if kind == "freeze":
            lab.kill_node(node)
        lab.reset()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    args = parser.parse_args()
    lab = lab_module().SlurmLab()
    os.environ["SLURM_CONF"] = str(lab.conf)
    rows = []
    with lab.exclusive():
        lab.reset()
        for kind in args.kinds.split(","):
            for _ in range(args.repeats):
                work = Path(tempfile.mkdtemp(prefix="bench-detection-"))  # kept: its job folder explains a failure
                row = one_run(lab, kind, work)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\n{'kind':<8} {'cause':<12} {'detect s':>9} {'Slurm DOWN s':>13} {'resumed s':>10} {'joined s':>9}  (medians, n={args.repeats})")
    for kind in dict.fromkeys(r["kind"] for r in rows):
        rs = [r for r in rows if r["kind"] == kind]
        med = lambda key: statistics.median([r[key] for r in rs if r[key] is not None]) if any(r[key] is not None for r in rs) else None  # noqa: E731
        down = med("slurm_down_s")
        print(f"{kind:<8} {'/'.join(sorted({r['cause'] for r in rs})):<12} {med('detection_s'):>9.3f} "
              f"{(f'{down:.2f}' if down is not None else 'never'):>13} {med('resumed_s'):>10.2f} {med('joined_s'):>9.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
