"""Model FLOPs per token and the peak of the device running them: what tokens/s and MFU are made of.

Pure arithmetic, no torch: the step event's throughput fields (protocol/records.py `StepResult`) are
derived from these. docs/engine.md ("Throughput and MFU") states the formula and the sources.

FLOPs per token are the planner's own per-layer counts (`ModelDef.layer_estimates`, the figures
`plan --estimate` turns into times), summed over the layers, forward + backward, divided by the tokens
of the microbatch. For the built-in families that is 6 N_matmul + 12 L s d' per token (PaLM's appendix
B formula: N the parameters of every weight matrix including the LM head, not the embedding lookup;
L layers, s the sequence length, d' the attention width n_head * head_dim; attention counted over
the full s x s square, not halved for causality). Recomputed activations are not counted: these are
model FLOPs, so MFU (not the hardware FLOPs utilisation) whether or not `training.recompute` is on.
"""

from __future__ import annotations

from oobleck_slurm.models.base import ModelDef
from oobleck_slurm.planning.gpus import GPUS

# torch.cuda.get_device_name substrings -> dense bf16 TFLOPS per device (vendor data sheets, no
# sparsity). Checked in order: the first match wins, so a longer name comes before a name it contains
# ("GH200" before "H200", "H100 PCIe" before "H100").
DEVICE_PEAKS: tuple[tuple[str, float], ...] = (
    ("GH200", GPUS["GH200"].bf16_tflops),
    ("H200", GPUS["H200"].bf16_tflops),
    ("H100 PCIe", 756.0),  # H100 PCIe data sheet: 1,513 TFLOPS bf16 with sparsity
    ("H100 NVL", 835.0),  # H100 NVL: 1,671 with sparsity
    ("H100", GPUS["H100"].bf16_tflops),  # SXM5: 1,979 with sparsity
    ("A100", GPUS["A100-80"].bf16_tflops),  # 40 and 80 GB alike
    ("MI300X", GPUS["MI300X"].bf16_tflops),
    ("MI250X", GPUS["MI250X"].bf16_tflops),  # per GCD: torch sees each GCD as a device
    ("V100", GPUS["V100"].bf16_tflops),  # fp16 tensor cores: V100 has no bf16
)


def flops_per_token(model: ModelDef) -> float | None:
    """Model FLOPs (forward + backward) per trained token; None for a family without shape-based
    figures (a user's factory model), whose MFU is then not reported."""
    try:
        # one sequence per microbatch; the byte sizes do not enter the FLOP counts
        layers = model.layer_estimates(1, 2, 4)
    except NotImplementedError:
        return None
    return sum(est.forward_flops + est.backward_flops for est in layers) / model.seq_len


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device: `override_tflops` (recipe `logging.peak_tflops`) if given,
    else the table's figure for a `torch.cuda.get_device_name` string; None when unknown (a CPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not device_name:
        return None
    name = device_name.upper()
    for key, tflops in DEVICE_PEAKS:
        if key.upper() in name:
            return tflops * 1e12
    return None


def mfu(flops_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s of one device over its peak; None without a peak."""
    if peak is None or peak <= 0:
        return None
    return flops_per_s_per_device / peak
