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
from hostile_store import CLIENT, SNIFFED_ONCE, SNIFFED_REPEAT, WORKERS, attack_plan, plain_names
from jobrun import assert_matches_reference, run_job, tiny_recipe

from oobleck_slurm.cluster.jobdir import JobDir, load_secret
from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.signed_store import StoreSigner

pytestmark = pytest.mark.slow


def test_a_client_without_the_secret_changes_nothing(tmp_path: Path, templates_cache: Path) -> None:
    outcome: dict[str, object] = {}

    def hostile(job: JobDir) -> None:
        plan = tmp_path / "attack.json"
        plan.write_text(json.dumps(attack_plan(StoreSigner(load_secret(job.path)))))
        # It finds the store where the supervisor publishes it (any user could scan ports).
        done = subprocess.run([sys.executable, str(CLIENT), str(job.elastic), str(plan), "120"],
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
