"""FLOPs per token, device peaks and MFU (planning/flops.py), and the step event's throughput fields."""

from __future__ import annotations

import pytest

from oobleck_slurm.models.gpt.config import GPT_PRESETS
from oobleck_slurm.models.llama.config import LLAMA_PRESETS
from oobleck_slurm.planning.flops import flops_per_token, mfu, peak_flops
from oobleck_slurm.protocol.event_schema import check_event
from oobleck_slurm.protocol.records import StepResult


def test_gpt_125m_by_hand() -> None:
    # GPT-3 125M: L=12, d=768, s=2048, V=50304. Matrices: 12 d^2 per block (qkv 3d^2, proj d^2, MLP 8d^2)
    # and the head d V: N = 12*12*768^2 + 768*50304 = 84,934,656 + 38,633,472 = 123,568,128.
    # 6N = 741,408,768; attention 12 L s d = 12*12*2048*768 = 226,492,416; sum 967,901,184.
    assert flops_per_token(GPT_PRESETS["125m"]) == 967_901_184


def test_llama_8b_by_hand() -> None:
    # Llama 3.1 8B: d=4096, 32 query heads, 8 kv heads of 128 (k = v = 1024 wide), f=14336, V=128256,
    # L=32, s=8192. Per block q+o 2*4096^2 + k,v 2*1024*4096 + MLP 3*14336*4096 = 218,103,808;
    # N = 32 * that + 4096*128256 = 7,504,658,432; 6N = 45,027,950,592; 12 L s q = 12,884,901,888.
    assert flops_per_token(LLAMA_PRESETS["3.1-8b"]) == 57_912_852_480


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-SXM4-40GB", 312.0),
    ("AMD Instinct MI250X", 191.5), ("AMD Instinct MI300X", 1307.0),
])
def test_peak_of_known_devices(name: str, tflops: float) -> None:
    assert peak_flops(name) == tflops * 1e12


def test_peak_unknown_and_override() -> None:
    assert peak_flops(None) is None and peak_flops("NVIDIA GeForce GTX 1080") is None
    assert peak_flops(None, 1.5) == 1.5e12 and peak_flops("NVIDIA H100 80GB HBM3", 500.0) == 500e12
    assert mfu(400e12, None) is None and mfu(400e12, 1000e12) == pytest.approx(0.4)


def test_step_event_throughput() -> None:
    # 8 devices train 16 sequences of 2048 tokens of GPT 125M in 0.5 s on H100s.
    tokens = 16 * 2048
    flops = tokens * 967_901_184
    result = StepResult(step=3, loss=2.0, grad_norm=1.0, lr=1e-4, seconds=0.5, tokens=tokens, devices=8,
                        flops=flops, peak_flops=989e12)
    event = result.event(generation=1, global_batch_size=16)
    check_event("step", event)  # every field is in the schema
    assert event["tokens_per_s"] == tokens / 0.5 == 65_536
    assert event["tokens_per_s_per_device"] == 8192 and event["devices"] == 8
    per_device = flops / 0.5 / 8  # 7.93e12 FLOP/s
    assert event["tflops_per_device"] == pytest.approx(per_device / 1e12)
    assert event["mfu"] == pytest.approx(per_device / 989e12) == pytest.approx(0.008016, rel=1e-3)
    # no peak (a CPU): no MFU; no FLOP counts (a factory model): no TFLOP/s either
    cpu = StepResult(step=3, loss=2.0, grad_norm=1.0, lr=1e-4, seconds=0.5, tokens=tokens, devices=8, flops=flops)
    assert "mfu" not in cpu.event(1, 16) and "tflops_per_device" in cpu.event(1, 16)
    factory = StepResult(step=3, loss=2.0, grad_norm=1.0, lr=1e-4, seconds=0.5, tokens=tokens, devices=8)
    assert "tflops_per_device" not in factory.event(1, 16) and factory.event(1, 16)["tokens_per_s"] == 65_536
