"""The pre-flight check in jobs started as `submit` starts them (local backend: the same job path as
under Slurm, without it): every member is measured at the start, a spare slowed by the `slow` drill
(its check child duty-cycled with SIGSTOP/SIGCONT, as its workers would be) is refused when it
would join, the job goes on without it, and a healthy spare's join is admitted with its figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobrun import run_job, tiny_recipe

pytestmark = pytest.mark.slow
FIGURES = {"matmul_gflops", "link_mib_s"}  # a CPU node: no intra-node all-reduce


def test_a_slowed_spare_is_refused_at_join_and_a_healthy_one_is_admitted(tmp_path: Path,
                                                                           templates_cache: Path) -> None:
    recipe = tiny_recipe(steps=14, replacement="spare")
    recipe["cluster"]["spare_nodes"] = 2  # node5 (slowed before it is needed), then node6
    recipe["drills"] = [{"step": 1, "node": "node5", "how": "slow"},
                        {"step": 3, "node": "node2", "how": "worker"},
                        {"step": 8, "node": "node3", "how": "worker"}]
    run = run_job(tmp_path, recipe, templates_cache, timeout=300)

    verdicts = run.kind("preflight")
    start = [e for e in verdicts if e["at"] == "start"]
    assert sorted(e["node"] for e in start) == ["node1", "node2", "node3", "node4"]
    for e in start:  # measured, and (the virtual nodes share this machine) not refused at the start
        assert e["admitted"] and set(e["figures"]) == FIGURES and all(v > 0 for v in e["figures"].values()), e
    joins = {e["node"]: e for e in verdicts if e["at"] == "join"}
    assert set(joins) == {"node5", "node6"}, verdicts

    slowed = joins["node5"]
    assert not slowed["admitted"] and "x the fleet's median" in slowed["reason"], slowed
    assert set(slowed["medians"]) == {"matmul_gflops"}  # the link (loopback on one machine) is not judged
    checks = {e["node"]: e for e in run.kind("health_check")}
    assert not checks["node5"]["ok"] and checks["node5"]["detail"].startswith("pre-flight check: ")
    failed = [e for e in run.kind("failure") if e["nodes"] == ["node5"]]
    assert failed and "join_failed" in failed[0]["cause"]

    healthy = joins["node6"]
    assert healthy["admitted"] and set(healthy["figures"]) == FIGURES, healthy
    assert checks["node6"]["ok"]
    assert [e["node"] for e in run.kind("node_joined")] == ["node6"]
    assert sorted(run.losses()) == list(range(14))  # the job went on to its end
