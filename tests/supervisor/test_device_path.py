"""The per-device worker path without a GPU: what an agent gives each worker (thread budget, device,
NCCL's environment), how a Slurm step asks for the node's GPUs, which errors count as a failed
collective, and how workers per node follow from a recipe."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_slurm.agent.main import NCCL_WORKER_ENV, worker_env
from oobleck_slurm.cluster.slurm import srun_argv
from oobleck_slurm.engine.comm import CollectiveError, is_collective_error, make_group
from oobleck_slurm.recipe import RecipeError, load_recipe


def test_each_worker_gets_its_device_threads_and_nccl_settings() -> None:
    gpu = worker_env({"PATH": "/bin"}, local=3, threads=18, device="cuda")
    assert (gpu["LOCAL_RANK"], gpu["OOBLECK_DEVICE"], gpu["OMP_NUM_THREADS"]) == ("3", "cuda", "18")
    assert all(gpu[k] == v for k, v in NCCL_WORKER_ENV.items())  # torch's watchdog never acts alone
    assert gpu["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and gpu["PATH"] == "/bin"
    cpu = worker_env({}, local=1, threads=1, device="cpu")
    assert cpu["OOBLECK_DEVICE"] == "cpu" and not set(NCCL_WORKER_ENV) & set(cpu)
    # a variable the user set stays theirs (NVLS on an NVSwitch machine, say)
    mine = worker_env({"NCCL_NVLS_ENABLE": "1"}, local=0, threads=1, device="cuda")
    assert mine["NCCL_NVLS_ENABLE"] == "1" and mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_a_gpu_nodes_step_takes_all_its_gpus_without_per_task_binding() -> None:
    argv = srun_argv("gpu07", ["agent"], cpus=72, gpus=4)
    assert "--gpus-per-node=4" in argv and "--gpu-bind=none" in argv and "--nodelist=gpu07" in argv
    assert not [a for a in srun_argv("cn01", ["agent"], cpus=2) if a.startswith("--gpu")]


def test_collective_errors_are_told_from_bugs() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert is_collective_error(gloo)
    assert is_collective_error(RuntimeError("Timed out waiting 2000ms for recv operation to complete"))
    assert is_collective_error(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_collective_error(RuntimeError("Application timeout caused pair closure"))  # a frozen peer (gloo)
    assert is_collective_error(CollectiveError("RuntimeError: anything a generation's wait raised"))
    assert not is_collective_error(RuntimeError("rank 3 lacks layer(s) [2] after adopting the plan"))
    assert not is_collective_error(KeyError("layer"))


def test_an_nccl_group_needs_the_workers_cuda_device() -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="CUDA device"):
        make_group(store, "g", 0, 1, dt.timedelta(seconds=1), "nccl", dt.timedelta(seconds=1), torch.device("cpu"))


def test_workers_per_node_follow_the_gpus_and_split_the_cores(tmp_path: Path) -> None:
    def cluster(text: str):  # noqa: ANN202
        path = tmp_path / "r.yaml"
        path.write_text(text)
        return load_recipe(path).cluster

    gpus = cluster("cluster: {backend: slurm, nodes: 2, gpus_per_node: 4, cpus_per_node: 72}\nfault_tolerance: {f: 1}\n")
    assert (gpus.devices_per_node, gpus.threads_per_worker) == (4, 18)
    cpus = cluster("cluster: {nodes: 4, workers_per_node: 2, cpus_per_node: 5}\n")
    assert (cpus.devices_per_node, cpus.threads_per_worker) == (2, 2)
    assert cluster("cluster: {nodes: 4}\n").devices_per_node == 1
    with pytest.raises(RecipeError, match="cluster.workers_per_node: one worker runs per GPU"):
        cluster("cluster: {nodes: 2, gpus_per_node: 4, workers_per_node: 2}\nfault_tolerance: {f: 1}\n")



def test_training_deterministic_reaches_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first H200 run found cuDNN's attention backward nondeterministic: two uninterrupted runs then
    # differ, and so does a recovered one. A recipe's `training.deterministic` makes the worker's kernels
    # deterministic (not warn-only) with cuBLAS's fixed workspace, set before its first matrix product.
    from dataclasses import replace

    from oobleck_slurm.engine.from_recipe import job_from_recipe
    from oobleck_slurm.engine.spec import DataSpec
    from oobleck_slurm.engine.worker import CUBLAS_DETERMINISTIC_WORKSPACE, Worker

    def job(training: str):  # noqa: ANN202
        path = tmp_path / "r.yaml"
        path.write_text(f"model: {{family: llama, size: tiny}}\ntraining: {{global_batch_size: 8, "
                        f"microbatch_size: 2{training}}}\n")
        return job_from_recipe(load_recipe(path), tmp_path / "tokens.bin")

    assert not job("").train.deterministic  # off unless asked
    on = replace(job(", deterministic: true"), data=DataSpec("random", num_samples=16, seed=1))
    assert on.train.deterministic
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        Worker(on, 0)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC_WORKSPACE
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
