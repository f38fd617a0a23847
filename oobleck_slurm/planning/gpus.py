"""Peak figures of common accelerators, for planning hardware that is not at hand (`--estimate GPU`).

Vendor data-sheet numbers (dense bf16 tensor throughput, no sparsity). Network is per GPU: the
node's injection bandwidth divided by its GPUs, which is what one pipeline boundary can use.
MI250X is counted per GCD (the OS and torch see each GCD as one GPU, 8 per node on LUMI-G).
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_slurm.errors import BadInputError


class UnknownGPU(BadInputError, LookupError):
    """A GPU name that is not in GPUS (`--estimate NAME`); the message lists the known names."""


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float
    memory_gib: float
    hbm_TBps: float
    nvlink_GBps: float  # per GPU, one direction, to a peer in the node
    network_GBps: float  # per GPU, one direction, to another node
    devices_per_node: int  # the usual node
    nvlink_latency_s: float = 5e-6
    network_latency_s: float = 1e-5


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("V100", 125.0, 32, 0.9, 150, 12.5, 4),
        GPUSpec("A100-40", 312.0, 40, 1.555, 300, 25, 4),
        GPUSpec("A100-80", 312.0, 80, 2.039, 300, 25, 8),
        GPUSpec("H100", 989.0, 80, 3.35, 450, 50, 8),
        GPUSpec("H200", 989.0, 141, 4.8, 450, 50, 8),
        GPUSpec("GH200", 989.0, 96, 4.0, 450, 25, 4),
        GPUSpec("MI250X", 191.5, 64, 1.6, 100, 12.5, 8),
        GPUSpec("MI300X", 1307.0, 192, 5.3, 448, 50, 8),
    )
}

# Fraction of peak matmul throughput that training kernels reach (typical MFU of large-model training).
DEFAULT_EFFICIENCY = 0.45


def gpu_spec(name: str) -> GPUSpec:
    """Look a GPU up by name, case-insensitively; the error lists the known names."""
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise UnknownGPU(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
