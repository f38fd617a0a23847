"""What each centre recipe submits: the parameters built from it and the sbatch script submitit writes
from them (submitit's own rendering, no Slurm needed), line by line."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from oobleck_slurm.cluster.slurm import (
    AGENT_STEP_NAME,
    STANDBY_STEP_NAME,
    allocation_parameters,
    executor_arguments,
    replacement_parameters,
    slurm_time_minutes,
    srun_argv,
)
from oobleck_slurm.recipe import Recipe, RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]
CENTRES = sorted((REPO / "recipes" / "centres").glob("*.yaml"))
# Shipped job recipes that extend a centre recipe.
JOBS = sorted(p for p in (REPO / "recipes").glob("*.yaml") if "extends: centres/" in p.read_text())
SLINGSHOT = {"cscs-alps-gh200", "isambard-ai", "lumi-g", "olcf-frontier", "perlmutter-gpu"}
INFINIBAND = {"juwels-booster", "jureca-dc-gpu", "leonardo-booster"}
JOB_NETWORK = "single_node_vni,job_vni"


def centre_job(centre: Path, tmp_path: Path, nodes: int = 4) -> Recipe:
    """A job on the centre as a user writes it (its account, a size)."""
    job = tmp_path / "job.yaml"
    job.write_text(f"extends: {centre}\nname: centre-job\ncluster:\n  nodes: {nodes}\n  account: proj1\n")
    return load_recipe(job)


def sbatch_script(params: dict[str, Any], folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    """The script submitit writes for `params` (and its executor): the same calls as `slurm.submit`,
    up to the sbatch run. submitit wants an `srun` on PATH to pick its Slurm executor: a dummy one."""
    import submitit

    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    own, update = executor_arguments(params)
    executor = submitit.AutoExecutor(folder=folder / "submitit", cluster="slurm", **own)
    executor.update_parameters(**update)
    slurm_executor = executor._executor
    return slurm_executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid"), slurm_executor


def options(script: str) -> dict[str, str]:
    """`#SBATCH --key=value` lines as key -> value ('' for a flag)."""
    found = {}
    for line in script.splitlines():
        if match := re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line):
            found[match.group(1)] = match.group(2) or ""
    return found


def test_every_centre_is_sorted_by_fabric() -> None:
    assert {p.stem for p in CENTRES} == SLINGSHOT | INFINIBAND
    assert JOBS, "no shipped recipe extends a centre"


@pytest.mark.parametrize("centre", CENTRES, ids=[p.stem for p in CENTRES])
def test_a_centres_allocation_script(centre: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = centre_job(centre, tmp_path)
    c = recipe.cluster
    script, executor = sbatch_script(allocation_parameters(c, recipe.name), tmp_path, monkeypatch)
    sbatch = options(script)
    # Fault tolerance and the time-limit chain
    assert sbatch["no-kill"] == "" and sbatch["requeue"] == ""
    assert sbatch["signal"] == f"USR2@{c.signal_delay_s}" and c.signal_delay_s == 120
    assert executor.max_num_timeout == c.requeues == 1000
    # Placement: the recipe's and the user's options, as sbatch reads them
    assert sbatch["nodes"] == str(c.nodes + c.spare_nodes) and sbatch["ntasks-per-node"] == "1"
    assert sbatch["gpus-per-node"] == str(c.gpus_per_node) and sbatch["cpus-per-task"] == str(c.cpus_per_node)
    assert sbatch["account"] == "proj1" and sbatch["job-name"] == "centre-job"
    for key, value in (("partition", c.partition), ("qos", c.qos), ("constraint", c.constraint)):
        assert sbatch.get(key) == value, key
    # The time limit stays within the centre's
    assert sbatch["time"] == str(slurm_time_minutes(c.time))
    if c.max_time is not None:
        assert int(sbatch["time"]) <= slurm_time_minutes(c.max_time)
    # One network domain: Slingshot asks for the job's VNI; InfiniBand needs nothing
    if centre.stem in SLINGSHOT:
        assert sbatch["network"] == JOB_NETWORK
        assert recipe.fault_tolerance.replacement == "spare" and c.spare_nodes >= 1
    else:
        assert "network" not in sbatch


@pytest.mark.parametrize("centre", CENTRES, ids=[p.stem for p in CENTRES])
def test_every_agent_step_asks_for_the_allocations_network(centre: Path, tmp_path: Path) -> None:
    c = centre_job(centre, tmp_path).cluster
    argv = srun_argv("nid000001", ["python", "-m", "agent"], c.cpus_per_node, c.gpus_per_node, c.network)
    assert f"--job-name={AGENT_STEP_NAME}" in argv and argv[-3:] == ["python", "-m", "agent"]
    networks = [a for a in argv if a.startswith("--network=")]
    assert networks == ([f"--network={JOB_NETWORK}"] if centre.stem in SLINGSHOT else [])
    # The agent keeps the job's VNI only (its shell line)
    assert ("SLINGSHOT_VNIS" in argv[argv.index("/bin/sh") + 2]) == (centre.stem in SLINGSHOT)


@pytest.mark.parametrize("centre", CENTRES, ids=[p.stem for p in CENTRES])
def test_a_replacement_script_carries_the_centres_options(centre: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Built for every centre (on Slingshot the recipe refuses `replacement: request`, below)."""
    c = centre_job(centre, tmp_path).cluster
    params = replacement_parameters(c, "centre-job", "r1", exclude=["nid000007"])
    sbatch = options(sbatch_script(params, tmp_path, monkeypatch)[0])
    assert sbatch["nodes"] == "1" and sbatch["exclusive"] == "" and sbatch["exclude"] == "nid000007"
    assert "requeue" not in sbatch and "no-kill" not in sbatch
    assert sbatch.get("network") == c.network and sbatch.get("partition") == c.partition
    assert sbatch["signal"] == f"USR2@{c.signal_delay_s}"


