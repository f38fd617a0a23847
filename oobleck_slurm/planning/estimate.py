"""Estimated profiles: a model's per-layer FLOPs and bytes on a named GPU's peak figures.

Each family gives its layers' figures from their shapes (`ModelDef.layer_estimates`: FLOPs and memory
traffic of forward and backward, the bytes sent on, held for the backward and allocated for a moment);
here they become times: time = max(FLOPs / (peak * efficiency), bytes / HBM bandwidth).

Element sizes: e = bytes of the compute dtype (bf16: 2), p = bytes of the parameter dtype (what the
engine keeps: fp32 master weights under bf16, so p = 4 there; fp64: 8). Memory is as the engine holds
it (planning/cost.py `stage_memory`): parameters and gradients p bytes per parameter, and the
optimizer's state for parameters of dtype p from the optimizer's own layout (`optim.memory`), so
AdamW and CAME differ as they really do.
"""

from __future__ import annotations

from oobleck_slurm.models import ModelDef
from oobleck_slurm.planning.gpus import DEFAULT_EFFICIENCY, GPUSpec, gpu_spec
from oobleck_slurm.planning.profile import LayerProfile, Link, Profile, profile_key

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}  # the compute dtype's element (activations)
PARAM_BYTES = {"fp32": 4, "bf16": 4, "fp64": 8}  # the parameters' element: bf16 keeps fp32 master weights


def estimate_profile(
    cfg: ModelDef,
    gpu: str | GPUSpec,
    *,
    microbatch_size: int,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    devices_per_node: int | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> Profile:
    """A profile of `cfg` on `gpu` derived from peak figures (see the module docstring)."""
    import torch  # the optimizer layouts are expressed in torch dtypes

    from oobleck_slurm.optim.memory import optimizer_state_bytes

    spec = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    e, pe = DTYPE_BYTES[dtype], PARAM_BYTES[dtype]
    param_dtype = {"bf16": torch.float32, "fp32": torch.float32, "fp64": torch.float64}[dtype]
    # fp32 runs on TF32/FP32 units at about half the bf16 tensor rate.
    flops_per_s = spec.bf16_tflops * 1e12 * efficiency * (1.0 if dtype == "bf16" else 0.5)
    hbm = spec.hbm_TBps * 1e12
    layers = []
    for est in cfg.layer_estimates(microbatch_size, e, pe):
        pbytes = est.num_params * pe
        opt = optimizer_state_bytes(optimizer, est.param_shapes, param_dtype)
        layers.append(LayerProfile(
            est.name, max(est.forward_flops / flops_per_s, est.forward_bytes / hbm),
            max(est.backward_flops / flops_per_s, est.backward_bytes / hbm), pbytes, pbytes, opt,
            est.output_bytes, est.activation_bytes, est.workspace_bytes))
    per_node = devices_per_node or spec.devices_per_node
    nvlink = Link(spec.nvlink_latency_s, spec.nvlink_GBps * 1e9)
    net = Link(spec.network_latency_s, spec.network_GBps * 1e9)
    model = cfg.to_dict()
    source = f"estimate:{spec.name}:eff={efficiency}"
    key = profile_key(
        model=model, microbatch_size=microbatch_size, dtype=dtype, device_name=spec.name, torch_version="n/a",
        optimizer=optimizer, source=source, devices_per_node=per_node,
    )
    return Profile(
        layers=tuple(layers),
        device_name=spec.name,
        device_memory_bytes=int(spec.memory_gib * 2**30),
        devices_per_node=per_node,
        microbatch_size=microbatch_size,
        dtype=dtype,
        optimizer=optimizer,
        links={"intra_node": nvlink, "inter_node": net, "allreduce_intra": nvlink, "allreduce_inter": net},
        source=source,
        model=model,
        key=key,
    )
