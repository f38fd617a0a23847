"""A hostile store client during a job on the Slurm lab (tests/hostile_store.py): a process without the job
secret finds the store's address in the job folder (any user could scan ports), connects while the job
trains, and writes every key kind the job uses under its plain name, junk, and forged values under the
hidden names. The job completes on the reference trajectory, and every plain-name or junk write is
swept with a `store_rejected` event; no value the job itself wrote is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_store import CLIENT, SNIFFED_ONCE, SNIFFED_REPEAT, attack_plan, plain_names
from test_slurm_requeue import START_TIMEOUT_S, assert_on_reference, submit_lab_job, wait_events

from oobleck_slurm.cluster.jobdir import JobDir, load_secret
from oobleck_slurm.protocol.events import read_events
from oobleck_slurm.protocol.signed_store import StoreSigner

pytestmark = pytest.mark.slurm
STEPS = 120  # ~10 steps/s on the lab: the attack runs through training


def test_a_client_without_the_secret_changes_nothing_on_slurm(slurm_cluster, tmp_path: Path,
                                                             templates_cache: Path) -> None:
    job = submit_lab_job(tmp_path, templates_cache, f"training:\n  steps: {STEPS}\n")
    slurm_id, hostile = None, None
    try:
        start = wait_events(job, "job_started", lambda ev: [e for e in ev if e["kind"] == "job_started"],
                            START_TIMEOUT_S)[0]
        slurm_id = start["slurm_job_id"]
        plan = tmp_path / "attack.json"
        plan.write_text(json.dumps(attack_plan(StoreSigner(load_secret(job)))))
        hostile = subprocess.Popen([sys.executable, str(CLIENT), str(JobDir.at(job).elastic), str(plan), "300"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": ""})
        finished = wait_events(job, "end of training", lambda ev: [e for e in ev if e["kind"] == "job_finished"],
                               300)[0]
        assert finished["status"] == "completed", finished
        out, err = hostile.communicate(timeout=60)  # it ends with the store
        assert hostile.returncode == 0 and int(out.strip()) > 100, (out, err[-2000:])
        events = read_events(job / "events.jsonl")
        steps = [e for e in events if e["kind"] == "step"]
        assert sorted(e["step"] for e in steps) == list(range(STEPS))
        assert_on_reference(job, steps)
        rejected = [e for e in events if e["kind"] == "store_rejected"]
        foreign = {e["key"] for e in rejected if e["reason"] == "foreign key"}
        assert set(plain_names()) <= foreign and sum(k.startswith("junk/") for k in foreign) == 10
        refused = {e["key"] for e in rejected if e["reason"] in ("bad signature", "unsigned value")}
        assert refused <= {*SNIFFED_ONCE, *SNIFFED_REPEAT}  # no value the job wrote was refused
        print(f"hostile client on Slurm: {out.strip()} writes; {len(foreign)} foreign keys swept, "
              f"{len(refused)} forged values refused; the job completed on the reference trajectory")
    finally:
        if hostile is not None and hostile.poll() is None:
            hostile.kill()
        if slurm_id:
            subprocess.run(["scancel", slurm_id], timeout=30, check=False)