@pytest.mark.parametrize("centre", sorted(p for p in CENTRES if p.stem in SLINGSHOT), ids=lambda p: p.stem)
def test_slingshot_centres_refuse_replacement_jobs(centre: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"extends: {centre}\ncluster:\n  nodes: 4\nfault_tolerance:\n  replacement: request\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(job)
    assert [i.key for i in err.value.issues] == ["fault_tolerance.replacement"]
    assert "its own" in str(err.value) and "spare" in str(err.value)


def test_frontiers_walltime_follows_its_node_count_bin(tmp_path: Path) -> None:
    """1-91 nodes: 2 h (the centre recipe); a 92-node job may ask 6 h by raising max_time."""
    frontier = REPO / "recipes" / "centres" / "olcf-frontier.yaml"
    assert slurm_time_minutes(centre_job(frontier, tmp_path).cluster.time) <= 120
    job = tmp_path / "long.yaml"
    job.write_text(f"extends: {frontier}\ncluster:\n  nodes: 8\n  time: '06:00:00'\n")
    with pytest.raises(RecipeError, match="exceeds cluster.max_time '02:00:00'"):
        load_recipe(job)
    job.write_text(f"extends: {frontier}\ncluster:\n  nodes: 91\n  spare_nodes: 1\n  time: '06:00:00'\n"
                   f"  max_time: '06:00:00'\n")
    assert load_recipe(job).cluster.time == "06:00:00"


@pytest.mark.parametrize("path", JOBS, ids=[p.stem for p in JOBS])
def test_shipped_centre_jobs_submit_what_their_centre_needs(path: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = load_recipe(path)
    c = recipe.cluster
    sbatch = options(sbatch_script(allocation_parameters(c, recipe.name), tmp_path, monkeypatch)[0])
    assert sbatch["no-kill"] == "" and sbatch["requeue"] == "" and sbatch["signal"] == "USR2@120"
    assert sbatch["nodes"] == str(c.nodes + c.spare_nodes) and sbatch["account"] == c.account
    if c.network:  # Slingshot (Isambard-AI): spares inside the allocation replace lost nodes
        assert sbatch["network"] == JOB_NETWORK
        assert recipe.fault_tolerance.replacement == "spare" and c.spare_nodes >= recipe.fault_tolerance.f


@pytest.mark.parametrize("centre", CENTRES, ids=[p.stem for p in CENTRES])
def test_the_standby_step_joins_the_jobs_network_with_one_cpu_and_no_gpu(centre: Path, tmp_path: Path) -> None:
    """The standby supervisor is a step of the allocation (supervisor/main.py `_standby_step`): on
    Slingshot it needs the job's VNI like every step, to reach the agents and workers after a takeover."""
    c = centre_job(centre, tmp_path).cluster
    assert c.supervisor.standby and not c.supervisor.failover
    argv = srun_argv("nid000002", ["python", "-m", "standby"], c.supervisor.cpus, 0, c.network, STANDBY_STEP_NAME)
    assert f"--job-name={STANDBY_STEP_NAME}" in argv and "--overlap" in argv and "--no-kill" in argv
    assert "--cpus-per-task=1" in argv and not [a for a in argv if a.startswith("--gpus")]
    networks = [a for a in argv if a.startswith("--network=")]
    assert networks == ([f"--network={JOB_NETWORK}"] if centre.stem in SLINGSHOT else [])
