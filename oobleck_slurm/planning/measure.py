"""Measured profiles: real forward/backward per layer on this device, real transfers between processes.

Times are medians over `repeats` runs after `warmup` runs. Held activation bytes are what autograd
actually saves for backward (counted with saved-tensor hooks, parameters excluded), so the memory
model sees the real implementation, not a formula. Layers run as the engine runs them: parameters in
the precision's parameter dtype (fp32 master weights for bf16, fp64 for fp64) and, for bf16, the
forward under autocast, so the bf16 copy of each weight matrix that autocast casts and autograd keeps
for the backward is counted with the activations; the GPT's last layer includes its loss (the log-
probabilities cross-entropy keeps). A layer's workspace is the most its forward or backward allocates
for a moment beyond what it keeps, measured once per layer after the timings (oobleck_slurm/peak_memory.py:
max_memory_allocated on a GPU; on the CPU the process's peak resident memory, for which glibc is set to
return freed memory to the OS for the rest of the process: `profile_model`'s processes are the
planning commands'). Links are measured between two local processes
(gloo on CPU, nccl when two GPUs are visible): this machine has no second node, so the inter-node
figures equal the intra-node ones; plan a multi-node GPU job from a profile file made on its
nodes, or with `--estimate`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

import torch
from torch import nn

from oobleck_slurm.models import ModelDef
from oobleck_slurm.planning.profile import LayerProfile, Link, Profile, profile_key

# The parameters' dtype under each precision (engine/spec.py TrainSpec.param_dtype): bf16 trains fp32
# master weights under autocast.
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}


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
    autocast: torch.dtype | None = None,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    workspace: bool = False,
) -> list[LayerProfile]:
    """Run each layer on the previous layer's output; time forward and backward, count bytes.

    `autocast`: run the forwards under torch.autocast to this dtype (bf16 precision). `loss`: applied
    to the last layer's output inside its forward (its saved tensors count as the last layer's).
    `workspace`: also measure each layer's workspace (`layer_workspace`; on the CPU this sets glibc's
    malloc for the rest of the process), else it is 0."""
    from oobleck_slurm.optim.memory import optimizer_state_bytes

    x = sample_input
    device = sample_input.device
    out_profiles = []
    cast = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast is not None else contextlib.nullcontext
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        params = list(layer.parameters())
        # By storage: views of one tensor (attention's q, k, v of one qkv projection) hold its memory once.
        param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, param_ptrs: set[int] = param_ptrs, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_ptrs:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        fwd, bwd = [], []
        out = None
        for rep in range(warmup + repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            saved.clear()
            _sync(device)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast():
                out = layer(inp)
                scalar = loss(out) if last and loss is not None else None
            _sync(device)
            t1 = time.perf_counter()
            if scalar is not None:
                scalar.backward()
            else:
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
    if workspace:
        spaces = layer_workspace(layers, sample_input, autocast=autocast, loss=loss)
        out_profiles = [replace(p, workspace_bytes=w) for p, w in zip(out_profiles, spaces)]
    return out_profiles


# Tries per layer of a CPU workspace measurement (see layer_workspace).
CPU_WORKSPACE_TRIES = 3


def layer_workspace(
    layers: Sequence[nn.Module],
    sample_input: torch.Tensor,
    *,
    autocast: torch.dtype | None = None,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Per layer, the most its forward or backward allocates at one moment beyond what it keeps: during
    the forward, the peak above the bytes it leaves behind (saved tensors, output); during the backward,
    the peak above the bytes held when it starts (every saved tensor still alive). Parameter gradients
    exist beforehand, as in the engine (one flat buffer per layer), so they are not counted.

    GPU: torch.cuda.max_memory_allocated. CPU: the process's peak anonymous resident memory
    (peak_memory.PeakMemory), with glibc set to return freed chunks to the OS and the heap trimmed before
    each measurement, so that RSS follows the tensors; without glibc the CPU figures are 0."""
    from oobleck_slurm import peak_memory

    device = sample_input.device
    if device.type == "cpu" and not peak_memory.release_freed_memory():
        return [0] * len(layers)
    probe = peak_memory.PeakMemory(device)
    cast = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast is not None else contextlib.nullcontext
    # A GPU's allocator counts exactly; a CPU's resident memory also moves with everything else the
    # process does (page faults of other threads, allocator arenas), which only ever adds to a peak:
    # the least of a few tries is the layer's own.
    tries = 1 if device.type == "cuda" else CPU_WORKSPACE_TRIES
    spaces = []
    x = sample_input
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        last = i == len(layers) - 1
        seen = []
        for _ in range(tries):
            inp = x.detach().requires_grad_(x.is_floating_point())
            peak_memory.trim_heap()
            probe.start()
            with cast():
                out = layer(inp)
                scalar = loss(out) if last and loss is not None else None
            forward = probe.peak() - probe.now()  # the peak above what the forward leaves behind
            seed = torch.ones_like(out) if scalar is None else None
            peak_memory.trim_heap()
            start = probe.now()
            probe.start()
            if scalar is not None:
                scalar.backward()
            else:
                out.backward(seed)
            backward = probe.peak() - start
            seen.append(max(0, forward, backward))
            del scalar, seed, inp
        spaces.append(min(seen))
        layer.zero_grad(set_to_none=True)
        x = out.detach()
        del out
    return spaces


