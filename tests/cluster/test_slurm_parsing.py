"""Pure Slurm helpers: time limits, scontrol records, node health, what is submitted and run."""

from __future__ import annotations

import pytest

from oobleck_slurm.cluster.slurm import (
    allocation_parameters,
    node_health,
    parse_scontrol_records,
    replacement_parameters,
    slurm_time_minutes,
    srun_argv,
)
from oobleck_slurm.recipe import load_recipe

# Captured from `scontrol show node -o` on the local lab cluster (Slurm 22.05), trimmed.
SCONTROL = """\
NodeName=node1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 State=IDLE ThreadsPerCore=1 Partitions=debug Reason=(null)
NodeName=node2 Arch=x86_64 CPUAlloc=1 CPUTot=2 State=MIXED Partitions=debug
NodeName=node3 Arch=x86_64 CPUAlloc=0 CPUTot=2 State=DOWN+NOT_RESPONDING Reason=Not responding [slurm@2026-11-21T05:50:00]
NodeName=node4 Arch=x86_64 CPUAlloc=0 CPUTot=2 State=IDLE+DRAIN Reason=drill [root@2026-11-21T05:51:00]
NodeName=node5 Arch=x86_64 CPUAlloc=0 CPUTot=2 State=ALLOCATED+NOT_RESPONDING Reason=(null)
"""


@pytest.mark.parametrize(("text", "minutes"), [
    ("90", 90), ("90:30", 91), ("04:00:00", 240), ("1-12", 2160), ("1-12:30", 2190), ("0-00:00:01", 1),
])
def test_slurm_time_minutes(text: str, minutes: int) -> None:
    assert slurm_time_minutes(text) == minutes


def test_node_health_from_scontrol() -> None:
    health = node_health(parse_scontrol_records(SCONTROL))
    assert {n: h.usable for n, h in health.items()} == {
        "node1": True, "node2": True, "node3": False, "node4": False, "node5": False,
    }
    assert health["node3"].reason.startswith("Not responding")


def test_allocation_parameters_keep_the_job_alive_on_node_loss() -> None:
    recipe = load_recipe("recipes/gpt-1.3b-jureca.yaml")
    params = allocation_parameters(recipe.cluster, "gpt")
    assert params["slurm_additional_parameters"]["no_kill"] is True
    assert params["nodes"] == recipe.cluster.nodes + recipe.cluster.spare_nodes
    assert params["tasks_per_node"] == 1 and params["slurm_use_srun"] is False
    assert params["slurm_partition"] == "dc-gpu" and params["gpus_per_node"] == 4
    assert params["timeout_min"] == 360


def test_a_replacement_is_a_one_node_exclusive_job_like_the_allocation() -> None:
    """Submitted through submitit like the allocation (same placement, setup, time), but one node of
    its own (`--exclusive`), named after the job and its token, and not `--no-kill` (nothing to keep)."""
    cluster = load_recipe("recipes/gpt-1.3b-jureca.yaml").cluster
    allocation, replacement = allocation_parameters(cluster, "gpt"), replacement_parameters(cluster, "gpt", "r3")
    assert replacement["name"] == "gpt-r3" and replacement["nodes"] == 1 and replacement["tasks_per_node"] == 1
    assert replacement["slurm_additional_parameters"] == {"exclusive": True}
    assert replacement["slurm_use_srun"] is False  # the batch step is the agent (no step: no USR2 notice)
    shared = {k: v for k, v in allocation.items() if k not in ("name", "nodes", "slurm_additional_parameters")}
    assert {k: replacement[k] for k in shared} == shared  # partition, account, GPUs, time, setup...


def test_an_agents_step_keeps_running_when_another_node_is_lost() -> None:
    argv = srun_argv("cn01", ["python", "-m", "agent"], cpus=8)
    assert argv[0] == "srun" and argv[-3:] == ["python", "-m", "agent"]
    assert {"--no-kill", "--kill-on-bad-exit=0", "--overlap", "-N1", "-n1", "--nodelist=cn01",
            "--cpus-per-task=8"} <= set(argv)
