"""Pure Slurm helpers: time limits, scontrol records, node health, what is submitted and run."""

from __future__ import annotations

import pytest

from oobleck_slurm.cluster.slurm import (
    allocation_parameters,
    executor_arguments,
    node_health,
    parse_scontrol_records,
    replacement_parameters,
    requeue_exclude_argv,
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
    # Only a lost state is unusable: a drained or not-responding node still runs its jobs (advisory).
    assert {n: h.usable for n, h in health.items()} == {
        "node1": True, "node2": True, "node3": False, "node4": True, "node5": True,
    }
    assert (health["node4"].advisory, health["node5"].advisory) == (("DRAIN",), ("NOT_RESPONDING",))
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
    its own (`--exclusive`), named after the job and its token, not `--no-kill` (nothing to keep) and
    not requeued."""
    cluster = load_recipe("recipes/gpt-1.3b-jureca.yaml").cluster
    allocation, replacement = allocation_parameters(cluster, "gpt"), replacement_parameters(cluster, "gpt", "r3")
    assert replacement["name"] == "gpt-r3" and replacement["nodes"] == 1 and replacement["tasks_per_node"] == 1
    assert replacement["slurm_additional_parameters"] == {"exclusive": True}
    assert replacement["slurm_use_srun"] is False  # the batch step is the agent (no step: no USR2 notice)
    assert "slurm_max_num_timeout" not in replacement
    shared = {k: v for k, v in allocation.items()
              if k not in ("name", "nodes", "slurm_additional_parameters", "slurm_max_num_timeout")}
    assert {k: replacement[k] for k in shared} == shared  # partition, account, GPUs, time, setup...


def test_an_agents_step_keeps_running_when_another_node_is_lost() -> None:
    argv = srun_argv("cn01", ["python", "-m", "agent"], cpus=8)
    assert argv[0] == "srun" and argv[-3:] == ["python", "-m", "agent"]
    assert {"--no-kill", "--kill-on-bad-exit=0", "--overlap", "-N1", "-n1", "--nodelist=cn01",
            "--cpus-per-task=8"} <= set(argv)


def test_the_allocation_is_a_time_limit_chain() -> None:
    """`--requeue` (sites with JobRequeue=0), the notice `signal_delay_s` ahead, and `requeues` requeues
    after a time limit, which submitit takes as an executor argument, not through update_parameters."""
    cluster = load_recipe("recipes/lab-slurm.yaml").cluster
    params = allocation_parameters(cluster, "lab")
    assert params["slurm_additional_parameters"]["requeue"] is True
    assert params["slurm_signal_delay_s"] == cluster.signal_delay_s == 120
    assert params["slurm_max_num_timeout"] == cluster.requeues == 1000
    own, update = executor_arguments(params)
    assert own == {"slurm_max_num_timeout": 1000} and "slurm_max_num_timeout" not in update
    assert {**own, **update} == params


def test_a_replacement_carries_the_recipes_sbatch_options_and_avoids_lost_nodes(tmp_path) -> None:
    recipe = tmp_path / "job.yaml"
    recipe.write_text("cluster:\n  backend: slurm\n  sbatch:\n    reservation: big\n    exclude: cn[90-99]\n")
    cluster = load_recipe(recipe).cluster
    params = replacement_parameters(cluster, "job", "r2", exclude=["cn07", "cn03", "cn07"])
    assert params["slurm_additional_parameters"] == {
        "reservation": "big", "exclusive": True, "exclude": "cn[90-99],cn07,cn03"}
    assert "exclude" not in replacement_parameters(load_recipe("recipes/lab-slurm.yaml").cluster, "j", "r1")[
        "slurm_additional_parameters"]


def test_a_requeue_excludes_the_lost_nodes() -> None:
    assert requeue_exclude_argv("4242", ["cn07", "cn03"]) == [
        "scontrol", "update", "JobId=4242", "ExcNodeList=cn07,cn03"]
    with pytest.raises(ValueError, match="ExcNodeList"):
        requeue_exclude_argv("4242", [])


def test_an_agent_step_on_slingshot_joins_the_jobs_network_and_keeps_its_vni() -> None:
    argv = srun_argv("nid001", ["python", "-m", "agent"], cpus=56, gpus=8, network="single_node_vni,job_vni")
    assert "--network=single_node_vni,job_vni" in argv
    shell = argv.index("/bin/sh")
    assert argv[shell + 1] == "-c" and argv[-3:] == ["python", "-m", "agent"]
    assert 'SLINGSHOT_VNIS="${SLINGSHOT_VNIS##*,}"' in argv[shell + 2] and 'exec "$@"' in argv[shell + 2]
    plain = srun_argv("cn01", ["agent"], cpus=2, network="tcs=BULK_DATA")  # no job VNI: the VNIs as given
    assert "--network=tcs=BULK_DATA" in plain and "SLINGSHOT_VNIS" not in plain[plain.index("/bin/sh") + 2]


def test_every_step_starts_with_the_time_limit_notice_ignored() -> None:
    """Slurm may send `--signal=USR2@…` up to 60 s early: at a short limit, before Python installed the
    agent's handler. The step's shell line ignores it (inherited across exec) until the agent handles it."""
    import signal
    import subprocess
    import sys

    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)"]
    argv = srun_argv("n", probe, cpus=1)
    wrapped = argv[argv.index("/bin/sh"):]
    assert subprocess.run(wrapped, capture_output=True, text=True, check=True).stdout.strip() == "True"
    assert signal.getsignal(signal.SIGUSR2) != signal.SIG_IGN  # this process is untouched


def test_the_vni_wrapper_keeps_the_job_vni_only(tmp_path) -> None:
    """The shell line itself, run here: the step's VNI first, the job's last (Slurm's order)."""
    import os
    import subprocess

    argv = srun_argv("n", ["/bin/sh", "-c", 'echo "$SLINGSHOT_VNIS"'], cpus=1, network="job_vni")
    wrapped = argv[argv.index("/bin/sh"):]
    for given, kept in (("1301,1024", "1024"), ("1301", "1301"), ("", "")):
        env = {**os.environ, "SLINGSHOT_VNIS": given} if given else {k: v for k, v in os.environ.items()
                                                                       if k != "SLINGSHOT_VNIS"}
        out = subprocess.run(wrapped, env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert out == kept