def _link_worker(rank: int, init_file: str, backend: str, large_n: int,
                 timeout_s: float) -> tuple[float, float, float, float] | None:
    """One end of `measure_links`, on a 2-rank group of its own (no default group: rank 0 runs in the
    planning command's process); rank 0 returns the medians."""
    import datetime as dt

    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    timeout = dt.timedelta(seconds=timeout_s)
    store = dist.FileStore(init_file, 2)
    store.set_timeout(timeout)
    backend_pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend_pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    else:
        backend_pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
    # torch's stubs give these classes none of the operations they have at run time (engine/comm.py)
    pg = cast(dist.ProcessGroup, backend_pg)
    small = torch.zeros(16, device=device)
    large = torch.zeros(large_n // 4, device=device)

    def pingpong(buf: torch.Tensor, reps: int) -> float:
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            if rank == 0:
                pg.send([buf], 1, 0).wait()
                pg.recv([buf], 1, 0).wait()
            else:
                pg.recv([buf], 0, 0).wait()
                pg.send([buf], 0, 0).wait()
            _sync(device)
            times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times)

    def allreduce(buf: torch.Tensor, reps: int) -> float:
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            pg.allreduce([buf]).wait()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    pingpong(small, 3)
    result = (pingpong(small, 30), pingpong(large, 5), allreduce(small, 20), allreduce(large, 5))
    pg.allreduce([small]).wait()  # neither end leaves before the other is done
    return result if rank == 0 else None


def measure_links(large_bytes: int = 8 << 20, timeout_s: float = 120.0) -> dict[str, Link]:
    """Alpha-beta links fitted from real transfers between this process and a fresh local one.

    This process is rank 0 (torch is imported here already: one cold start instead of two, ~2 s of CPU);
    the other is started as `python -m oobleck_slurm.planning.measure`, not with multiprocessing's
    spawn, which would re-run the CLI's unguarded __main__ in the child.
    """
    import subprocess
    import sys

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        cmd = [sys.executable, "-m", "oobleck_slurm.planning.measure", init_file, backend, str(large_bytes),
               str(timeout_s)]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        error: BaseException | None = None
        result = None
        try:
            torch.set_num_threads(1)  # as the child, and as each CPU worker of a job
            result = _link_worker(0, init_file, backend, large_bytes, timeout_s)
        except RuntimeError as e:  # the child died or never connected: its stderr says why
            error = e
            child.kill()
        finally:
            torch.set_num_threads(threads)
            try:
                _, err = child.communicate(timeout=timeout_s)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    if error is not None or child.returncode or result is None:
        why = (err.strip().splitlines() or [""])[-1] if child.returncode and err.strip() else str(error or "")
        raise RuntimeError(f"link measurement between two local processes failed: {why or 'no message'}")
    lat, big, ar_small, ar_big = result
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
    cfg: ModelDef,
    *,
    microbatch_size: int,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    devices_per_node: int = 1,
    repeats: int = 5,
    links: dict[str, Link] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Measure the model `cfg` (any family) on this machine (first GPU, or the CPU with one thread), as
    the engine trains it (see the module doc: parameter dtype, autocast, the loss on the last layer)."""
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(PARAM_DTYPES)}, got {dtype!r}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # what each CPU worker runs with
    layers = [layer.to(dtype=PARAM_DTYPES[dtype]) for layer in cfg.build_layers(0, 0, cfg.num_layers, device=device)]
    sample = torch.randint(cfg.vocab_size, (microbatch_size, cfg.seq_len), device=device)
    targets = torch.randint(cfg.vocab_size, (microbatch_size, cfg.seq_len), device=device)
    measured = profile_layers(
        layers, sample, optimizer=optimizer, repeats=repeats, names=cfg.layer_keys(), progress=progress,
        autocast=torch.bfloat16 if dtype == "bf16" else None, loss=lambda logits: cfg.loss(logits, targets),
        workspace=True,
    )
    name, memory = device_description(device)
    if links is None:
        links = measure_links()
    model = cfg.to_dict()
    key = profile_key(
        model=model, microbatch_size=microbatch_size, dtype=dtype, device_name=name,
        torch_version=torch.__version__, optimizer=optimizer, source="measured", devices_per_node=devices_per_node,
    )
    # Each GPU has its own memory; a CPU's is shared by the node's workers.
    per_device = memory if device.type == "cuda" else memory // devices_per_node
    return Profile(
        layers=tuple(measured), device_name=name, device_memory_bytes=per_device,
        devices_per_node=devices_per_node, microbatch_size=microbatch_size, dtype=dtype, optimizer=optimizer,
        links=links, source="measured", model=model, key=key,
    )


if __name__ == "__main__":  # the other end of measure_links: INIT_FILE BACKEND LARGE_BYTES TIMEOUT_S
    import sys

    torch.set_num_threads(1)
    _init, _backend, _large, _timeout = sys.argv[1:5]
    _link_worker(1, _init, _backend, int(_large), float(_timeout))
