"""What a hostile store client writes (tests/recovery/test_hostile_store.py, on the local backend, and
tests/slurm_e2e/test_slurm_hostile_store.py, on the Slurm lab): every key kind of the job under its
plain name, junk, and forged values under hidden names as if it had read the traffic."""

from __future__ import annotations

import os
from pathlib import Path

from oobleck_slurm.protocol import keys
from oobleck_slurm.protocol.signed_store import MAGIC, StoreSigner

CLIENT = Path(__file__).resolve().parent / "recovery" / "hostile_store_client.py"
NODES = [f"node{i}" for i in range(1, 5)]  # the local backend's names, and the Slurm lab's
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
