"""Estimated profiles: a GPT's per-layer FLOPs and bytes on a named GPU's peak figures.

Per microbatch of b sequences of s tokens (t = b * s), d = d_model, h = n_head, V = vocab, e =
bytes per element of the compute dtype (bf16: 2), p = bytes per element of the parameter dtype (what
the engine keeps: fp32 master weights under bf16, so p = 4 there; fp64: 8):

    block:  forward FLOPs  = t * (24 d^2 + 4 s d)    (QKV/proj/MLP matmuls, attention scores and mix)
            backward FLOPs = 2 * forward
            held activations = t * d * (34 + 5 h s / d) * e / 2   (Korthikanti et al. 2022, no recompute)
    head:   forward FLOPs  = 2 t d V; held: its input + fp32 log-probabilities of the loss (t * V * 4)
    embed:  memory bound: t * d * e bytes written (forward), twice that in backward; held: the token ids
    time  = max(FLOPs / (peak * efficiency), bytes / HBM bandwidth)

Memory, as the engine holds it (planning/cost.py `stage_memory`): parameters and gradients p bytes per
parameter, the optimizer's state for parameters of dtype p, a layer's output (sent to the next stage,
in the parameter dtype) t * d * p; under bf16 autocast every weight matrix of a block and the head is
also cast to bf16 once per forward and kept for the backward: 2 bytes per matrix entry in each
microbatch's held activations. Workspace (what one layer's backward allocates for a moment, fitted to
the measured CPU figures of models/gpt.py): block 2 * t * 4d * p (gradients of the MLP's hidden
activations), head 2 * t * V * 4 + 2 * t * d * p (gradients of the log-probabilities and logits, of
its input), embedding V * d * p + t * d * p (the dense gradient of its table, of its output).

Parameter shapes follow `models.gpt` (tested against it); optimizer-state bytes come from the
optimizer's own layout (`optim.memory`), so AdamW and CAME differ as they really do.
"""

from __future__ import annotations

from dataclasses import asdict

from oobleck_slurm.models.config import GPTConfig
from oobleck_slurm.planning.gpus import DEFAULT_EFFICIENCY, GPUSpec, gpu_spec
from oobleck_slurm.planning.profile import LayerProfile, Link, Profile, profile_key

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}  # the compute dtype's element (activations)
PARAM_BYTES = {"fp32": 4, "bf16": 4, "fp64": 8}  # the parameters' element: bf16 keeps fp32 master weights


def gpt_layer_shapes(cfg: GPTConfig) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of each layer of `models.gpt.build_layers(cfg)`, without building it."""
    d, v = cfg.d_model, cfg.vocab_size
    embed: list[tuple[int, ...]] = [(v, d), (cfg.seq_len, d)]
    block: list[tuple[int, ...]] = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    head: list[tuple[int, ...]] = [(d,), (d,), (v, d)]
    return [embed] + [block] * cfg.n_layer + [head]


def _numel(shapes: list[tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for x in shape:
            n *= x
        total += n
    return total


def estimate_profile(
    cfg: GPTConfig,
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
    b, s, d, h, v = microbatch_size, cfg.seq_len, cfg.d_model, cfg.n_head, cfg.vocab_size
    t = b * s

    def seconds(flops: float, nbytes: float) -> float:
        return max(flops / flops_per_s, nbytes / hbm)

    layers = []
    shapes = gpt_layer_shapes(cfg)
    names = ["embed"] + [f"block.{i}" for i in range(cfg.n_layer)] + ["head"]
    for i, (name, layer_shapes) in enumerate(zip(names, shapes)):
        params = _numel(layer_shapes)
        traffic = params * e  # weights read by the compute, in its dtype
        matrices = sum(_numel([shape]) for shape in layer_shapes if len(shape) == 2)
        casts = 2 * matrices if dtype == "bf16" and i > 0 else 0  # autocast's bf16 weights (not the embedding's)
        if i == 0:
            written = t * d * e
            fwd, bwd = seconds(0, written + t * 8), seconds(0, 2 * written + traffic)
            out = t * d * pe
            held = t * 8
            workspace = v * d * pe + t * d * pe
        elif i == len(shapes) - 1:
            flops = 2 * t * d * v
            fwd, bwd = seconds(flops, traffic), seconds(2 * flops, 2 * traffic)
            out = t * v * e
            held = t * d * e + t * v * 4 + casts
            workspace = 2 * t * v * 4 + 2 * t * d * pe
        else:
            flops = t * (24 * d * d + 4 * s * d)
            fwd, bwd = seconds(flops, traffic), seconds(2 * flops, 2 * traffic)
            out = t * d * pe
            held = int(t * d * (34 + 5 * h * s / d) * e / 2) + casts
            workspace = 2 * t * 4 * d * pe
        pbytes = params * pe
        opt = optimizer_state_bytes(optimizer, layer_shapes, param_dtype)
        layers.append(LayerProfile(name, fwd, bwd, pbytes, pbytes, opt, out, held, workspace))
    per_node = devices_per_node or spec.devices_per_node
    nvlink = Link(spec.nvlink_latency_s, spec.nvlink_GBps * 1e9)
    net = Link(spec.network_latency_s, spec.network_GBps * 1e9)
    model = {"family": "gpt", **asdict(cfg)}
    source = f"estimate:{spec.name}:eff={efficiency}"
    key = profile_key(
        model=model, microbatch_size=b, dtype=dtype, device_name=spec.name, torch_version="n/a",
        optimizer=optimizer, source=source, devices_per_node=per_node,
    )
    return Profile(
        layers=tuple(layers),
        device_name=spec.name,
        device_memory_bytes=int(spec.memory_gib * 2**30),
        devices_per_node=per_node,
        microbatch_size=b,
        dtype=dtype,
        optimizer=optimizer,
        links={"intra_node": nvlink, "inter_node": net, "allreduce_intra": nvlink, "allreduce_inter": net},
        source=source,
        model=model,
        key=key,
    )
