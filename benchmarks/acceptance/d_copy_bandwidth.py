"""Section (d) copy_bandwidth: GB/s of GPU <-> pinned/pageable host, GPU -> GPU, and the host's memcpy.

In full: the package's docstring (the command's --help).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from acceptance.harness import Record, Settings, free_device_memory, median, sync

if TYPE_CHECKING:
    pass


def bandwidth(copy: Callable[[], Any], nbytes: int, device: torch.device, reps: int = 10) -> dict[str, float]:
    for _ in range(2):
        copy()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        sync(device)
        times.append(time.perf_counter() - t0)
    med = median(times)
    return {"bytes": nbytes, "median_s": med, "GBps": nbytes / med / 1e9}


def section_copy_bandwidth(s: Settings, rec: Record) -> None:
    nbytes = s.copy_mb * 2**20
    src = torch.ones(nbytes, dtype=torch.uint8)
    results: dict[str, Any] = {"cpu_to_cpu": host_memcpy(src)}
    if not s.cuda:
        for name in ("gpu_to_pinned_host", "pinned_host_to_gpu", "gpu_to_pageable_host", "pageable_host_to_gpu",
                     "gpu_to_gpu"):
            results[name] = "skipped: no GPU"
    else:
        results.update(gpu_copies(src, s.torch_device))
        free_device_memory()
    rec.results["copies"] = results
    for name, r in results.items():
        if isinstance(r, dict):
            rec.check(f"{name}_positive", r["GBps"] > 0 and math.isfinite(r["GBps"]))
    rec.summary = ", ".join(f"{k} {v['GBps']:.1f} GB/s" if isinstance(v, dict) else f"{k} skipped"
                            for k, v in results.items() if isinstance(v, dict) or k == "gpu_to_gpu")


def host_memcpy(src: torch.Tensor) -> dict[str, Any]:
    dst = torch.empty_like(src)
    return {**bandwidth(lambda: dst.copy_(src), src.numel(), torch.device("cpu")), "threads": torch.get_num_threads()}


def gpu_copies(host: torch.Tensor, dev: torch.device) -> dict[str, Any]:
    """GPU <-> pinned and pageable host memory, and GPU -> GPU on one device, `host`'s size each."""
    nbytes = host.numel()
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    gpu2 = torch.empty_like(gpu)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {
        "gpu_to_pinned_host": bandwidth(lambda: pinned.copy_(gpu, non_blocking=True), nbytes, dev),
        "pinned_host_to_gpu": bandwidth(lambda: gpu.copy_(pinned, non_blocking=True), nbytes, dev),
        "gpu_to_pageable_host": bandwidth(lambda: host.copy_(gpu), nbytes, dev),
        "pageable_host_to_gpu": bandwidth(lambda: gpu.copy_(host), nbytes, dev),
        "gpu_to_gpu": bandwidth(lambda: gpu2.copy_(gpu), nbytes, dev),
    }
    # A device-to-device copy reads and writes every byte: the memory traffic is twice the size.
    out["gpu_to_gpu"]["memory_traffic_GBps"] = 2 * out["gpu_to_gpu"]["GBps"]
    return out
