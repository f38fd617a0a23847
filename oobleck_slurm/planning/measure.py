"""Measured profiles: real forward/backward per layer on this device, real transfers between processes.

Times are medians over `repeats` runs after `warmup` runs. Held activation bytes are what autograd
actually saves for backward (counted with saved-tensor hooks, parameters excluded), so the memory
model sees the real implementation, not a formula. Links are measured between two local processes
(gloo on CPU, nccl when two GPUs are visible): this machine has no second node, so the inter-node
figures equal the intra-node ones; plan a multi-node GPU job from a profile file made on its
nodes, or with `--estimate`.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch
from torch import nn

from oobleck_slurm.models.config import GPTConfig
from oobleck_slurm.planning.profile import LayerProfile, Link, Profile, profile_key

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(
    layers: Sequence[nn.Module],
    sample_input: torch.Tensor,
    *,
    optimizer: str = "adamw",
    repeats: int = 5,
    warmup: int = 1,
    names: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[LayerProfile]:
    """Run each layer on the previous layer's output; time forward and backward, count bytes."""
    from oobleck_slurm.optim.memory import optimizer_state_bytes

    x = sample_input
    device = sample_input.device
    out_profiles = []
    for i, layer in enumerate(layers):
        params = list(layer.parameters())
        param_ptrs = {p.data_ptr() for p in params}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, param_ptrs: set[int] = param_ptrs, saved: dict[int, int] = saved) -> torch.Tensor:
            if t.data_ptr() not in param_ptrs:
                saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.untyped_storage().nbytes())
            return t

        fwd, bwd = [], []
        out = None
        for rep in range(warmup + repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            saved.clear()
            _sync(device)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(inp)
            _sync(device)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            _sync(device)
            t2 = time.perf_counter()
            if rep >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            layer.zero_grad(set_to_none=True)
        assert out is not None
        pbytes = sum(p.numel() * p.element_size() for p in params)
        dtype = params[0].dtype if params else torch.float32
        out_profiles.append(LayerProfile(
            name=names[i] if names else f"layer{i}",
            forward_s=statistics.median(fwd),
            backward_s=statistics.median(bwd),
            param_bytes=pbytes,
            grad_bytes=pbytes,
            optimizer_bytes=optimizer_state_bytes(optimizer, [tuple(p.shape) for p in params], dtype),
            output_bytes=out.numel() * out.element_size(),
            activation_bytes=sum(saved.values()),
        ))
        x = out.detach()
        if progress:
            progress(i + 1, len(layers))
    return out_profiles


def _link_worker(rank: int, init_file: str, backend: str, large_n: int) -> tuple[float, float, float, float] | None:
    """One of the two processes of `measure_links`; rank 0 returns the medians."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2)
    small = torch.zeros(16, device=device)
    large = torch.zeros(large_n // 4, device=device)

    def pingpong(buf: torch.Tensor, reps: int) -> float:
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            _sync(device)
            times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times)

    def allreduce(buf: torch.Tensor, reps: int) -> float:
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    pingpong(small, 3)
    result = (pingpong(small, 30), pingpong(large, 5), allreduce(small, 20), allreduce(large, 5))
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def measure_links(large_bytes: int = 8 << 20, timeout_s: float = 120.0) -> dict[str, Link]:
    """Alpha-beta links fitted from real transfers between two fresh local processes.

    The processes are started as `python -m oobleck_slurm.planning.measure`, not with
    multiprocessing's spawn, which would re-run the CLI's unguarded __main__ in each child.
    """
    import json
    import subprocess
    import sys

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        cmd = [sys.executable, "-m", "oobleck_slurm.planning.measure", init_file, backend, str(large_bytes)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen([*cmd, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for rank in range(2)
        ]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode for p in procs):
        errors = "; ".join(err.strip().splitlines()[-1] for (_, err), p in zip(outs, procs) if p.returncode and err.strip())
        raise RuntimeError(f"link measurement between two local processes failed: {errors or 'no message'}")
    lat, big, ar_small, ar_big = json.loads(outs[0][0])
    p2p = Link(lat, large_bytes / max(big - lat, 1e-9))
    # Ring all-reduce of 2 ranks: 2 alpha + bytes / bw (see cost.allreduce_time).
    ar = Link(ar_small / 2, large_bytes / max(ar_big - ar_small, 1e-9))
    return {"intra_node": p2p, "inter_node": p2p, "allreduce_intra": ar, "allreduce_inter": ar}


def device_description(device: torch.device) -> tuple[str, int]:
    """(name, memory bytes) of the device one worker uses."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, int(props.total_memory)
    import psutil

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {name}", int(psutil.virtual_memory().total)


def profile_model(
    cfg: GPTConfig,
    *,
    microbatch_size: int,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    devices_per_node: int = 1,
    repeats: int = 5,
    links: dict[str, Link] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Measure a GPT from `models.gpt` on this machine (first GPU, or the CPU with one thread)."""
    from oobleck_slurm.models.gpt import build_layers, layer_keys

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # what each CPU worker runs with
    layers = [layer.to(device=device, dtype=DTYPES[dtype]) for layer in build_layers(cfg, seed=0)]
    sample = torch.randint(cfg.vocab_size, (microbatch_size, cfg.seq_len), device=device)
    measured = profile_layers(
        layers, sample, optimizer=optimizer, repeats=repeats, names=layer_keys(cfg), progress=progress
    )
    name, memory = device_description(device)
    if links is None:
        links = measure_links()
    model = {"family": "gpt", **asdict(cfg)}
    key = profile_key(
        model=model, microbatch_size=microbatch_size, dtype=dtype, device_name=name,
        torch_version=torch.__version__, optimizer=optimizer, source="measured", devices_per_node=devices_per_node,
    )
    return Profile(
        layers=tuple(measured), device_name=name, device_memory_bytes=memory // devices_per_node,
        devices_per_node=devices_per_node, microbatch_size=microbatch_size, dtype=dtype, optimizer=optimizer,
        links=links, source="measured", model=model, key=key,
    )


if __name__ == "__main__":  # one process of measure_links: INIT_FILE BACKEND LARGE_BYTES RANK
    import json
    import sys

    _init, _backend, _large, _rank = sys.argv[1:5]
    _result = _link_worker(int(_rank), _init, _backend, int(_large))
    if _result is not None:
        print(json.dumps(_result))
