"""Supervisor failover under Slurm, the pure parts: the jobs it submits, reading the queue, the
recipe key, and the job ids `cancel` and `kill-node` act on (docs/failover.md, "Under Slurm")."""

from __future__ import annotations

from pathlib import Path

import pytest

from oobleck_slurm.cluster.slurm import node_job_parameters, parse_squeue_jobs, supervisor_parameters
from oobleck_slurm.commands.cancel import slurm_job_ids
from oobleck_slurm.errors import InfrastructureError
from oobleck_slurm.recipe import RecipeError, load_recipe
from oobleck_slurm.supervisor.launchers import started_nodes

REPO = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(f"extends: {REPO}/recipes/lab-slurm.yaml\n{text}")
    return load_recipe(path)


def test_training_node_jobs_are_exclusive_one_node_jobs(tmp_path: Path) -> None:
    cluster = recipe(tmp_path, "cluster:\n  sbatch:\n    mail-type: END\n").cluster
    params = node_job_parameters(cluster, "job", 3)
    assert params["nodes"] == 1 and params["name"] == "job-train3"
    assert params["slurm_additional_parameters"] == {"mail-type": "END", "exclusive": True}
    assert params["cpus_per_task"] == cluster.cpus_per_node


def test_supervisor_jobs_are_small_shared_and_kept_apart(tmp_path: Path) -> None:
    cluster = recipe(tmp_path, "cluster:\n  supervisor:\n    failover: true\n    cpus: 2\n").cluster
    params = supervisor_parameters(cluster, "job", "standby", exclude=["node1", "node6"])
    assert params["name"] == "job-standby" and params["nodes"] == 1 and params["cpus_per_task"] == 2
    assert params["slurm_additional_parameters"] == {"exclude": "node1,node6"}  # and not exclusive
    assert params["slurm_partition"] == "debug"  # cluster.partition unless cluster.supervisor.partition
    assert "gpus_per_node" not in params
    own = recipe(tmp_path, "cluster:\n  supervisor:\n    failover: true\n    partition: cpu\n").cluster
    assert supervisor_parameters(own, "job", "primary")["slurm_partition"] == "cpu"
    assert supervisor_parameters(own, "job", "primary")["slurm_additional_parameters"] == {}


def test_queue_lines_and_started_nodes() -> None:
    queue = parse_squeue_jobs("12 RUNNING node3\n13 PENDING \n14 RUNNING node1\n")
    assert queue == {"12": ("RUNNING", "node3"), "13": ("PENDING", ""), "14": ("RUNNING", "node1")}
    assert started_nodes(["12", "13", "14"], queue) is None
    queue["13"] = ("RUNNING", "node2")
    assert started_nodes(["14", "12", "13"], queue) == ["node1", "node3", "node2"]  # submission order
    with pytest.raises(InfrastructureError, match="job 15 is GONE"):
        started_nodes(["12", "15"], queue)
    with pytest.raises(InfrastructureError, match="job 12 is FAILED"):
        started_nodes(["12"], {"12": ("FAILED", "node3")})


def test_supervisor_drill_on_slurm_needs_failover(tmp_path: Path) -> None:
    drill = "drills:\n  - {step: 3, how: supervisor}\n"
    with pytest.raises(RecipeError, match="cluster.supervisor.failover: true"):
        recipe(tmp_path, drill)
    assert recipe(tmp_path, "cluster:\n  supervisor:\n    failover: true\n" + drill).drills[0].how == "supervisor"
    with pytest.raises(RecipeError, match="cluster.supervisor.cpus: must be > 0"):
        recipe(tmp_path, "cluster:\n  supervisor:\n    cpus: 0\n")


def test_cancel_names_every_job_of_a_failover_job() -> None:
    meta = {"slurm_job_id": "6", "supervisor_jobs": ["1", "6", "7"], "node_jobs": ["2", "3"]}
    events = [{"kind": "replacement_requested", "how": "request", "slurm_job": "9"}]
    assert slurm_job_ids(meta, events) == ["6", "1", "7", "2", "3", "9"]
