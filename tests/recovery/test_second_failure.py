"""A second failure while the first recovery runs: two nodes killed 1-76 ms apart on a live 6-node
f=2 job recover every round without a stall (issue 15); 20 rounds: benchmarks/bench_second_failure.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from job_events import running_job
from second_failure import FAULT_TOLERANCE, NODES, kill_two, wait_full

pytestmark = pytest.mark.slow
ROUNDS = 2


def test_two_nodes_killed_ms_apart_recover_every_round(tmp_path: Path, templates_cache: Path) -> None:
    rng = random.Random(15)
    with running_job(tmp_path, FAULT_TOLERANCE, templates_cache, nodes=NODES) as job:
        assert wait_full(job), "the job did not start training on every node"
        for _ in range(ROUNDS):
            result = kill_two(job, rng)
            assert result.ok, result
            assert wait_full(job), f"the replacements for {result.nodes} did not join"
