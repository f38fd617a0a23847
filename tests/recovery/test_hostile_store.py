"""A hostile store client during a real local job (supervisor, agents, workers; real gloo groups; a node
killed mid-run): a process WITHOUT the job secret connects to the job's TCPStore while it trains and
writes every key kind the job uses under its plain name (protocol/keys.py: records, failure notices,
counters, rendezvous keys) and junk; and, as if it had read the traffic (listing the names with
`list_keys` gives them, not what they mean), forged values under the hidden names of failure notices,
future generations' records and rendezvous keys, and, over and over, of the keys the job rewrites
every step. The job completes on the reference trajectory (losses and
final parameters, fp64) and every refused write is in the event log (`store_rejected`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobrun import assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.cluster.jobdir import JobDir, load_secret
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.records import read_launch_config
from oobleck_slurm.protocol.signed_store import MAGIC, StoreSigner

pytestmark = pytest.mark.slow
CLIENT = Path(__file__).resolve().parent / "hostile_store_client.py"
NODES = [f"node{i}" for i in range(1, 5)]  # the local backend's names
WORKERS = [keys.worker_id(n, 0) for n in NODES]
# The hidden names the hostile overwrites as if it had sniffed them: once where the job writes them once
# (failure notices, the next generations' records and rendezvous keys: before the job does; a counter),
# again and again where the job rewrites them every step (progress, compute times, ranks' steps). A value
# the job writes once and a forger overwrites after it is lost for good: a denial of service, not tested.
SNIFFED_ONCE = [*(keys.failed(g) for g in (0, 1, 2)), keys.config(1), keys.config(2), keys.first_step(1),
                *(keys.group_prefix(g, "world") + f"/0/{r}" for g in (1, 2) for r in range(4)), keys.errors(0)]
SNIFFED_REPEAT = [keys.progress(0), keys.step_compute(0), *(keys.worker_step(w) for w in WORKERS)]


def plain_names() -> list[str]:
    """Every key kind of protocol/keys.py under its plain name, for generations 0 and 1 (the counters are
    added to: `attack_plan`)."""
    names = [keys.CURRENT_GEN, keys.fault_time("node1"), keys.health_prefix("node1", 1) + "/0/0"]
    for g in (0, 1):
        names += [keys.config(g), keys.failed(g), keys.progress(g), keys.step_compute(g), keys.first_step(g),
                  keys.group_prefix(g, "world") + "/0/0", keys.group_prefix(g, "world") + "/0/1"]
        names += [f(g, w) for w in WORKERS for f in (keys.report, keys.rebuilt, keys.error)]
    names += [f(w) for w in WORKERS for f in (keys.worker_step, keys.worker_ready)]
    return names


def forged(i: int) -> bytes:
    """A forged value: one that looks signed (a wrong tag), or a plausible unsigned one."""
    return MAGIC + os.urandom(32) + b"1" if i % 2 else b'{"lost": ["node0"], "joined": [], "cause": "forged"}'


def attack_plan(signer: StoreSigner) -> dict[str, list]:
    """What the hostile writes. `signer` stands for the sniffed traffic: only the hidden names it yields
    go to the hostile, never the secret."""
    junk = [(f"junk/{os.urandom(6).hex()}", os.urandom(40)) for _ in range(10)]
    once = [(n, b"1") for n in plain_names()] + junk
    once += [(signer.name(k), forged(i)) for i, k in enumerate(SNIFFED_ONCE)]
    repeat = [(signer.name(k), forged(i)) for i, k in enumerate(SNIFFED_REPEAT)]
    return {"once": [[n, v.hex()] for n, v in once], "add": [keys.errors(0), keys.fault_fired(0)],
            "repeat": [[n, v.hex()] for n, v in repeat]}


def test_a_client_without_the_secret_changes_nothing(tmp_path: Path, templates_cache: Path) -> None:
    outcome: dict[str, object] = {}

    def hostile(job: JobDir) -> None:
        while not job.elastic.exists():  # the supervisor publishes its store here (any user could scan ports)
            time.sleep(0.01)
        launch = read_launch_config(job.elastic)
        plan = tmp_path / "attack.json"
        plan.write_text(json.dumps(attack_plan(StoreSigner(load_secret(job.path)))))
        done = subprocess.run([sys.executable, str(CLIENT), launch.host, str(launch.port), str(plan), "120"],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
        outcome.update(code=done.returncode, writes=done.stdout.strip(), err=done.stderr[-2000:])

    faults = [{"node": "node2", "step": 12, "at": "wait:last"}]
    run = run_job(tmp_path, tiny_recipe(steps=30), templates_cache, faults=faults, alongside=hostile, timeout=400)
    assert_matches_reference(run)
    assert run.kind("resumed") and run.kind("failure")[0]["nodes"] == ["node2"]  # the kill, not the hostile
    for _ in range(100):  # the hostile ends with the store
        if outcome:
            break
        time.sleep(0.1)
    assert outcome.get("code") == 0 and int(str(outcome["writes"])) > 100, outcome

    rejected = run.kind("store_rejected")
    foreign = {e["key"] for e in rejected if e["reason"] == "foreign key"}
    assert set(plain_names()) | {keys.errors(0), keys.fault_fired(0)} <= foreign  # every plain write, swept
    assert sum(k.startswith("junk/") for k in foreign) == 10
    refused = {(e["key"], e["reader"]) for e in rejected if e["reason"] in ("bad signature", "unsigned value")}
    assert {k for k, _ in refused} <= {*SNIFFED_ONCE, *SNIFFED_REPEAT}  # no value the job wrote was refused
    assert (keys.failed(0), "supervisor") in refused  # the observer's check of the current generation
    assert {r for k, r in refused if k == keys.failed(0)} >= set(WORKERS)  # every worker's failure watch
    assert {(keys.config(1), w) for w in WORKERS if w != "node2:0"} <= refused  # the survivors' next generation
    assert {k for k, r in refused if r == "supervisor"} & set(SNIFFED_REPEAT)
    # A forged rendezvous value is refused where a rank reads it before its writer overwrites it (that
    # order is the ranks' race: tests/protocol/test_signed_store.py makes it certain).
