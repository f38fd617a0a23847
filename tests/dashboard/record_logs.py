"""Records the event logs in tests/dashboard/logs/ from real local runs (about a minute on 2 cores).

    python tests/dashboard/record_logs.py

Each run is `submit --detach` of a small local recipe (4 virtual nodes, the `mini` GPT) through the
real supervisor, agents and workers; `kill-node` drills make the failure:

- healthy: no fault;
- failure: node3's worker is killed during training; no replacement (`replacement: none`);
- join:    node2's agent is killed; the supervisor requests a replacement, which joins.

Timestamps and timings are whatever the run had; the tests assert on structure, not on them.
`make_logs.py` writes synthetic logs with the same vocabulary (for kinds the local runs do not
produce, such as Slurm states); the tests use these recorded ones.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOGS = Path(__file__).parent / "logs"
REPO = Path(__file__).resolve().parents[2]

RECIPE = """\
name: dash-{name}
cluster:
  backend: local
  nodes: 4
model:
  size: mini
training:
  global_batch_size: 16
  microbatch_size: 2
  steps: {steps}
fault_tolerance:
  f: 1
  replacement: {replacement}
  checkpoint_interval: 40
"""


def cli(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{args}: {done.stdout}{done.stderr}")
    return done.stdout


def events(job: Path) -> list[dict]:
    path = job / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(job: Path, test, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if test(events(job)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{job}: gave up waiting")


def record(name: str, steps: int, replacement: str, fault: tuple[str, str] | None, work: Path) -> None:
    recipe = work / f"{name}.yaml"
    recipe.write_text(RECIPE.format(name=name, steps=steps, replacement=replacement))
    cli("submit", str(recipe), "--detach", "--job-root", str(work / "jobs"), "--cache", str(work / "cache"), cwd=REPO)
    job = max((work / "jobs").glob(f"dash-{name}-*"), key=lambda p: p.stat().st_mtime)
    if fault is not None:
        node, how = fault
        wait_for(job, lambda ev: any(e["kind"] == "step" and e["step"] >= 25 for e in ev))
        cli("kill-node", str(job), node, "--how", how, cwd=REPO)
    wait_for(job, lambda ev: any(e["kind"] == "job_finished" for e in ev))
    shutil.copy(job / "events.jsonl", LOGS / f"{name}.jsonl")
    kinds = [e["kind"] for e in events(job)]
    print(name, {k: kinds.count(k) for k in dict.fromkeys(kinds)})


RUNS = {
    "healthy": (60, "none", None),
    "failure": (80, "none", ("node3", "worker")),
    "join": (80, "request", ("node2", "agent")),
}


def main(names: list[str]) -> None:
    """Record the named runs (all by default)."""
    LOGS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or RUNS:
            record(name, *RUNS[name], Path(tmp))


if __name__ == "__main__":
    main(sys.argv[1:])
